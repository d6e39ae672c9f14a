"""sharded_step: each ZeRO stage as a composition of the four primitives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._autodiff import value_and_grad
from ._gather import gather_params
from ._grads import all_reduce_grads, local_shard, reduce_scatter_grads
from ._mesh import Mesh
from ._shards import Shards
from ._state import ShardedState, check_stage
from ._tree import PyTree
from ._update import sharded_update
from .optim import Optimizer

LossFn = Callable[[PyTree, Any], torch.Tensor]
Step = Callable[[ShardedState, Any], tuple[ShardedState, torch.Tensor]]


def sharded_step(
    loss_fn: LossFn, optimizer: Optimizer, mesh: Mesh, *, stage: int, layout: str | None = None
) -> Step:
    """A training step for ZeRO `stage`: `step(state, batch) -> (state, loss)`.

    `loss_fn(params, batch)` is this rank's loss on its micro-batch; the update uses the
    mean over ranks of the gradients (DDP semantics), so N ranks on micro-batches of size b
    train exactly like one process on their concatenation with a mean loss.

    Args:
      loss_fn: `(params, batch) -> scalar tensor`, params being the full tree.
      optimizer: the `fzero.optim.Optimizer` the state was built with.
      mesh: the mesh.
      stage: 0-3; must match the state's.
      layout: optional; if given, must match the state's layout kind.

    Returns:
      `step(state, batch) -> (new_state, loss)`, loss detached. Pure: `state` is not modified.
    """
    stage = check_stage(stage)
    body = {0: _stage0, 1: _stage1, 2: _stage2, 3: _stage3}[stage]

    def step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        _check_state(state, stage, layout, mesh)
        params, opt_state, loss = body(loss_fn, optimizer, mesh, state, batch)
        return ShardedState(params, opt_state, state.step + 1, state.layout, stage), loss

    return step


def _stage0(loss_fn, optimizer, mesh, state, batch):
    """DDP: all-reduce gradients; every rank applies the same full update."""
    loss, grads = _grad(loss_fn, state.params, batch, mesh)
    grads = all_reduce_grads(grads, mesh)
    params, opt_state = sharded_update(optimizer, state.params, grads, state.opt_state)
    return params, opt_state, loss


def _stage1(loss_fn, optimizer, mesh, state, batch):
    """Optimizer state sharded: all-reduce, update own shard, all-gather parameters."""
    loss, grads = _grad(loss_fn, state.params, batch, mesh)
    grads = local_shard(all_reduce_grads(grads, mesh), state.layout, mesh)
    shard = local_shard(state.params, state.layout, mesh)
    shard, opt_state = sharded_update(optimizer, shard, grads, state.opt_state)
    return gather_params(shard, mesh), opt_state, loss


def _stage2(loss_fn, optimizer, mesh, state, batch):
    """+ gradients sharded: reduce-scatter, update own shard, all-gather parameters."""
    loss, grads = _grad(loss_fn, state.params, batch, mesh)
    grads = reduce_scatter_grads(grads, state.layout, mesh)
    shard = local_shard(state.params, state.layout, mesh)
    shard, opt_state = sharded_update(optimizer, shard, grads, state.opt_state)
    return gather_params(shard, mesh), opt_state, loss


def _stage3(loss_fn, optimizer, mesh, state, batch):
    """+ parameters sharded: the loss sees gather_params(shards); its VJP reduce-scatters."""
    loss, grads = value_and_grad(
        lambda s, b: loss_fn(gather_params(s, mesh), b), state.params, batch, rank=mesh.rank
    )
    if grads is None:
        # This rank's loss ignored every parameter, so gather_params's backward never ran;
        # its peers' did, and wait for this rank's share of the reduce-scatter.
        grads = reduce_scatter_grads(_zeros_like_full(state.params), state.layout, mesh)
    params, opt_state = sharded_update(optimizer, state.params, grads, state.opt_state)
    return params, opt_state, loss


def _grad(loss_fn: LossFn, params: PyTree, batch: Any, mesh: Mesh) -> tuple[torch.Tensor, PyTree]:
    loss, grads = value_and_grad(loss_fn, params, batch, rank=mesh.rank)
    if grads is None:
        grads = _zeros_like_full(params)
    return loss, grads


def _zeros_like_full(params: PyTree) -> PyTree:
    if isinstance(params, Shards):
        lay = params.layout
        return lay.unflatten(
            [b.new_zeros(bk.full_numel) for b, bk in zip(params.buffers, lay.buckets)]
        )
    from ._tree import tree_map

    return tree_map(torch.zeros_like, params)


def _check_state(state: ShardedState, stage: int, layout: str | None, mesh: Mesh) -> None:
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"step expects the ShardedState from shard_state, got {type(state).__name__}"
        )
    if state.stage != stage:
        raise ValueError(
            f"this step is for stage {stage}, the state was built for stage {state.stage}"
        )
    if layout is not None and layout != state.layout.kind:
        raise ValueError(f"this step is for layout {layout!r}, the state has {state.layout.kind!r}")
    if state.layout.world_size != mesh.size:
        raise ValueError(
            f"the state is for {state.layout.world_size} ranks, the mesh has {mesh.size}"
        )
