"""Tensor files read by element range and written piece by piece: safetensors and torch.save.

Both formats store each tensor's bytes contiguously at a known file offset, so a rank can
read exactly the elements it keeps and a writer can fill a tensor from its pieces in any
order. Reads go through `readinto` on an unbuffered file, straight into the destination
tensor, rather than through a memory map: mapped file pages count in the process's
resident set and address space, read pages of the page cache do not, and the point of
reading by range is that the process never holds more than its slice.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._tensor_index import SAFETENSORS_NAMES, safetensors_entries, torch_entries


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 too)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TensorFile:
    """A safetensors file, or a torch.save file of a flat dict of tensors, read by range."""

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic == b"PK\x03\x04":  # torch.save's zip format
            self.entries = torch_entries(self.path)
        else:
            self.entries = safetensors_entries(self.path)
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by close()

    def close(self) -> None:
        self._file.close()

    def read(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Writes elements [lo, hi) of the flattened tensor `name` into the 1-D `out`,
        converting to `out`'s dtype (as `load_state_dict` does) when they differ."""
        e = self.entries[name]
        if hi <= lo:
            return
        if e.stride is not None:  # a view into a larger storage: read the span, then cut
            span = torch.empty(e.span, dtype=e.dtype, device="cpu")
            self._readinto(e.offset, span)
            full = torch.as_strided(span, e.shape, e.stride)
            out.copy_(full.reshape(-1)[lo:hi])
            return
        direct = out.dtype == e.dtype and out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(hi - lo, dtype=e.dtype, device="cpu")
        self._readinto(e.offset + lo * e.dtype.itemsize, dst)
        if not direct:
            out.copy_(dst)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, read into new memory."""
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype, device="cpu")
        self.read(name, 0, e.numel, out.view(-1))
        return out

    def _readinto(self, offset: int, dst: torch.Tensor) -> None:
        view, done = as_bytes(dst), 0
        self._file.seek(offset)
        while done < len(view):
            n = self._file.readinto(view[done:])
            if not n:
                raise ValueError(f"{self.path}: file ends inside a tensor (truncated?)")
            done += n

    def digest(self) -> str:
        """What ranks compare to know they read the same file: its size, its index, and
        a sample of every tensor's bytes (at its start, middle and end), so that two
        copies with the same names and shapes but other values differ. A few small reads
        per tensor, whatever its size."""
        h = hashlib.blake2b(digest_size=8)
        fd = self._file.fileno()
        for name, e in sorted(self.entries.items()):
            h.update(repr((name, e.offset, str(e.dtype), e.shape, e.stride)).encode())
            nbytes = (e.span or e.numel) * e.dtype.itemsize
            for at in sorted({0, max(0, nbytes // 2 - _SAMPLE // 2), max(0, nbytes - _SAMPLE)}):
                h.update(os.pread(fd, min(_SAMPLE, nbytes), e.offset + at))
        return f"{os.path.getsize(self.path)}:{h.hexdigest()}"


_SAMPLE = 64  # bytes read per sample of a tensor for `TensorFile.digest`


class OffsetWriter:
    """Writes tensors' pieces at their byte offsets into a file being built (`path.tmp-*`),
    then commits it with fsync and an atomic rename."""

    def __init__(self, path: str, offsets: dict[Any, tuple[int, torch.dtype]]) -> None:
        self.path = os.fspath(path)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        self.offsets = offsets
        self._fd = -1

    def open(self, build: Callable[[Any], None]) -> None:
        """Creates the temporary file; `build(file)` writes its headers. Removes it again
        if that fails."""
        try:
            with open(self.tmp, "wb") as f:
                build(f)
            self._fd = os.open(self.tmp, os.O_RDWR)
        except BaseException as exc:
            self.abort()
            _name_file(exc, self.path)
            raise

    def write(self, key: Any, lo: int, values: torch.Tensor) -> None:
        """Writes `values` as elements lo, lo+1, ... of tensor `key`."""
        offset, dtype = self.offsets[key]
        data = values.detach().reshape(-1).to("cpu", dtype).contiguous()
        view, done = as_bytes(data), 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + lo * dtype.itemsize + done)

    def flush(self) -> None:
        """fsync and close the temporary file: durable, not yet in place."""
        try:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
        except OSError as exc:
            _name_file(exc, self.path)
            raise

    def commit(self) -> None:
        """`flush`, then the atomic rename over `path` (an older file stays until then)."""
        self.flush()
        try:
            os.replace(self.tmp, self.path)
        except OSError as exc:
            _name_file(exc, self.path)
            raise
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        """Removes the temporary file (the file at `path` is left as it was)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if os.path.lexists(self.tmp):
            os.remove(self.tmp)


def _name_file(exc: BaseException | None, path: str) -> None:
    """Names `path` in the OS errors behind `exc` that name no file (a write or truncate
    of an open file does not; torch.save's is its "unexpected pos" error's context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = path
        exc = exc.__cause__ or exc.__context__


def safetensors_writer(
    path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
) -> OffsetWriter:
    """A writer of a safetensors file holding `specs` (name -> dtype, shape), in that order;
    `metadata` must map strings to strings (the format's rule, checked before anything
    is written)."""
    bad = [
        (k, v)
        for k, v in (metadata or {}).items()
        if not (isinstance(k, str) and isinstance(v, str))
    ]
    if bad:
        k, v = bad[0]
        raise TypeError(
            f"safetensors metadata maps strings to strings; {k!r}: {v!r} is "
            f"{type(k).__name__} -> {type(v).__name__} (write str({v!r}), or json.dumps it)"
        )
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    cursor = 0
    for name, (dtype, shape) in specs.items():
        if dtype not in SAFETENSORS_NAMES:
            raise TypeError(f"tensor {name!r}: safetensors cannot hold {dtype}")
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [cursor, cursor + nbytes],
        }
        cursor += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8-byte alignment
    start = 8 + len(raw)
    offsets = {
        name: (start + info["data_offsets"][0], specs[name][0])
        for name, info in header.items()
        if name != "__metadata__"
    }
    writer = OffsetWriter(path, offsets)

    def build(f: io.BufferedWriter) -> None:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(start + cursor)  # sized up front; unwritten bytes read as zeros

    writer.open(build)
    return writer


def torch_writer(path: str, obj: Any) -> OffsetWriter:
    """A writer of a torch.save file of `obj`, whose tensors may be fake (no data).

    torch.save writes the pickle and reserves every storage's bytes without writing
    them (`skip_data`); loading the result on the meta device reports each storage's
    offset. The writer's keys are the ids of `obj`'s tensors; a real tensor in `obj`
    must still be written with `write`.
    """
    leaves = optree.tree_leaves(obj, none_is_leaf=True)
    writer = OffsetWriter(path, {})

    def build(f: io.BufferedWriter) -> None:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(obj, f)

    writer.open(build)
    back = optree.tree_leaves(
        torch.load(writer.tmp, map_location="meta", weights_only=True), none_is_leaf=True
    )
    if len(back) != len(leaves):
        raise RuntimeError("torch.save skeleton did not load back with the same structure")
    for mine, theirs in zip(leaves, back):
        if isinstance(mine, torch.Tensor):
            start = theirs.untyped_storage()._checkpoint_offset
            offset = start + theirs.storage_offset() * theirs.element_size()
            writer.offsets[id(mine)] = (offset, mine.dtype)
    return writer


def fsync_dir(path: str) -> None:
    """Makes a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
