"""export_torch and export_safetensors: a state consolidated into one file, streamed."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .. import _comm
from .._comm import Mesh
from .._core import leaf_paths, tree_flatten
from .._state import ShardedState
from ._extra import full_precision
from ._groups import Hyperparams
from ._save import check_state
from ._stream import export_safetensors as stream_safetensors
from ._stream import export_torch as stream_torch


@_comm.collective("checkpoint.export_torch")
def export_torch(
    state: ShardedState,
    path: str | None,
    mesh: Mesh,
    *,
    hyperparams: Hyperparams = None,
    module: nn.Module | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Consolidates `state` into a plain model and torch.optim state dict, on rank 0.

    Collective. Buckets are all-gathered one unit at a time. With `path`, rank 0 writes
    the `torch.save` file as they arrive: the file's skeleton, with every tensor's bytes
    reserved, is written first (torch's `skip_data`), then each leaf into its place, so
    no rank holds more than one unit's full tensors and a model larger than a rank
    exports. Without `path` the dicts are returned, which rank 0 must have room for.

    The model dict maps leaf paths ("layers.0.weight") to tensors, in the order the
    parameter tree was built, so `dict(model.named_parameters())` round-trips into
    `model.load_state_dict`. The optimizer dict is torch.optim's: `{"state": {i: {...}},
    "param_groups": [{**hyperparams, "params": [0, ..., k-1]}]}`, numbering the k trainable
    parameters in that order (frozen ones are left out, as from an optimizer built over
    `[p for p in model.parameters() if p.requires_grad]`), or group after group where
    `hyperparams` gives the groups. `fzero.optim.adam`/`adamw` map
    to `{"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}`, `sgd` to
    `{"momentum_buffer"}` (nothing before the first step, as torch), and `from_torch`
    states are already torch's.

    Args:
      state: this rank's ShardedState.
      path: the file rank 0 writes, `{"model": ..., "optimizer": ...}` loadable with
        `torch.load` (atomically: temporary file, fsync, rename); None returns the dicts.
      mesh: the mesh.
      hyperparams: the param group's hyper-parameters. fzero optimizers are closures that
        do not expose theirs, and torch's `Optimizer.load_state_dict` replaces a group's
        hyper-parameters by the saved ones, so pass the full set, e.g.
        `torch.optim.AdamW([torch.zeros(1)], lr=1e-2, weight_decay=0.1).defaults`. Or
        the loading optimizer's groups, a list of such dicts each with `"params"`: its
        parameters' names in that optimizer's order (e.g. a decay group and one with
        `weight_decay=0` for biases and norms, as an fzero optimizer's `mask=` trains
        them); the parameters are then numbered group after group, as torch does. Every
        trainable parameter in exactly one group.
      module: the model, so the model dict names what `module.state_dict()` does: every
        name of a tied parameter (e.g. both "tok.weight" and "head.weight"), and the
        state's buffers less the non-persistent ones (the module's persistent buffers
        the state does not hold, from the module), so `load_state_dict(strict=True)`
        accepts it. Without it, every buffer of the state is included.

    Returns:
      Without `path`, `(model_state_dict, optim_state_dict)` on rank 0; otherwise None.
    """
    check_state(state, mesh, "checkpoint.export_torch")
    # Under mixed precision the export is the masters: the weights at full precision.
    aliases, transient = _names(module)
    full = exported(state, mesh, module, transient)
    return stream_torch(full, path, mesh, hyperparams, aliases, transient)


@_comm.collective("checkpoint.export_safetensors")
def export_safetensors(
    state: ShardedState,
    path: str,
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes the model's weights (and buffers) as one safetensors file, on rank 0.

    Collective. Units are all-gathered one at a time and each leaf is written to its
    place in the file as it arrives (the header, with every offset, is written first),
    so no rank holds more than one unit's full tensors: a model larger than a rank
    exports. The file loads with `safetensors.torch.load_file` (or Hugging Face
    `from_pretrained`) into `model.load_state_dict`, and back into shards with
    `fzero.init.from_file`. Under mixed precision the masters are written.

    Args:
      state: this rank's ShardedState.
      path: the file rank 0 writes (atomically: temporary file, fsync, rename).
      mesh: the mesh.
      module: the model, so the file names what `module.state_dict()` does: every name of
        a tied tensor (the bytes repeated), and no non-persistent buffer (persistent
        ones the state does not hold, from the module), so `load_state_dict(strict=True)`
        accepts it. Without it, every buffer of the state is written.
      dtype: the dtype weights are written in (e.g. torch.bfloat16); None keeps theirs.
        Buffers keep their dtype.
      metadata: string pairs for the header's `__metadata__` (e.g. {"format": "pt"}).
    """
    check_state(state, mesh, "checkpoint.export_safetensors")
    aliases, transient = _names(module)
    full = exported(state, mesh, module, transient)
    stream_safetensors(full, path, mesh, aliases, transient, dtype, metadata)


def _names(module: nn.Module | None) -> tuple[dict[str, str] | None, frozenset[str]]:
    """What `module.state_dict()` would name: every name of a tied parameter (-> the name
    its leaf has), and the buffers it leaves out (non-persistent ones)."""
    if module is None:
        return None, frozenset()
    canonical = {id(p): name for name, p in module.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    transient = frozenset(
        f"{prefix}.{b}" if prefix else b
        for prefix, m in module.named_modules()
        for b in m._non_persistent_buffers_set
    )
    return aliases, transient


def exported(
    state: ShardedState, mesh: Mesh, module: nn.Module | None, transient: frozenset[str]
) -> ShardedState:
    """`state` as an export writes it: at full precision (the masters), with the persistent
    buffers of `module` that it does not hold. A state made without `buffers=` trains
    with the module's own (the loss reads them through `functional_call`; BatchNorm
    updates them there), which `module.state_dict()` and `save_pretrained` hold."""
    held = {}
    if state.buffers is not None:
        held = dict(zip(leaf_paths(state.buffers), tree_flatten(state.buffers)[0]))
    lacking = {
        n: b
        for n, b in (module.named_buffers() if module is not None else ())
        if n not in transient and n not in held and n not in state.layout.path_index
    }
    meta = [n for n, b in lacking.items() if b.device.type == "meta"]
    if meta:  # before any collective (full_precision's gathers): the job stays usable
        raise ValueError(
            f"module= has persistent buffers the state does not hold, and no values for "
            f"them (on the meta device): {meta[:3]} ({len(meta)} in all); pass "
            "buffers=dict(model.named_buffers()) to shard_state so that the export writes them"
        )
    full = full_precision(state, mesh)
    if not lacking:
        return full
    return dataclasses.replace(
        full, buffers={**held, **{n: b.detach() for n, b in lacking.items()}}
    )
