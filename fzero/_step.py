"""sharded_step: each ZeRO stage as a composition of the four primitives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._autodiff import value_and_grad
from ._comm import all_gather
from ._gather import gather_params_into
from ._grads import local_shard
from ._hooks import hookable_units, value_and_shard_grad
from ._layout import ShardLayout
from ._loss import BufferThread, ScaledLoss, sync_buffers
from ._mesh import Mesh
from ._replicated import full_buckets, own_slices
from ._scale import unscale_
from ._shards import Shards
from ._stages import stage_of
from ._state import ShardedState, check_step_state
from ._tree import PyTree, tree_flatten, tree_map
from ._unit_ledger import UnitLedger
from ._update import sharded_update
from .optim import Optimizer

LossFn = Callable[[PyTree, Any], torch.Tensor]
Step = Callable[[ShardedState, Any], tuple[ShardedState, torch.Tensor]]
# (params, opt_state, master, loss, applied): applied is False when the loss scaler skipped
Out = tuple[PyTree, Any, Any, torch.Tensor, bool]


@dataclass
class _Options:
    mesh: Mesh
    module: nn.Module | None
    reshard_after_forward: bool
    prefetch: bool
    ledger: UnitLedger | None
    donate: bool
    accumulate: str | None
    buffer_sync: str
    overlap_reduce: bool
    reduce_bucket_bytes: int
    order: list[str] = field(default_factory=list)  # unit call order, for prefetching
    comm: tuple[Any, Any] = (None, None)  # (gather, reduce) dtypes of the current state
    jit: tuple[Any, dict[str, Any]] = (None, {})  # (layout, its hooked units), computed once


def sharded_step(
    loss_fn: LossFn,
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    layout: str | None = None,
    units: Sequence[str] | None = None,
    module: nn.Module | None = None,
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

    Every stage works unit by unit (`units=` of `shard_state`). With `module=` (the
    module `loss_fn` calls through `torch.func.functional_call`, params keyed by
    `named_parameters`), each unit that names a submodule is gathered (stage 3) just
    before its forward and its gradient reduced (all-reduced at stage 0, reduce-scattered
    at stages 1-3) once its backward is complete (at stages 0-1 together with the next
    units', `reduce_bucket_bytes` at a time); the parameters of such a unit may
    only be used inside that submodule's forward. Without `module=`, every unit is
    gathered before the forward and reduced when the backward reaches it. Stage 0 on one
    rank has nothing to communicate: it differentiates by leaf, as an eager loop does,
    with no units (so no restriction on where a unit's parameters are used).

    Args:
      loss_fn: `(params, batch) -> scalar tensor`, params being the full tree.
      optimizer: the `fzero.optim.Optimizer` the state was built with.
      mesh: the mesh.
      stage: 0-3; must match the state's.
      layout: optional; if given, must match the state's layout kind.
      units: optional; if given, must match the state's units.
      module: the module whose unit submodules are hooked, so that each unit is gathered
        and its gradient reduced as its submodule runs. Every rank must then call the same
        units in the same order; each step checks that, raising a ValueError that lists
        every rank's calls.
      reshard_after_forward: stage 3: free a unit's gathered parameters after its forward
        and gather them again for its backward (less memory, one more all-gather).
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
    body = {0: _stage0, 1: _stage1, 2: _stage2, 3: _stage3}[stage]
    opts = _Options(
        mesh,
        module,
        reshard_after_forward,
        prefetch,
        ledger,
        donate,
        accumulate,
        buffer_sync,
        overlap_reduce,
        reduce_bucket_bytes,
    )

    def step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        check_step_state(state, stage, layout, units, mesh)
        prec = state.precision
        opts.comm = (prec.gather_dtype, prec.reduce_dtype) if prec is not None else (None, None)
        fn: LossFn = loss_fn
        threaded = scaled = None
        if state.buffers is not None:
            fn = threaded = BufferThread(loss_fn, state.buffers)
        if state.scaler is not None:
            fn = scaled = ScaledLoss(fn, state.scaler.scale, mesh.rank)
        params, opt_state, master, loss, applied = body(fn, optimizer, opts, state, batch)
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
            prec,
        )
        return new, loss

    return step


def _stage0(
    loss_fn: LossFn, optimizer: Optimizer, o: _Options, state: ShardedState, batch: Any
) -> Out:
    """DDP: params enter the loss through an identity whose VJP all-reduces, unit by unit;
    every rank applies the same full update."""
    lay = state.layout
    if o.mesh.size == 1:
        loss, grads = _leaf_grad(loss_fn, batch, o, state)
    else:
        full = full_buckets(state.params, lay)
        loss, reduced = _unit_grad(loss_fn, batch, o, lay, full, full, replicate=True)
        flats = [f if b.frozen else g for f, g, b in zip(full, reduced.buffers, lay.buckets)]
        grads = lay.trainable(lay.unflatten(flats))
    if state.master is None:
        new, opt_state, applied = _update(optimizer, o, state, lay.trainable(state.params), grads)
        return lay.merge(state.params, new), opt_state, None, loss, applied
    master, opt_state, applied = _update(optimizer, o, state, state.master, grads)
    if not applied:
        return state.params, opt_state, master, loss, False
    return _cast_tree(master, state, o), opt_state, master, loss, True


def _stage1(
    loss_fn: LossFn, optimizer: Optimizer, o: _Options, state: ShardedState, batch: Any
) -> Out:
    """Optimizer state sharded: unit gradients are reduce-scattered during the backward in
    DDP-sized bursts (`reduce_bucket_bytes`), a burst finished when the next unit's
    gradient arrives (about one burst of full gradients alive); own shard updated;
    parameters all-gathered (2Ψ per step, like stages 0, 2)."""
    return _update_and_regather(optimizer, o, state, batch, loss_fn, bursts=True)


def _stage2(
    loss_fn: LossFn, optimizer: Optimizer, o: _Options, state: ShardedState, batch: Any
) -> Out:
    """+ gradients sharded: params enter the loss through an identity whose VJP
    reduce-scatters, unit by unit; update own shard; all-gather parameters."""
    return _update_and_regather(optimizer, o, state, batch, loss_fn, bursts=False)


def _stage3(
    loss_fn: LossFn, optimizer: Optimizer, o: _Options, state: ShardedState, batch: Any
) -> Out:
    """+ parameters sharded: params enter the loss through an all-gather, unit by unit,
    whose VJP reduce-scatters; parameters stay sharded."""
    lay = state.layout
    loss, grads = _unit_grad(loss_fn, batch, o, lay, state.params.buffers, None)
    if state.master is None:
        params, opt_state, applied = _update(optimizer, o, state, state.params, grads)
        return params, opt_state, None, loss, applied
    master, opt_state, applied = _update(optimizer, o, state, state.master, grads)
    if not applied:
        return state.params, opt_state, master, loss, False
    old = state.params
    if o.donate:
        with torch.no_grad():
            for p, m, b in zip(old.buffers, master.buffers, lay.buckets):
                if not b.frozen:
                    p.copy_(m)
        return old, opt_state, master, loss, True
    bufs = tuple(
        p if b.frozen else m.to(p.dtype)
        for p, m, b in zip(old.buffers, master.buffers, lay.buckets)
    )
    return Shards(bufs, lay, old.rank), opt_state, master, loss, True


def _update(
    optimizer: Optimizer, o: _Options, state: ShardedState, target: Any, grads: Any
) -> tuple[Any, Any, bool]:
    """The optimizer step on `target` (parameters or masters; a tree or Shards).

    Gradients arrive in the reduce dtype and are cast to the target's. With a loss scaler
    they are unscaled, and if any rank found an inf or NaN, nothing is updated on any rank
    (the third value is then False).
    """
    if isinstance(target, Shards):
        bufs = tuple(g.to(t.dtype) for g, t in zip(grads.buffers, target.buffers))
        grads, leaves = Shards(bufs, target.layout, target.rank), list(bufs)
    else:
        grads = tree_map(lambda g, t: g.to(t.dtype), grads, target)
        leaves = tree_flatten(grads)[0]
    if state.scaler is not None and unscale_(leaves, state.scaler.scale, o.mesh):
        return target, state.opt_state, False
    new, opt_state = sharded_update(
        optimizer, target, grads, state.opt_state, donate=o.donate, mesh=o.mesh
    )
    return new, opt_state, True


def _update_and_regather(
    optimizer: Optimizer,
    o: _Options,
    state: ShardedState,
    batch: Any,
    loss_fn: LossFn,
    bursts: bool,
) -> Out:
    """Stages 1-2: replicated parameters in, shard gradients out; update own shard (or
    master), all-gather the rest."""
    lay = state.layout
    local = full_buckets(state.params, lay)
    # What the optimizer updates: the masters; else, donating, this rank's slice of the
    # replicated buffers itself (updated where it lies, so the gather only fills the
    # peers' slices); else a copy of it. Only its shapes reach the gradient pass.
    target = state.master
    if target is None and o.donate:
        target = Shards(own_slices(local, lay, o.mesh.rank), lay, o.mesh.rank)
    elif target is None:
        target = local_shard(lay.trainable(state.params), lay, o.mesh)
    loss, grads = _unit_grad(loss_fn, batch, o, lay, target.buffers, local, bursts=bursts)
    new, opt_state, applied = _update(optimizer, o, state, target, grads)
    master = None if state.master is None else new
    if not applied:  # nothing changed anywhere: no gather either
        return state.params, opt_state, master, loss, False
    return _regather(new, local, state, o), opt_state, master, loss, True


def _cast_tree(master: PyTree, state: ShardedState, o: _Options) -> PyTree:
    """Stage 0 under mixed precision: the parameters as the masters cast down."""
    lay = state.layout
    trainable = lay.trainable(state.params)
    with torch.no_grad():
        if o.donate:  # into the flat buffers the parameters are views of
            tree_map(lambda p, m: p.copy_(m), trainable, master)
            return state.params
        cast = tree_map(lambda p, m: m.to(p.dtype), trainable, master)
        return lay.unflatten(lay.flatten(lay.merge(state.params, cast)))


def _regather(
    shard: Shards, local: tuple[torch.Tensor, ...], state: ShardedState, o: _Options
) -> PyTree:
    """Stages 1-2: every rank's updated shard, all-gathered into the full parameters.

    Frozen buckets are not gathered: every rank already holds them, unchanged. Donating,
    the trainable buckets are gathered into the buffers the old parameters live in (no
    second full copy); otherwise into new ones. Under mixed precision `shard` is the
    master shard, which travels cast to the gather dtype. `local`: the full buffers the
    step ran on (`full_buckets` of the parameters), whose own slice may already be `shard`.
    """
    lay = state.layout
    full = list(local)
    live = [i for i, b in enumerate(lay.buckets) if not b.frozen]
    comm = tuple(o.comm[0] or lay.buckets[i].dtype for i in live)
    if o.donate:
        gather_params_into(
            Shards(tuple(shard.buffers[i] for i in live), lay, o.mesh.rank),
            o.mesh,
            tuple(full[i] for i in live),
            comm,
        )
    else:
        for i, c in zip(live, comm):
            full[i] = all_gather(shard.buffers[i].to(c), o.mesh).to(lay.buckets[i].dtype)
    return lay.unflatten(full)


def _unit_grad(
    loss_fn: LossFn,
    batch: Any,
    o: _Options,
    layout: ShardLayout,
    shards: tuple[torch.Tensor, ...],
    local: tuple[torch.Tensor, ...] | None,
    replicate: bool = False,
    bursts: bool = False,
) -> tuple[torch.Tensor, Shards]:
    """Loss and shard gradients, unit by unit; over every micro-batch when accumulating.

    With `replicate` (stage 0) the "shards" are the full buckets, all-reduced. With
    `bursts` (stage 1) reductions start `reduce_bucket_bytes` at a time.
    """
    micro = _micro_batches(batch, o)
    if o.jit[0] is not layout:  # walks the module: once per state layout, not every step
        o.jit = (layout, hookable_units(layout, o.module))
    acc: dict[int, torch.Tensor] | None = {} if o.accumulate == "local" else None
    losses, total = [], None
    for j, mb in enumerate(micro):
        loss, grads = value_and_shard_grad(
            loss_fn,
            mb,
            mesh=o.mesh,
            layout=layout,
            shards=shards,
            local=local,
            module=o.module,
            reshard=o.reshard_after_forward,
            prefetch=o.prefetch,
            order=o.order,
            ledger=o.ledger,
            acc=acc,
            final=j == len(micro) - 1,
            overlap=o.overlap_reduce,
            replicate=replicate,
            bursts=bursts,
            hold_bytes=o.reduce_bucket_bytes,
            jit=o.jit[1],
            comm_dtypes=o.comm,
        )
        losses.append(loss)
        total = grads if total is None else tuple(t + g for t, g in zip(total, grads))
    assert total is not None
    if len(micro) > 1:
        total = tuple(t / len(micro) for t in total)
    return torch.stack(losses).mean(), Shards(total, layout, o.mesh.rank)


def _leaf_grad(loss_fn: LossFn, batch: Any, o: _Options, state: ShardedState) -> tuple[Any, Any]:
    """Stage 0 on one rank: loss and gradients by leaf, over every micro-batch.

    With nothing to communicate there is nothing to gather or reduce unit by unit, so the
    gradient is taken with respect to the leaves themselves, as an eager loop's `.grad`:
    no per-unit nodes and no flat gradient buffers (assembling them copies every gradient
    once more). The values are those of the unit path on one rank, bitwise: gradients
    pass through the reduce dtype as they would through a reduction ("local"
    accumulation sums them first, "sharded" after), and a mean over micro-batches.
    """
    lay, reduce_dtype = state.layout, o.comm[1]
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
