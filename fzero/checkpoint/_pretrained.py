"""export_pretrained: a state written as Hugging Face's `save_pretrained` lays a model out."""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

import torch
from torch import nn

from .. import _comm
from .._comm import Mesh
from .._core import fsync_dir
from .._state import ShardedState
from ._export import _names, exported
from ._save import check_state
from ._stream import Spec
from ._stream import export_safetensors as stream_safetensors

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
# Shard files, and what a killed export leaves: the temporary files of ours and the index.
_SHARD = re.compile(r"model-\d{5}-of-\d{5}(-\d+)?\.safetensors")
_LEFT = re.compile(r"(model(-\d{5}-of-\d{5}(-\d+)?)?\.safetensors(\.index\.json)?)\.tmp-\d+")


@_comm.collective("checkpoint.export_pretrained")
def export_pretrained(
    state: ShardedState,
    directory: str | os.PathLike[str],
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
) -> None:
    """Writes the model's weights as `save_pretrained` does: `model.safetensors`, or, past
    `max_shard_size`, `model-0000k-of-0000n.safetensors` files and the index
    `model.safetensors.index.json` mapping each tensor to its file.

    Collective. Units are all-gathered one at a time and each tensor is written into its
    file as it arrives (every file's header first), so no rank holds more than one unit's
    full tensors. `transformers.AutoModel*.from_pretrained(directory)` loads the result
    (strictly: every key the model expects, no other), and `fzero.init.from_file(directory)`
    reads it back into shards. Under mixed precision the masters are written. Each file is
    written atomically (temporary file, fsync, rename), the index last, under names the
    directory's current index does not use (`...-of-0000n-1.safetensors` where the
    earlier export holds Hugging Face's): a run killed before the index is replaced leaves
    the earlier export whole. The earlier export's files are then removed.

    Args:
      state: this rank's ShardedState.
      directory: where rank 0 writes (created if missing).
      mesh: the mesh.
      module: the model, so that the files name what its `state_dict()` does less its tied
        aliases (as `save_pretrained`: a tied weight is stored once, under its first
        name), its non-persistent buffers and its `_keys_to_ignore_on_save`, and with its
        persistent buffers the state does not hold (a state made without `buffers=`
        trained with the module's own); without it, every leaf and buffer of the state.
      config: written as `config.json`: a `transformers` config (its `save_pretrained`) or
        a dict; None writes none. Given `module` too, as `save_pretrained` writes it: the
        module's class under `architectures` (on a copy), and `generation_config.json`
        for a model that generates.
      max_shard_size: the largest file, in bytes or as "5GB", "500MB", "20KiB" (decimal
        units, binary with an "i"), as `save_pretrained`'s; a tensor larger than it gets
        a file of its own.
      dtype: the dtype floating weights are written in (e.g. torch.bfloat16); None keeps
        theirs. Buffers keep their dtype.
    """
    check_state(state, mesh, "checkpoint.export_pretrained")
    limit = _bytes(max_shard_size)
    if config is not None and not (hasattr(config, "save_pretrained") or isinstance(config, dict)):
        raise TypeError(
            f"checkpoint.export_pretrained: config must be a transformers config or a dict, "
            f"got {type(config).__name__}"
        )
    directory = os.fspath(directory)
    _, transient = _names(module)
    # A model's `_keys_to_ignore_on_save` (Marian's sinusoidal positions), left out as
    # `save_pretrained` leaves them: `from_pretrained` makes them again.
    transient |= frozenset(getattr(module, "_keys_to_ignore_on_save", None) or ())
    full = exported(state, mesh, module, transient)

    specs: dict[str, Spec] = {}  # every tensor written (rank 0): the index's total size

    def split(all_specs: dict[str, Spec]) -> dict[str, list[str]]:
        specs.update(all_specs)
        os.makedirs(directory, exist_ok=True)
        groups: list[list[str]] = [[]]
        size = 0
        for name, (dt, shape) in specs.items():
            n = dt.itemsize * int(torch.Size(shape).numel())
            if groups[-1] and size + n > limit:
                groups.append([])
                size = 0
            groups[-1].append(name)
            size += n
        if len(groups) == 1:
            return {os.path.join(directory, _SINGLE): groups[0]}
        return dict(zip(_shard_files(directory, len(groups)), groups))

    def finish(files: dict[str, list[str]]) -> None:
        names = {os.path.basename(f) for f in files}
        if len(files) > 1:
            total = sum(  # the tensors' bytes, as huggingface_hub counts them
                dt.itemsize * int(torch.Size(shape).numel()) for dt, shape in specs.values()
            )
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: os.path.basename(f) for f, ns in files.items() for n in ns},
            }
            _write_text(os.path.join(directory, _INDEX), json.dumps(index, indent=2) + "\n")
            names.add(_INDEX)
        for old in os.listdir(directory):  # an earlier export's files, now stale
            stale = old in (_SINGLE, _INDEX) or _SHARD.fullmatch(old) or _LEFT.fullmatch(old)
            if stale and old not in names:
                os.remove(os.path.join(directory, old))
        if config is not None:
            _write_config(config, directory, module)
        fsync_dir(directory)

    # Tied aliases are left out (no aliases passed): `from_pretrained` ties them again.
    stream_safetensors(
        full,
        directory,
        mesh,
        None,
        transient,
        dtype,
        {"format": "pt"},
        split,
        finish,
        "checkpoint.export_pretrained",
    )


def _shard_files(directory: str, k: int) -> list[str]:
    """The paths of `k` shard files that the directory's current index does not name.

    The index is the export's commit point: until it is replaced, it must name only the
    earlier export's files, so a run killed midway leaves that export whole (`save_pretrained`
    replaces same-named files one by one, and a kill leaves old and new tensors mixed).
    Hugging Face's names where they are free; else the same names with a number added.
    """
    taken: set[str] = set()
    try:
        with open(os.path.join(directory, _INDEX)) as f:
            taken = set(json.load(f)["weight_map"].values())
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        taken = {n for n in os.listdir(directory) if _SHARD.fullmatch(n)}  # unreadable: all
    generation = 0
    while True:
        tag = f"-{generation}" if generation else ""
        names = [f"model-{i + 1:05d}-of-{k:05d}{tag}.safetensors" for i in range(k)]
        if taken.isdisjoint(names):
            return [os.path.join(directory, n) for n in names]
        generation += 1


def _bytes(size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or "<number><unit>" as transformers reads it."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(
            f"checkpoint.export_pretrained: max_shard_size {size!r} is not a positive size "
            "(bytes as an int, or e.g. '5GB', '500MB', '20KiB')"
        )
    return max(1, int(float(m.group(1)) * units[m.group(2)]))


def _write_config(config: Any, directory: str, module: nn.Module | None) -> None:
    """`config.json`, and as `save_pretrained` writes them from the model: its class under
    `architectures` (what pipelines and the hub read), and `generation_config.json` for a
    model that generates."""
    if hasattr(config, "save_pretrained"):
        if module is not None:
            config = copy.deepcopy(config)  # the caller's is left as it was
            config.architectures = [type(module).__name__]
        config.save_pretrained(directory)
        generation = getattr(module, "generation_config", None)
        can_generate = getattr(module, "can_generate", None)
        if generation is not None and callable(can_generate) and can_generate():
            generation.save_pretrained(directory)
    else:
        _write_text(os.path.join(directory, "config.json"), json.dumps(config, indent=2) + "\n")


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
