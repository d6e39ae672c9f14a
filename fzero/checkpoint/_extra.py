"""What a checkpoint carries beside parameters and optimizer state: buffers, scaler, masters.

A state with master copies is saved at full precision: the masters are its parameters
(frozen leaves cast up, which is exact), so a checkpoint of a mixed-precision run is an
ordinary checkpoint of the model in its original dtypes, loadable at any stage and world
size, with or without a `Precision`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from .._comm import Mesh
from .._core import PyTree, Shards, leaf_paths, stage_of, tree_flatten, tree_unflatten
from .._state import (
    DynamicLossScale,
    LossScaleState,
    Precision,
    ShardedState,
    gathered_masters,
    retyped,
)
from .._state import to_mixed as mixed
from ._schema import CheckpointError


def full_precision(state: ShardedState, mesh: Mesh) -> ShardedState:
    """`state` with its masters as parameters (a collective where parameters are
    replicated and masters sharded, stages 1-2); else `state`."""
    if state.master is None:
        return state
    lay = state.layout
    if state.precision is None:  # offload's masters, at the parameters' own precision:
        # the parameters hold the same values, in the same dtypes (several, it may be)
        if not stage_of(state.stage).shards_params:
            return ShardedState(
                state.params, state.opt_state, state.step, lay, state.stage, state.buffers
            )
        bufs = tuple(
            p if b.frozen else m
            for p, m, b in zip(state.params.buffers, state.master.buffers, lay.buckets)
        )
        params = Shards(bufs, lay, mesh.shard_rank)
        return ShardedState(params, state.opt_state, state.step, lay, state.stage, state.buffers)
    dtypes = _saved_dtypes(state)
    # The state's own buckets in the saved dtypes (not a layout built again from them,
    # which would merge a unit's bf16 and fp32 buckets whose masters are both fp32): the
    # optimizer state lines up with them.
    flay = retyped(lay, dtypes)
    if stage_of(state.stage).shards_params:
        bufs = tuple(
            p.to(f.dtype) if b.frozen else m
            for p, m, b, f in zip(
                state.params.buffers, state.master.buffers, lay.buckets, flay.buckets, strict=True
            )
        )
        params: PyTree = Shards(bufs, flay, mesh.shard_rank)
    else:
        leaves = lay.leaves(gathered_masters(state, mesh))
        full = tree_unflatten(lay.treedef, [x.to(d) for x, d in zip(leaves, dtypes)])
        params = flay.unflatten(flay.flatten(full))
    return ShardedState(params, state.opt_state, state.step, flay, state.stage, state.buffers)


def _saved_dtypes(state: ShardedState) -> list[torch.dtype]:
    """Each leaf's dtype in a checkpoint of a mixed-precision `state`: a trainable leaf's
    master dtype (several, where the original parameters had several: a bf16 model keeping
    fp32 routers); a frozen floating leaf's, the widest master dtype (a cast up: exact)."""
    lay = state.layout
    if isinstance(state.master, Shards):
        masters = list(state.master.layout.dtypes)
    else:
        masters = [None if x is None else x.dtype for x in lay.leaves(state.master)]
    trained = [d for d, f in zip(masters, lay.frozen) if not f and d is not None]
    up = functools.partial(functools.reduce, torch.promote_types)
    return [
        (up(trained, held) if held.is_floating_point else held) if f else m
        for held, m, f in zip(lay.dtypes, masters, lay.frozen)
    ]


def to_mixed(
    state: ShardedState,
    precision: Precision,
    mesh: Mesh,
    compute: Sequence[torch.dtype] | None = None,
) -> ShardedState:
    """A full-precision loaded `state` as `shard_state(..., precision=)` would hold it:
    parameters cast to the compute dtype (`compute`'s per leaf where `precision` names
    none), the loaded values kept as masters."""
    params, lay, master = mixed(
        state.params, state.layout, stage_of(state.stage), precision, mesh.shard_rank, compute
    )
    return dataclasses.replace(state, params=params, layout=lay, master=master, precision=precision)


# -- buffers and the scaler: rank 0's file, described in the metadata ------------------------


def extra_tensors(state: ShardedState) -> dict[str, torch.Tensor]:
    """Rank 0's extra tensors: buffers `b<j>`, the scaler's `scale` and `growth`."""
    out: dict[str, torch.Tensor] = {}
    if state.buffers is not None:
        for j, b in enumerate(tree_flatten(state.buffers)[0]):
            out[f"b{j}"] = b.detach().clone()
    if state.scaler is not None:
        out["scale"] = state.scaler.scale.detach().clone()
        out["growth"] = state.scaler.growth_tracker.detach().clone()
    return out


def extra_metadata(state: ShardedState) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if state.buffers is not None:
        leaves = tree_flatten(state.buffers)[0]
        body["buffers"] = [
            {"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
            for p, x in zip(leaf_paths(state.buffers), leaves)
        ]
    if state.scaler is not None:
        body["scaler"] = dict(state.scaler.config._asdict())
    if state.precision is not None:
        body["precision"] = {k: str(v) for k, v in vars(state.precision).items()}
    return body


def load_buffers(
    src: Any, body: dict[str, Any], buffers_like: PyTree, device: torch.device | None = None
) -> PyTree:
    """The saved buffers, in `buffers_like`'s structure (or a dict by path), on `device`."""
    saved = body.get("buffers")
    if saved is None:
        if buffers_like is not None:
            raise CheckpointError("buffers_like was given, but the checkpoint holds no buffers")
        return None
    values = [src._tensor(0, f"b{j}").to(device, copy=True) for j in range(len(saved))]
    if buffers_like is None:
        return {e["path"]: v for e, v in zip(saved, values)}
    paths = leaf_paths(buffers_like)
    if paths != [e["path"] for e in saved]:
        raise CheckpointError(
            f"buffers_like has buffers {paths}, the checkpoint {[e['path'] for e in saved]}"
        )
    for e, like in zip(saved, tree_flatten(buffers_like)[0]):
        shape = getattr(like, "shape", None)
        if shape is not None and list(shape) != e["shape"]:  # another model's buffer
            raise CheckpointError(
                f"buffer {e['path']!r} is {tuple(e['shape'])} in the checkpoint, "
                f"{tuple(shape)} in buffers_like"
            )
    return tree_unflatten(tree_flatten(buffers_like)[1], values)


def load_scaler(
    src: Any,
    body: dict[str, Any],
    loss_scale: DynamicLossScale | None,
    device: torch.device | None = None,
) -> LossScaleState | None:
    """The saved scaler state on `device`, under `loss_scale`'s rules if given (else the
    saved ones); a fresh one if the checkpoint has none and `loss_scale` is given."""
    saved = body.get("scaler")
    if saved is None:
        return None if loss_scale is None else loss_scale.init(device)
    config = loss_scale if loss_scale is not None else DynamicLossScale(**saved)
    config.init()  # validates
    scale = src._tensor(0, "scale").to(device, copy=True)
    growth = src._tensor(0, "growth").to(device, copy=True)
    return LossScaleState(scale, growth, config)
