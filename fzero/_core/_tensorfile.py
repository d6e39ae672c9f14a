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
import math
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch

# safetensors dtype names (the format's specification) <-> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie in a file."""

    offset: int  # byte offset of element 0 of the storage span below
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None  # None: contiguous
    span: int = 0  # elements of the storage span a non-contiguous tensor lives in

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


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
            self.entries = _torch_entries(self.path)
        else:
            self.entries = _safetensors_entries(self.path)
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


def _safetensors_entries(path: str) -> dict[str, Entry]:
    """The tensors of a safetensors file, its header checked as strictly as the
    `safetensors` library checks it: a file that library refuses is refused here, never
    read as garbage (a dtype whose size disagrees with its byte span, spans outside the
    file or overlapping, a data region not wholly indexed)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: neither a safetensors nor a torch.save file (too short)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20 or 8 + n > size:
            raise ValueError(
                f"{path}: neither a safetensors nor a torch.save file (its first 8 bytes "
                f"announce a {n}-byte header in a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ValueError(f"{path}: safetensors __metadata__ must map strings to strings")
    data = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end, dtype, shape = _checked_entry(path, name, info, data)
        spans.append((begin, end, name))
        out[name] = Entry(8 + n + begin, dtype, shape)
    cursor, last = 0, None
    for begin, end, name in sorted(spans):
        if begin != cursor:
            what = (
                f"overlaps {last!r}"
                if begin < cursor
                else f"leaves bytes {cursor}-{begin} unindexed"
            )
            raise ValueError(f"{path}: tensor {name!r} (bytes {begin}-{end}) {what}")
        cursor, last = end, name
    if cursor != data:
        raise ValueError(f"{path}: the tensors index {cursor} of the {data} data bytes")
    return out


def _checked_entry(
    path: str, name: str, info: Any, data: int
) -> tuple[int, int, torch.dtype, tuple[int, ...]]:
    """One header entry's byte span, dtype and shape, or a ValueError naming the tensor."""
    if not isinstance(info, dict):
        raise ValueError(f"{path}: tensor {name!r} has no dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r}, not supported")
    if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2:
        raise ValueError(f"{path}: tensor {name!r} has shape {shape!r}, data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = SAFETENSORS_DTYPES[dtype].itemsize * math.prod(shape)
    if end - begin != nbytes:
        raise ValueError(
            f"{path}: tensor {name!r} is {dtype} {shape} ({nbytes} bytes) but its data_offsets "
            f"span {end - begin} bytes"
        )
    if end > data:
        raise ValueError(f"{path}: tensor {name!r} ends at byte {end} of {data}: truncated?")
    return begin, end, SAFETENSORS_DTYPES[dtype], tuple(shape)


def _naturals(v: Any) -> bool:
    """Whether `v` is a JSON list of non-negative ints."""
    return isinstance(v, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v
    )


def _torch_entries(path: str) -> dict[str, Entry]:
    # Loading onto the meta device reads only the pickle and reports every storage's byte
    # offset in the file (torch's layout control); no tensor data is read.
    try:
        obj = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:  # a global that is not a tensor's: never run
        first = str(exc).split("WeightsUnpickler error:", 1)[-1].strip().split(".")[0]
        raise ValueError(
            f"{path}: not a file of tensors only; torch.load(weights_only=True) refused it "
            f"({first}), and fzero runs no code from a file"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # fzero's export_torch format: {"model": ..., "optimizer": ...}
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(
            f"{path}: expected a torch.save'd state dict (a flat dict of tensors), got "
            f"{type(obj).__name__}"
        )
    with zipfile.ZipFile(path) as z:  # torch.load reads a recompressed archive; offsets don't
        if any(i.compress_type and "/data/" in i.filename for i in z.infolist()):
            raise ValueError(f"{path}: its tensors are compressed: torch.save it again")
    out, size = {}, os.path.getsize(path)
    for name, t in obj.items():
        base = t.untyped_storage()._checkpoint_offset
        if base + t.untyped_storage().nbytes() > size:
            raise ValueError(f"{path}: tensor {name!r} ends past the end of the file: truncated?")
        start = base + t.storage_offset() * t.element_size()
        if t.is_contiguous():
            out[name] = Entry(start, t.dtype, tuple(t.shape))
        else:
            span = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
            out[name] = Entry(start, t.dtype, tuple(t.shape), tuple(t.stride()), span)
    return out


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
        if dtype not in _SAFETENSORS_NAMES:
            raise TypeError(f"tensor {name!r}: safetensors cannot hold {dtype}")
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype],
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
