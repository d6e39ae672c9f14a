"""Checkpoints: sharded save, load at any world size and stage, torch state-dict export/import.

Format. A checkpoint is a directory `path` holding versions `v-<step>-<id>/` and a file
`LATEST` naming the committed one. A version holds one file per saving rank,
`rank-<r>-of-<n>.pt`, a `torch.save` of a flat dict of tensors (never any other object),
and `metadata.json` with everything else: format version, world size, stage, step, the
layout (kind, units, per leaf its path, shape, dtype and frozen flag, per bucket its
slots), how the optimizer state is organised, and each file's size and SHA-256. Rank r
writes its slice of every bucket, whatever the stage: parameters, and each elementwise
optimizer-state entry (Adam's moments, momentum buffers, from_torch tensors shaped like
their parameter); per-tensor entries (torch's "step", Adafactor's factors) are written by
the rank holding them, global ones (the step count) by rank 0.

Safety. Every rank writes into `path/.tmp-<id>/` and fsyncs; rank 0 then writes the
metadata, renames the directory to its version name, and replaces `LATEST` with one
atomic rename. A crash anywhere leaves `LATEST` naming the previous, complete checkpoint;
older versions and debris of interrupted saves are deleted only after the switch. (A
rename of `path` itself over the old checkpoint, the other common scheme, has a window
in which neither exists.) Loading checks each file's size and SHA-256 before opening it
with `torch.load(weights_only=True, mmap=True)`: nothing is unpickled but tensors, and a
rank reads only the pages of the element ranges it needs. All ranks must see the same
filesystem.

Resharding. A checkpoint is addressed by leaf and element range, never by the saving
layout: each new rank rebuilds its slice of every new bucket (stage 3) or the full
buckets (stages 0-2) from the saved ranges that overlap it, and its optimizer pieces the
same way, so any world size, stage, layout kind ("flat" <-> "tensor") and units work.
Per-tensor optimizer state moves between layouts when it is one scalar shared by every
tensor (torch's "step"); otherwise (Adafactor's factors) only between "tensor" layouts
and stage 0, where pieces are whole tensors, and other requests fail with an error.

Why not `torch.distributed.checkpoint`: its metadata file is a pickle (loading it
unpickles), its resharding works on DTensor/ShardedTensor placements rather than fzero's
padded flat buckets, and it writes in place without an atomic switch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._mesh import Mesh
from .._state import ShardedState
from .._tree import PyTree
from ..optim import Optimizer
from ._extra import full_precision as _full_precision
from ._save import check_state as _check_state
from ._save import load as _load
from ._save import save as _save
from ._schema import CheckpointError as CheckpointError
from ._torch import export_torch as _export_torch
from ._torch import import_torch as _import_torch

__all__ = ["CheckpointError", "export_torch", "import_torch", "load", "save"]


def save(state: ShardedState, path: str, mesh: Mesh) -> str:
    """Writes `state` as a sharded checkpoint at `path` (collective: every rank calls it).

    Each rank writes only what it holds; rank 0 commits once every file is durable, and
    no rank returns before the commit. The previous checkpoint at `path` stays loadable
    until then, and is deleted after.

    Args:
      state: this rank's ShardedState (any stage, layout, units; optimizers from
        `fzero.optim`, including `from_torch`). Its buffers and loss scaler are saved
        too; under mixed precision the masters are saved as the parameters (full
        precision), so `load` can resume with or without a `Precision`.
      path: the checkpoint directory (created if missing; shared by all ranks).
      mesh: the mesh `state` lives on.

    Returns:
      The directory of the version just written (inside `path`).

    Raises:
      CheckpointError: on every rank if writing failed on any rank.
    """
    return _save(state, path, mesh)


def load(
    path: str,
    mesh: Mesh,
    optimizer: Optimizer,
    params_like: PyTree,
    *,
    stage: int,
    layout: str | None = None,
    units: Any = None,
    frozen: Any = None,
    precision: Any = None,
    loss_scale: Any = None,
    buffers_like: PyTree = None,
) -> ShardedState:
    """Loads a checkpoint onto `mesh`, at any world size, stage and layout (collective).

    Args:
      path: a checkpoint directory from `save` (its LATEST version), or one version in it.
      mesh: the mesh to load onto; its size need not be the saving world size.
      optimizer: the optimizer to continue with: the saving one, or one whose state has
        the same organisation (its hyper-parameters may differ).
      params_like: the parameter tree of the model (values ignored; meta tensors do): its
        leaf paths, shapes and dtypes must be the saved ones, and the state has its
        structure.
      stage: the ZeRO stage to load into (0-3), whatever the saving stage.
      layout: "flat" or "tensor"; None keeps the saved kind.
      units: unit path prefixes, as in `shard_state`; None keeps the saved units.
      frozen: as in `shard_state`; None keeps the saved frozen flags. A leaf frozen when
        saved has no optimizer state and cannot become trainable here.
      precision: a `fzero.Precision` to continue in mixed precision: the saved values
        (saved at full precision: the masters of a mixed-precision run) become the
        masters, and the parameters their cast. None loads at full precision.
      loss_scale: the `fzero.DynamicLossScale` rules to continue with; the saved scale and
        growth count are kept. None keeps the saved rules (if the run had a scaler).
      buffers_like: the structure of the saved buffers (e.g. `dict(model.named_buffers())`;
        values ignored); None rebuilds them as a dict by path.

    Returns:
      This rank's ShardedState, with the saved step; parameters and optimizer state hold
      the saved values bitwise, on the CPU.

    Raises:
      CheckpointError: on every rank, naming the file or leaf: no committed checkpoint,
        a missing, truncated or corrupted file, a file that is not plain tensors, another
        model (the first differing leaf), or an optimizer state that does not fit.
    """
    return _load(
        path,
        mesh,
        optimizer,
        params_like,
        stage=stage,
        layout=layout,
        units=units,
        frozen=frozen,
        precision=precision,
        loss_scale=loss_scale,
        buffers_like=buffers_like,
    )


def export_torch(
    state: ShardedState,
    path: str | None,
    mesh: Mesh,
    *,
    hyperparams: dict[str, Any] | None = None,
    module: nn.Module | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Consolidates `state` into a plain model and torch.optim state dict on rank 0.

    Collective. Buckets are all-gathered one unit at a time and cut into leaves on rank 0,
    so no rank holds more than one unit's full tensors beyond rank 0's output.

    The model dict maps leaf paths ("layers.0.weight") to tensors, in the order the
    parameter tree was built, so `dict(model.named_parameters())` round-trips into
    `model.load_state_dict`. The optimizer dict is torch.optim's: `{"state": {i: {...}},
    "param_groups": [{**hyperparams, "params": [0, ..., k-1]}]}`, numbering the k trainable
    parameters in that order (frozen ones are left out, as from an optimizer built over
    `[p for p in model.parameters() if p.requires_grad]`). `fzero.optim.adam`/`adamw` map
    to `{"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}`, `sgd` to
    `{"momentum_buffer"}` (nothing before the first step, as torch), and `from_torch`
    states are already torch's.

    Args:
      state: this rank's ShardedState.
      path: if not None, rank 0 also writes `{"model": ..., "optimizer": ...}` there with
        `torch.save` (atomically: temporary file, fsync, rename).
      mesh: the mesh.
      hyperparams: the param group's hyper-parameters. fzero optimizers are closures that
        do not expose theirs, and torch's `Optimizer.load_state_dict` replaces a group's
        hyper-parameters by the saved ones, so pass the full set, e.g.
        `torch.optim.AdamW([torch.zeros(1)], lr=1e-2, weight_decay=0.1).defaults`.
      module: the model, if it ties weights: every name of a tied parameter (e.g. both
        "tok.weight" and "head.weight") then appears in the model dict, as in
        `module.state_dict()`, so `load_state_dict(strict=True)` accepts it. The state's
        buffers, if any, are always included.

    Returns:
      `(model_state_dict, optim_state_dict)` on rank 0, None on the other ranks.
    """
    _check_state(state, mesh, "checkpoint.export_torch")
    aliases = None
    if module is not None:
        canonical = {id(p): name for name, p in module.named_parameters()}
        aliases = {
            name: canonical[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
        }
    # Under mixed precision the export is the masters: the weights at full precision.
    return _export_torch(_full_precision(state, mesh), path, mesh, hyperparams, aliases)


def import_torch(
    model_state_dict: dict[str, torch.Tensor],
    optim_state_dict: dict[str, Any],
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    params_like: PyTree = None,
    layout: str = "flat",
    units: Any = None,
    frozen: Any = None,
    step: int | None = None,
) -> ShardedState:
    """Builds a ShardedState from a plain model state dict and a torch.optim state dict.

    Collective; every rank passes the same dicts (for example each `torch.load`s them
    with `weights_only=True`). The reverse of `export_torch`: parameter i of the optimizer
    dict (param groups concatenated) is the i-th trainable leaf in the order the tree was
    built. Hyper-parameters come from `optimizer`, not from the param groups.

    Args:
      model_state_dict: leaf path -> tensor, for exactly the leaves of the parameters.
      optim_state_dict: a `torch.optim` state dict (`state`, `param_groups`) of the
        optimizer `optimizer` stands for (torch.optim.Adam/AdamW for `fzero.optim.adam`/
        `adamw`, SGD for `sgd`, the wrapped class for `from_torch`).
      optimizer: the fzero optimizer to continue with.
      mesh: the mesh.
      stage: the ZeRO stage (0-3).
      params_like: the parameter tree (values ignored) when it is not the flat dict
        `model_state_dict` itself (e.g. nested dicts and lists).
      layout: "flat" or "tensor", as in `shard_state`.
      units: as in `shard_state`.
      frozen: as in `shard_state`.
      step: the number of updates already applied. Adam's is read from its "step"; torch's
        SGD keeps none, so by default it is 1 if momentum buffers exist, else 0 (it only
        matters to learning-rate schedules).

    Returns:
      This rank's ShardedState.
    """
    return _import_torch(
        model_state_dict,
        optim_state_dict,
        optimizer,
        mesh,
        stage=stage,
        params_like=params_like,
        layout=layout,
        units=units,
        frozen=frozen,
        step=step,
    )
