"""A `torch.distributed.checkpoint` directory (FSDP2's, torchtitan's) read tensor by tensor.

torch's own reader does the reading (`dcp.load` without collectives, `no_dist=True`), so
every layout DCP writes is understood: one file per rank, chunks of DTensors sharded any
way, resharded by DCP into what is asked for. A range of a tensor is read as the rows of
its first dimension that hold it (a load planner asking DCP for that block only), so a
rank reads about what it keeps; a whole tensor (`tensor`) is read once and kept until
another is asked for. The metadata file is a pickle that torch's reader unpickles: read checkpoints
you trust, as with `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import warnings
from typing import Any

import torch

from ._tensor_index import Entry

METADATA = ".metadata"


def is_dcp(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


class DcpFiles:
    """`entries`, `read`, `tensor`, `digest` and `close`, as `TensorFile`'s."""

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._reader = FileSystemReader(path)
        try:
            metadata = self._reader.read_metadata()
        except Exception as exc:
            raise ValueError(
                f"{path}: not a readable torch.distributed.checkpoint ({exc!r})"
            ) from None
        self.entries: dict[str, Entry] = {
            fqn: Entry(0, md.properties.dtype, tuple(md.size))
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        self._held: tuple[str, torch.Tensor] | None = None

    def close(self) -> None:
        self._held = None

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, read by DCP (and kept until another is asked for)."""
        if self._held is not None and self._held[0] == name:
            return self._held[1]
        self._held = None  # the previous one goes before the next is read
        e = self.entries[name]
        value = torch.empty(e.shape, dtype=e.dtype)
        self._load({name: value})
        self._held = (name, value)
        return value

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The whole tensors `names`, read by one DCP load (many small ones: steps)."""
        out = {n: torch.empty(self.entries[n].shape, dtype=self.entries[n].dtype) for n in names}
        if out:
            self._load(out)
        return out

    def read(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flattened tensor `name` into `out` (converted): only the
        rows of its first dimension that hold them are read (DCP reads the parts of the
        saved chunks that overlap them), unless the tensor is at hand already."""
        e = self.entries[name]
        if (self._held is not None and self._held[0] == name) or len(e.shape) == 0:
            out.copy_(self.tensor(name).reshape(-1)[lo:hi])
            return
        row = max(1, math.prod(e.shape[1:]))
        first, last = lo // row, -(-hi // row)
        block = torch.empty((last - first, *e.shape[1:]), dtype=e.dtype)
        self._load({name: block}, _rows_planner()(name, first, block))
        out.copy_(block.reshape(-1)[lo - first * row : hi - first * row])

    def _load(self, tensors: dict[str, torch.Tensor], planner: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(tensors, storage_reader=self._reader, planner=planner, no_dist=True)

    def digest(self) -> str:
        """What every rank must agree on: the metadata's bytes and the data files' sizes."""
        h = hashlib.blake2b(digest_size=16)
        with open(os.path.join(self.path, METADATA), "rb") as f:
            h.update(f.read())
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if name.endswith(".distcp") and os.path.isfile(full):
                h.update(f"{name}:{os.path.getsize(full)}".encode())
        return h.hexdigest()


@functools.cache
def _rows_planner() -> type:
    """The DCP load planner class whose `(name, first, block)` reads the rows of tensor
    `name` from row `first` into `block`. Made once: a class made per read is a reference
    cycle (as every class is), which would keep its read block alive until the cyclic
    collector ran, and a rank's import then held many blocks at once."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Rows(DefaultLoadPlanner):
        def __init__(self, name: str, first: int, block: torch.Tensor) -> None:
            super().__init__()
            self.name, self.first, self.block = name, first, block

        def create_local_plan(self) -> LoadPlan:
            assert self.metadata is not None
            offsets = torch.Size([self.first] + [0] * (self.block.dim() - 1))
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=self.block.shape)
            md = self.metadata.state_dict_metadata[self.name]
            return LoadPlan(create_read_items_for_chunk_list(self.name, md, [chunk]))

        def lookup_tensor(self, index: Any) -> torch.Tensor:
            return self.block  # the read items' offsets are the block's own

    return Rows
