"""Tensor indexes: where each tensor of a safetensors or torch.save file lies, checked.

A file's index is read and checked before any of its bytes are: a file that is not what
it says (a header whose dtype disagrees with its byte span, a truncated file, a pickle
holding anything but tensors, a byte order other than this machine's) is refused with
its name and the tensor's, never read as garbage.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import Any

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
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BOOL": torch.bool,
}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


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


def safetensors_entries(path: str) -> dict[str, Entry]:
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
        if head[:2] == b"\x80\x02" and (n > 100 * 2**20 or 8 + n > size):  # a pickle's start
            raise ValueError(
                f"{path}: a torch.save file in the legacy format (before torch 1.6's zip "
                "archive), whose tensors' offsets cannot be known without loading it: "
                "torch.load it and torch.save it again"
            )
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


def torch_entries(path: str) -> dict[str, Entry]:
    # Loading onto the meta device reads only the pickle and reports every storage's byte
    # offset in the file (torch's layout control); no tensor data is read.
    with zipfile.ZipFile(path) as z:
        order = [n for n in z.namelist() if n.endswith("/byteorder")]
        mark = z.read(order[0]).decode(errors="replace") if order else "little"
    if mark != sys.byteorder:  # its bytes would be read unswapped (torch's meta load crashes)
        raise ValueError(
            f"{path}: a torch.save file written on a {mark}-endian machine; this one is "
            f"{sys.byteorder}-endian: torch.load it and torch.save it again here"
        )
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
    if not isinstance(obj, dict):
        raise ValueError(
            f"{path}: expected a torch.save'd state dict (a flat dict of tensors), got "
            f"{type(obj).__name__}"
        )
    odd = next(((k, v) for k, v in obj.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise ValueError(
            f"{path}: expected a torch.save'd state dict (a flat dict of tensors), but its "
            f"{odd[0]!r} is a {type(odd[1]).__name__} (a training checkpoint? torch.save its "
            "model's state dict alone)"
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
