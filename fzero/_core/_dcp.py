"""A `torch.distributed.checkpoint` directory (FSDP2's, torchtitan's) read tensor by tensor.

torch's own reader does the reading (`dcp.load` without collectives, `no_dist=True`), so
every layout DCP writes is understood: one file per rank, chunks of DTensors sharded any
way, resharded by DCP into the tensor asked for. One whole tensor is read at a time and
kept until another is asked for, so a rank holds at most the largest tensor besides its
shards. The metadata file is a pickle that torch's reader unpickles: read checkpoints
you trust, as with `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

from ._tensorfile import Entry

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
        import torch.distributed.checkpoint as dcp

        self._held = None  # the previous one goes before the next is read
        e = self.entries[name]
        value = torch.empty(e.shape, dtype=e.dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load({name: value}, storage_reader=self._reader, no_dist=True)
        self._held = (name, value)
        return value

    def read(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of the flattened tensor `name` into `out` (converted)."""
        out.copy_(self.tensor(name).reshape(-1)[lo:hi])

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
