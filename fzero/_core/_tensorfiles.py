"""Tensor files as one: a checkpoint sharded over several files by an index (Hugging Face's
`*.safetensors.index.json` and `pytorch_model.bin.index.json`), or a directory holding one.

A model over a few GB ships as `model-0000k-of-0000n.safetensors` files and an index whose
`weight_map` names the file of every tensor. `open_tensors` reads a file, an index, or a
directory as one `TensorFile`-like set: every file's header is read (and checked) up
front, and each tensor by range from the file that holds it.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from ._dcp import DcpFiles, is_dcp
from ._tensor_index import Entry
from ._tensorfile import TensorFile

# What a directory may hold, in Hugging Face's order of preference (`from_pretrained`).
_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def open_tensors(path: str) -> TensorFile | TensorFiles | DcpFiles:
    """The tensors of `path`: one safetensors or torch.save file, an index of several
    (`*.index.json`), a directory holding one of Hugging Face's names for them, or a
    `torch.distributed.checkpoint` directory (its `.metadata` file)."""
    if is_dcp(path):
        return DcpFiles(path)
    if os.path.isdir(path):
        for name in _NAMES:
            if os.path.isfile(os.path.join(path, name)):
                return open_tensors(os.path.join(path, name))
        found = sorted(os.listdir(path))[:8]
        raise ValueError(
            f"{path}: a directory without {' or '.join(_NAMES)} or a torch.distributed."
            f"checkpoint's .metadata (it holds {found}); pass the file or index itself"
        )
    if path.endswith(".index.json"):
        return TensorFiles(path)
    return TensorFile(path)


class TensorFiles:
    """Several tensor files under one index: `entries`, `read`, `tensor`, `digest` and
    `close`, as `TensorFile`'s, each tensor from the file the index names for it."""

    def __init__(self, index: str) -> None:
        self.path = index
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index}: not an index of tensor files ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError(f"{index}: its weight_map must map tensor names to file names")
        root = os.path.dirname(os.path.abspath(index))
        self.file_of: dict[str, str] = {}
        for name, file in weight_map.items():
            full = os.path.normpath(os.path.join(root, file))
            if os.path.dirname(full) != root:  # the index names files beside it, no more
                raise ValueError(f"{index}: tensor {name!r} is in {file!r}, outside {root}")
            self.file_of[name] = full
        self.files: dict[str, TensorFile] = {}
        self.entries: dict[str, Entry] = {}
        try:
            for file in sorted(set(self.file_of.values())):  # headers only: no tensor data
                self._index(file)
        except BaseException:
            self.close()  # the files opened before the bad one
            raise

    def _index(self, file: str) -> None:
        """Opens `file` and takes the entries the index puts in it (all of them there)."""
        opened = self._open(file)
        for name, f in self.file_of.items():
            if f == file and name not in opened.entries:
                raise ValueError(
                    f"{self.path}: tensor {name!r} should be in {os.path.basename(file)}, "
                    "which does not hold it"
                )
        mine = {n: e for n, e in opened.entries.items() if self.file_of.get(n) == file}
        self.entries.update(mine)

    def _open(self, file: str) -> TensorFile:
        if file not in self.files:
            if not os.path.isfile(file):
                raise ValueError(f"{self.path}: names {os.path.basename(file)}, which is missing")
            self.files[file] = TensorFile(file)
        return self.files[file]

    def read(self, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of tensor `name`, from its file (see `TensorFile.read`)."""
        self._open(self.file_of[name]).read(name, lo, hi, out)

    def tensor(self, name: str) -> torch.Tensor:
        return self._open(self.file_of[name]).tensor(name)

    def digest(self) -> str:
        """Every file's digest (`TensorFile.digest`), with the index's map."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(sorted((n, os.path.basename(f)) for n, f in self.file_of.items())).encode())
        for file in sorted(self.files):
            h.update(self.files[file].digest().encode())
        return f"{len(self.files)} files:{h.hexdigest()}"

    def close(self) -> None:
        for f in self.files.values():
            f.close()
