"""One step's body, read as the stage table: enter -> value and grad -> update -> gather.

    enter (per unit) -> value and grad -> sharded_update -> all-gather (stages 1-2)

`train` is what `sharded_step` runs inside its wrapping (buffers, loss weights, the loss
scaler, donation): the parameters enter the loss unit by unit (`_engine`, scheduled by a
`_schedule.Schedule` chosen once per layout), the gradient comes out reduced as the
stage reduces it (`_stages`), the optimizer updates what this rank owns
(`sharded_update`), and where a stage replicates the parameters but shards the
optimizer, the updated shards are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from .._comm import Axis, Mesh, QuantizedComm
from .._core import PyTree, Shards, Stage, device_of, stage_of
from .._engine import CallCheck, Schedule, UnitLedger, full_buckets, local_shard, own_slices, plan
from .._state import ShardedState
from ..optim import Optimizer
from ._gradient import LossFn, Memory, leaf_grad, mean_grad, micro_batches
from ._loss_weights import Exchange, Tally, Weighed
from ._options import check_finite
from ._update import apply_update, rebuild_params


class Out(NamedTuple):
    """What `train` gives back: the new values, and whether they changed."""

    params: PyTree
    opt_state: Any
    master: Any
    applied: bool  # False: the loss scaler found an inf, or the weights summed to 0
    tally: Tally


@dataclass(frozen=True)
class Options:
    """What `sharded_step` was asked for (fixed for the step function's life)."""

    mesh: Mesh
    module: nn.Module | None
    just_in_time: bool
    reshard_after_forward: bool
    secondary: Axis | None  # hpZ: where the backward gathers resharded units from
    quantize: QuantizedComm | None
    prefetch: bool
    ledger: UnitLedger | None
    donate: bool
    accumulate: str | None
    buffer_sync: str
    overlap_reduce: bool
    reduce_bucket_bytes: int


def train(
    loss_fn: LossFn,
    weighed: Weighed,
    optimizer: Optimizer,
    o: Options,
    memory: Memory,
    state: ShardedState,
    batch: Any,
) -> Out:
    """One step of `state.stage`, read as the stage table: parameters enter the loss per
    unit, value and gradient, the optimizer on what this rank owns, and (stages 1-2) the
    updated shards all-gathered. The gradient is weighted (`_weight`) before the update."""
    stage, lay = stage_of(state.stage), state.layout
    local = None if stage.shards_params else full_buckets(state.params, lay)
    target = _target(stage, state, local, o)  # what this rank's optimizer updates
    micro = micro_batches(batch, o, memory)
    exchange = Exchange(o.mesh, device_of(state.params))
    present = any(mb is not None for mb in micro)

    def after_forward(check: CallCheck | None = None) -> None:
        exchange.start(weighed, present, check)

    if stage.reduce == "all_reduce" and o.mesh.size == 1:
        grads = leaf_grad(loss_fn, micro, o, state)
        after_forward()
    else:
        schedule = _schedule(stage, o, memory, state)
        if stage.reduce == "all_reduce":  # every rank keeps the full mean gradient
            assert local is not None
            like = local
        else:  # a rank keeps its shard of it, shaped as what it updates
            like = state.params.buffers if stage.shards_params else target.buffers
        flats = mean_grad(
            loss_fn, micro, o, memory, stage, schedule, state, like, local, after_forward
        )
        if stage.reduce == "all_reduce":
            assert local is not None
            full = [f if b.frozen else g for f, g, b in zip(local, flats, lay.buckets)]
            grads = lay.trainable(lay.unflatten(full))
        else:
            grads = Shards(flats, lay, o.mesh.shard_rank)
        del flats  # held by `grads` alone, which lets go of them before the gather
    tally = exchange.wait()
    if o.quantize is not None and o.quantize.grads and state.scaler is None:
        check_finite(grads, o.mesh, state.step)
    factor = tally.factor(o.mesh.size, len(micro))
    if factor is None:  # no weight anywhere: nothing to update by
        return Out(state.params, state.opt_state, state.master, False, tally)
    new, opt_state, applied = apply_update(
        optimizer, state, target, grads, o.mesh, o.donate, factor=factor
    )
    master = None if state.master is None else new
    if not applied:  # nothing changed anywhere: no gather either
        return Out(state.params, opt_state, master, False, tally)
    del grads  # used: the gather below has the memory they held
    params = rebuild_params(stage, new, local, state, o.mesh, o.donate, o.reduce_bucket_bytes)
    return Out(params, opt_state, master, True, tally)


def _target(stage: Stage, state: ShardedState, local: Any, o: Options) -> Any:
    """What the optimizer updates: the masters if there are any; else the parameters (all
    of the trainable tree, or this rank's shard of it). Stages 1-2, donating, update the
    rank's slice of the replicated buffers where it lies, so the gather after the update
    only fills the peers' slices; not donating, a copy of it."""
    lay, rank = state.layout, o.mesh.shard_rank
    if state.master is not None:
        return state.master
    if stage.shards_params:
        return state.params
    if not stage.shards_optimizer:
        return lay.trainable(state.params)
    if o.donate:
        return Shards(own_slices(local, lay, rank), lay, rank)
    return local_shard(lay.trainable(state.params), lay, o.mesh)


def _schedule(stage: Stage, o: Options, memory: Memory, state: ShardedState) -> Schedule:
    prec = state.precision
    layout, planned_prec, planned = memory.planned
    if planned is not None and layout is state.layout and planned_prec == prec:
        return planned
    schedule = plan(
        stage,
        state.layout,
        o.mesh.size,
        memory.hooked_units(state.layout, o.module),
        just_in_time=o.just_in_time,
        prefetch=o.prefetch,
        reshard_after_forward=o.reshard_after_forward,
        secondary=o.secondary,
        quantize=o.quantize,
        overlap_reduce=o.overlap_reduce,
        reduce_bucket_bytes=o.reduce_bucket_bytes,
        accumulate_locally=o.accumulate == "local",
        comm_dtypes=(None, None) if prec is None else (prec.gather_dtype, prec.reduce_dtype),
    )
    memory.planned = (state.layout, prec, schedule)
    return schedule
