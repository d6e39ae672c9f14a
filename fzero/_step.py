"""sharded_step: every ZeRO stage as one composition of the per-unit primitives.

    enter (per unit) -> value and grad -> sharded_update -> all-gather (stages 1-2)

`_train` reads as the stage table (`_stages`): the parameters enter the loss unit by unit
(`_engine`, scheduled by a `_schedule.Schedule` chosen once per step), the gradient comes
out reduced as the stage reduces it, the optimizer updates what this rank owns
(`sharded_update`), and where a stage replicates the parameters but shards the optimizer,
the updated shards are all-gathered.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._autodiff import value_and_grad
from ._engine import Engine
from ._grads import local_shard
from ._hooks import hookable_units
from ._layout import ShardLayout
from ._loss import BufferThread, ScaledLoss, sync_buffers
from ._mesh import Mesh
from ._replicated import full_buckets, own_slices
from ._schedule import Schedule, plan
from ._shards import Shards
from ._stages import Stage, stage_of
from ._state import ShardedState, check_step_state
from ._tree import PyTree, tree_map
from ._unit_ledger import UnitLedger
from ._update import apply_update, rebuild_params
from .optim import Optimizer

LossFn = Callable[[PyTree, Any], torch.Tensor]
Step = Callable[[ShardedState, Any], tuple[ShardedState, torch.Tensor]]
# (params, opt_state, master, loss, applied): applied is False when the loss scaler skipped
Out = tuple[PyTree, Any, Any, torch.Tensor, bool]


@dataclass(frozen=True)
class _Options:
    """What `sharded_step` was asked for (fixed for the step function's life)."""

    mesh: Mesh
    module: nn.Module | None
    just_in_time: bool
    reshard_after_forward: bool
    prefetch: bool
    ledger: UnitLedger | None
    donate: bool
    accumulate: str | None
    buffer_sync: str
    overlap_reduce: bool
    reduce_bucket_bytes: int


@dataclass
class _Memory:
    """What a step function carries from one call to the next."""

    order: list[str] = field(default_factory=list)  # just-in-time units, last step's order
    hooked: tuple[Any, dict[str, Any]] = (None, {})  # (layout, its hooked units): walked once

    def hooked_units(self, layout: ShardLayout, module: nn.Module | None) -> dict[str, Any]:
        if self.hooked[0] is not layout:
            self.hooked = (layout, hookable_units(layout, module))
        return self.hooked[1]


def sharded_step(
    loss_fn: LossFn,
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    layout: str | None = None,
    units: Sequence[str] | None = None,
    module: nn.Module | None = None,
    just_in_time: bool = False,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    ledger: UnitLedger | None = None,
    donate: bool = True,
    accumulate: str | None = None,
    buffer_sync: str = "broadcast",
    overlap_reduce: bool = True,
    reduce_bucket_bytes: int = 25 * 2**20,
) -> Step:
    """A training step for ZeRO `stage`: `step(state, batch) -> (state, loss)`.

    `loss_fn(params, batch)` is this rank's loss on its micro-batch; the update uses the
    mean over ranks of the gradients (DDP semantics), so N ranks on micro-batches of size b
    train exactly like one process on their concatenation with a mean loss.

    Every stage works unit by unit (`units=` of `shard_state`): a unit's parameters
    enter the loss through the stage's primitive (identity at stages 0-2, all-gather at
    stage 3) and leave it through its transpose (all-reduce at stage 0, reduce-scatter at
    stages 1-3), once the unit's backward is complete (at stages 0-1 together with the
    next units', `reduce_bucket_bytes` at a time). When a unit enters:

    - with `module=` (the module `loss_fn` calls through `torch.func.functional_call`,
      params keyed by `named_parameters`), a unit that names a submodule enters just
      before that submodule's forward, and its parameters may only be used there;
    - with `just_in_time=True`, every unit but the root enters when `loss_fn` asks for it
      with `fzero.gathered(params, unit)`, and only there (a pure function over the tree,
      no module needed);
    - otherwise, before the forward: the whole tree is gathered up front (at stage 3),
      and `fzero.gathered` returns the unit's part of it.

    Units entered just in time cost what FSDP's do: a few units of full parameters and
    gradients at a time. Units entered up front keep every full gradient (and at stage 3
    every full parameter) until the end of the backward: the step cannot know which
    units a loss will ask for before running it, so it does not guess. Stage 0 on one
    rank has nothing to communicate: it differentiates by leaf, as an eager loop does.

    Args:
      loss_fn: `(params, batch) -> scalar tensor`, params being the full tree.
      optimizer: the `fzero.optim.Optimizer` the state was built with.
      mesh: the mesh.
      stage: 0-3; must match the state's.
      layout: optional; if given, must match the state's layout kind.
      units: optional; if given, must match the state's units.
      module: the module whose unit submodules are hooked, so that each unit enters the
        loss as its submodule runs. Every rank must then call the same units in the same
        order; each step checks that, raising a ValueError that lists every rank's calls.
      just_in_time: every unit but the root enters only when `loss_fn` asks for it with
        `fzero.gathered(params, unit)`; until then its leaves in `params` are placeholders,
        and using them directly raises a ValueError. The same call check applies.
      reshard_after_forward: stage 3: a just-in-time unit's gathered parameters are freed
        once the forward lets go of them (autograd keeps handles, not the tensors) and
        gathered again for its backward (less memory, one more all-gather).
      prefetch: stage 3: start gathering the next unit (in last step's order) while the
        current one computes, in forward and backward.
      ledger: a UnitLedger recording live full-unit bytes (for tests and benchmarks).
      donate: consume the state (like JAX's `donate_argnums`): parameters, shards and
        optimizer state are updated in place, so a step never holds a second copy of them;
        the state passed in must not be used again. False makes the step pure.
      accumulate: gradient accumulation: `batch` is then a sequence of micro-batches and
        the update uses the mean gradient over all of them (and all ranks). "local" (DDP's
        `no_sync`) sums full gradients on each rank and reduces once, after the last
        micro-batch (no gradient communication before it; full gradient memory);
        "sharded" (DeepSpeed's way) reduces every micro-batch into the rank's shard (less
        memory, more communication). The loss returned is the mean over micro-batches.
      buffer_sync: for a state with buffers, how ranks agree on the buffers `loss_fn`
        returns: "broadcast" (rank 0's, as DDP's `broadcast_buffers`), "mean" (floating
        buffers averaged over ranks, e.g. BatchNorm running means; others rank 0's), or
        "local" (each rank keeps its own).
      overlap_reduce: a unit's gradient reduction runs asynchronously while the units
        before it differentiate: at stages 2-3 at most one in flight (so one more unit of
        full gradients is alive); at stage 1 one burst (`reduce_bucket_bytes`), finished
        when the next unit's gradient arrives; at stage 0 any number (it keeps every full
        gradient anyway, like DDP); False reduces each unit synchronously.
      reduce_bucket_bytes: stages 0-1: complete unit gradients are reduced in bursts of
        about this many bytes, as DDP's `bucket_cap_mb` (default 25 MiB, DDP's too): a
        few large bursts of communication instead of one per unit, which on CPU cores
        shared between compute and communication threads is faster (see benchmarks/).
        Stage 0, as DDP, writes the units' gradients into one buffer of at most this
        size (a larger unit gets its own) and all-reduces each buffer as one collective;
        stage 1 waits until at least this many bytes of unit gradients are ready, then
        starts their reduce-scatters together. 0 starts each unit's reduction as soon as
        it is complete. Stages 2-3 never hold (their memory bound).

    Returns:
      `step(state, batch) -> (new_state, loss)`, loss detached.
    """
    stage = stage_of(stage).number
    if accumulate not in (None, "local", "sharded"):
        raise ValueError(f"accumulate must be None, 'local' or 'sharded', got {accumulate!r}")
    if isinstance(reduce_bucket_bytes, bool) or not isinstance(reduce_bucket_bytes, int):
        raise TypeError(f"reduce_bucket_bytes must be an int, got {reduce_bucket_bytes!r}")
    if reduce_bucket_bytes < 0:
        raise ValueError(f"reduce_bucket_bytes must be >= 0, got {reduce_bucket_bytes}")
    if buffer_sync not in ("broadcast", "mean", "local"):
        raise ValueError(f"buffer_sync must be 'broadcast', 'mean' or 'local', got {buffer_sync!r}")
    opts = _Options(
        mesh,
        module,
        bool(just_in_time),
        reshard_after_forward,
        prefetch,
        ledger,
        donate,
        accumulate,
        buffer_sync,
        overlap_reduce,
        reduce_bucket_bytes,
    )
    memory = _Memory()

    def step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        with _collector_paused():
            return _step(state, batch)

    def _step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        check_step_state(state, stage, layout, units, mesh)
        fn: LossFn = loss_fn
        threaded = scaled = None
        if state.buffers is not None:
            fn = threaded = BufferThread(loss_fn, state.buffers)
        if state.scaler is not None:
            fn = scaled = ScaledLoss(fn, state.scaler.scale, mesh.rank)
        params, opt_state, master, loss, applied = _train(fn, optimizer, opts, memory, state, batch)
        if scaled is not None:
            loss = torch.stack(scaled.losses).mean()  # the loss itself, not the scaled one
        buffers = None if threaded is None else sync_buffers(threaded.buffers, buffer_sync, mesh)
        scaler = None if state.scaler is None else state.scaler.next(found_inf=not applied)
        new = ShardedState(
            params,
            opt_state,
            state.step + int(applied),
            state.layout,
            stage,
            buffers,
            master,
            scaler,
            state.precision,
        )
        return new, loss

    return step


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector is paused for the duration of a step.

    A step's Python objects (views, calls, its engine) are freed by reference counting,
    none in a cycle (tests/test_memory.py checks), but while a step runs a few thousand
    of them are alive at once. That triggers collections, which promote them, until a
    full collection walks every object of the process: ~90 ms in a torch process of 170k
    objects, one step in ten on the GPT benchmark, on whichever rank reaches the
    threshold first, while the others wait in its next collective. Collections resume
    (and collect any cycles the loss made) once the step returns.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _train(
    loss_fn: LossFn,
    optimizer: Optimizer,
    o: _Options,
    memory: _Memory,
    state: ShardedState,
    batch: Any,
) -> Out:
    """One step of `state.stage`, read as the stage table: parameters enter the loss per
    unit, value and gradient, the optimizer on what this rank owns, and (stages 1-2) the
    updated shards all-gathered."""
    stage, lay = stage_of(state.stage), state.layout
    local = None if stage.shards_params else full_buckets(state.params, lay)
    target = _target(stage, state, local, o)  # what this rank's optimizer updates
    if stage.reduce == "all_reduce" and o.mesh.size == 1:
        loss, grads = _leaf_grad(loss_fn, batch, o, state)
    else:
        schedule = _schedule(stage, o, memory, state)
        if stage.reduce == "all_reduce":  # every rank keeps the full mean gradient
            assert local is not None
            loss, flats = _value_and_grad(loss_fn, batch, o, memory, stage, schedule, state, local)
            full = [f if b.frozen else g for f, g, b in zip(local, flats, lay.buckets)]
            grads = lay.trainable(lay.unflatten(full))
        else:  # a rank keeps its shard of it, shaped as what it updates
            like = state.params.buffers if stage.shards_params else target.buffers
            loss, flats = _value_and_grad(loss_fn, batch, o, memory, stage, schedule, state, like)
            grads = Shards(flats, lay, o.mesh.rank)
    new, opt_state, applied = apply_update(optimizer, state, target, grads, o.mesh, o.donate)
    master = None if state.master is None else new
    if not applied:  # nothing changed anywhere: no gather either
        return state.params, opt_state, master, loss, False
    params = rebuild_params(stage, new, local, state, o.mesh, o.donate)
    return params, opt_state, master, loss, True


def _target(stage: Stage, state: ShardedState, local: Any, o: _Options) -> Any:
    """What the optimizer updates: the masters if there are any; else the parameters (all
    of the trainable tree, or this rank's shard of it). Stages 1-2, donating, update the
    rank's slice of the replicated buffers where it lies, so the gather after the update
    only fills the peers' slices; not donating, a copy of it."""
    lay, rank = state.layout, o.mesh.rank
    if state.master is not None:
        return state.master
    if stage.shards_params:
        return state.params
    if not stage.shards_optimizer:
        return lay.trainable(state.params)
    if o.donate:
        return Shards(own_slices(local, lay, rank), lay, rank)
    return local_shard(lay.trainable(state.params), lay, o.mesh)


def _schedule(stage: Stage, o: _Options, memory: _Memory, state: ShardedState) -> Schedule:
    prec = state.precision
    return plan(
        stage,
        state.layout,
        o.mesh.size,
        memory.hooked_units(state.layout, o.module),
        just_in_time=o.just_in_time,
        prefetch=o.prefetch,
        reshard_after_forward=o.reshard_after_forward,
        overlap_reduce=o.overlap_reduce,
        reduce_bucket_bytes=o.reduce_bucket_bytes,
        accumulate_locally=o.accumulate == "local",
        comm_dtypes=(None, None) if prec is None else (prec.gather_dtype, prec.reduce_dtype),
    )


def _value_and_grad(
    loss_fn: LossFn,
    batch: Any,
    o: _Options,
    memory: _Memory,
    stage: Stage,
    schedule: Schedule,
    state: ShardedState,
    grads_like: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The loss and this rank's reduced gradient per bucket, over every micro-batch when
    accumulating (their mean)."""
    lay = state.layout
    local = None if stage.shards_params else full_buckets(state.params, lay)
    micro = _micro_batches(batch, o)
    acc: dict[int, torch.Tensor] | None = {} if o.accumulate == "local" else None
    losses, total = [], None
    for j, mb in enumerate(micro):
        engine = Engine(
            stage,
            schedule,
            lay,
            o.mesh,
            grads_like,
            local,
            ledger=o.ledger,
            order=memory.order,
            acc=acc,
            final=j == len(micro) - 1,
        )
        loss, grads = engine.value_and_grad(loss_fn, mb)
        losses.append(loss)
        total = grads if total is None else tuple(t + g for t, g in zip(total, grads))
    assert total is not None
    if len(micro) > 1:
        total = tuple(t / len(micro) for t in total)
    return torch.stack(losses).mean(), total


def _leaf_grad(loss_fn: LossFn, batch: Any, o: _Options, state: ShardedState) -> tuple[Any, Any]:
    """Stage 0 on one rank: loss and gradients by leaf, over every micro-batch.

    With nothing to communicate there is nothing to gather or reduce unit by unit, so the
    gradient is taken with respect to the leaves themselves, as an eager loop's `.grad`:
    no per-unit nodes and no flat gradient buffers (assembling them copies every gradient
    once more). The values are those of the unit path on one rank, bitwise: gradients
    pass through the reduce dtype as they would through a reduction ("local"
    accumulation sums them first, "sharded" after), and a mean over micro-batches.
    """
    lay = state.layout
    reduce_dtype = None if state.precision is None else state.precision.reduce_dtype
    micro = _micro_batches(batch, o)
    trainable = lay.trainable(state.params)

    def rounded(g: Any) -> Any:
        return tree_map(lambda x: x.to(reduce_dtype or x.dtype), g)

    losses, total = [], None
    for mb in micro:
        loss, grads = value_and_grad(loss_fn, state.params, mb, rank=0, frozen=lay.frozen)
        losses.append(loss)
        grads = tree_map(torch.zeros_like, trainable) if grads is None else lay.trainable(grads)
        if o.accumulate != "local":
            grads = rounded(grads)
        total = grads if total is None else tree_map(torch.add, total, grads)
    if o.accumulate == "local":
        total = rounded(total)
    if len(micro) > 1:
        total = tree_map(lambda t: t / len(micro), total)
    return torch.stack(losses).mean(), total


def _micro_batches(batch: Any, o: _Options) -> list[Any]:
    if o.accumulate is None:
        return [batch]
    if not isinstance(batch, (list, tuple)) or not batch:
        raise TypeError(
            f"with accumulate={o.accumulate!r} a step takes a non-empty list of micro-batches, "
            f"got {type(batch).__name__}"
        )
    return list(batch)
