"""sharded_step: every ZeRO stage as one composition of the per-unit primitive.

The composition is `_body.body`, which reads as the stage table. Here is what wraps it:
the options checked once (`_options`), the loss wrappers (buffers threaded through,
the losses' weights, the loss scale), the next state built, donation, and Python's
collector paused for the step's length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import _comm
from .._comm import Mesh, QuantizedComm
from .._core import LossFn, UnitSpec, differentiating
from .._engine import (
    Context,
    UnitLedger,
    checkpoints_rebound,
    context,
    differentiates_by_leaf,
    gradient_hooks,
    restored,
)
from .._state import ShardedState, check_offload, mark_consumed
from ..optim import Optimizer
from ..optim._base import check_optimizer
from ._aux import Aux
from ._body import body
from ._bound import bound_said
from ._bursts import jit_units
from ._cache import StepCache
from ._casts import forward_casts
from ._compile_checks import agree_present
from ._compile_checks import check as check_compiled
from ._compiled import CompiledLoss
from ._compiled_grad import stands_in
from ._config import (
    agree,
    check_module,
    check_optimizer_state,
    configuration,
    flag_changed_said,
    say_frozen_trained,
)
from ._loss import BufferThread, ScaledLoss, sync_buffers
from ._loss_weights import Weighed
from ._micro_batches import micro_batches
from ._norm_dtypes import norm_dtypes_named
from ._options import StepOptions, check_step_state, step_options
from ._stalls import said_stalled
from ._unused import say_unused

Step = Callable[[ShardedState, Any], tuple[ShardedState, Any]]


def sharded_step(
    loss_fn: LossFn,
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    layout: str | None = None,
    units: Sequence[UnitSpec] | None = None,
    module: nn.Module | None = None,
    just_in_time: bool = False,
    reshard_after_forward: bool | int = True,
    prefetch: bool = True,
    quantize: QuantizedComm | None = None,
    ledger: UnitLedger | None = None,
    donate: bool = True,
    accumulate: str | None = None,
    buffer_sync: str = "broadcast",
    overlap_reduce: bool = True,
    reduce_bucket_bytes: int | None = None,
    compile: bool | str = False,
    has_aux: bool = False,
) -> Step:
    """A training step for ZeRO `stage`: `step(state, batch) -> (state, loss)`.

    `loss_fn(params, batch)` is this rank's loss on its micro-batch; the update uses the
    mean over ranks of the gradients, so N ranks train exactly like one process on the
    concatenated batch. A pair `(total, weight)` instead makes the update minimise the
    global sum(total) / sum(weight); a rank without data calls `step(state, None)`. Every
    rank calls `step` as often as the others. Each option at length: docs/training.md.

    Args:
      loss_fn: `(params, batch) -> scalar` or `(total, weight)`, params the full tree.
      optimizer: the `fzero.optim.Optimizer` the state was built with.
      mesh: the mesh.
      stage: 0-3, the state's.
      layout, units: if given, checked against the state's.
      module: the module `loss_fn` calls through `torch.func.functional_call`: a unit
        naming a submodule enters the loss as that submodule runs (module hooks).
      just_in_time: every unit but the root enters where the loss asks for it with
        `fzero.gathered(params, unit)`.
      reshard_after_forward: stage 3: free a unit's gathered parameters after its
        forward, gather them again for its backward; an int k (hpZ) from k ranks' copies.
      prefetch: stage 3: gather the next unit while the current one computes.
      quantize: a `fzero.QuantizedComm`: int8 gathers and reduce-scatters (ZeRO++).
      ledger: a `fzero.UnitLedger` recording live full-unit bytes.
      donate: update the state in place (it must not be used again); False: a pure step.
      accumulate: `batch` is a list of micro-batches, reduced once after the last
        ("local", DDP's `no_sync`) or into the shard after each ("sharded").
      buffer_sync: how ranks agree on buffers: "broadcast" (rank 0's), "mean", "local".
      overlap_reduce: reduce a unit's gradient while the backward goes on.
      reduce_bucket_bytes: reduce gradients in bursts of about this many bytes (DDP's
        `bucket_cap_mb`, stages 0-1; compiled, every stage's collectives); 0: each unit as
        soon as it is complete. None: 25 MiB, but 4 MiB compiled at stages 1-3, whose
        graph reduces a burst while the backward goes on and, at stage 3, whose forward
        waits for each burst's gather (`benchmarks/RESULTS-compiled.md`).
      compile: trace the forward and backward with `torch.compile` as one graph, units
        entering through functional collectives (True: the inductor backend; a string:
        that backend). Units enter before the loss, where their submodule runs
        (`module=`'s hooks, traced) or, with `just_in_time`, where it calls
        `fzero.gathered` (stage 3 recomputes such a gather for the backward unless
        `reshard_after_forward=False` or accumulating locally; with hpZ's k, from the
        1/k the forward kept); one graph, or pieces where the loss breaks it (said
        once); 1-D and 2-D meshes, precision, loss scaling, accumulation, offload,
        quantize and hpZ, but no `ledger=`; fzero's optimizers then update through
        fused kernels (docs/training.md, "Compiled steps").
      has_aux: `loss_fn` returns `(output, aux)`, `output` what it returns otherwise and
        `aux` anything (metrics, logits), handed back detached, not differentiated.

    Returns:
      `step(state, batch) -> (new_state, loss)`, loss detached: this rank's mean over its
      micro-batches for scalar losses (a rank without data: the mean over the ranks that
      had some, float64), the global weighted mean (float64) for pairs. With `has_aux`,
      `(new_state, (loss, aux))`: this rank's aux (None without data), with `accumulate`
      a list of them, one per micro-batch.
    """
    check_optimizer(optimizer, "sharded_step", mesh)
    o = step_options(
        mesh,
        stage,
        layout=layout,
        units=units,
        module=module,
        just_in_time=just_in_time,
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        quantize=quantize,
        ledger=ledger,
        donate=donate,
        accumulate=accumulate,
        buffer_sync=buffer_sync,
        overlap_reduce=overlap_reduce,
        reduce_bucket_bytes=reduce_bucket_bytes,
        compile=compile,
        has_aux=has_aux,
    )
    cache = StepCache()

    def refused(state: ShardedState) -> str:
        """A module= parameter frozen or unfrozen since, or a step inside a `bind` block
        over its own model or state: refused with the name check, on every rank alike,
        before anything else is sent."""
        flipped = cache.flag_changed(getattr(state, "layout", None), o.module)
        said = flag_changed_said(flipped, o.module, mesh.rank)
        return said or bound_said(o.module, state, mesh.rank)

    def step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        with (  # the call outermost: what its entry raises on one rank, its peers raise
            _comm.call(mesh, "sharded_step", problem=lambda: refused(state)),
            collector_paused(),
            differentiating("sharded_step", mesh.rank),
            norm_dtypes_named(o.module, state, mesh.rank),
        ):
            return _step(state, batch)

    def _step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        if cache.order is None and cache.micro is None:
            micro = _first_step(o, optimizer, cache, state, batch)
        else:
            check_step_state(state, o.stage.number, o.layout, o.units, mesh)
            if state.offload is not None:  # a later state may be another tier's
                check_offload(state.offload.offload, state.stage, o.donate)
            micro = micro_batches(batch, o.accumulate, cache.micro)
        # Parameters' gradient hooks, read each step (one may be registered at any time);
        # a compiled step refuses them.
        trained = cache.trained_parameters(state.layout, o.module)
        hooks = gradient_hooks(trained, mesh.rank) if o.compile is None else {}
        # The hooks by identity (a hook may hold tensors); the context keeps them alive.
        key = (state.precision, tuple((p, tuple(map(id, h.hooks))) for p, h in hooks.items()))
        ctx = cache.context(state.layout, key, lambda: _context(o, cache, state, hooks))
        if cache.order is None and cache.micro is None:
            _first_batches(ctx, cache, micro, mesh)
        fn: LossFn = loss_fn
        threaded, aux = None, None
        if o.has_aux:  # below the others: they see what loss_fn returns without aux
            fn = aux = Aux(loss_fn, mesh.rank, (state.params, state.master))
        if state.buffers is not None:
            fn = threaded = BufferThread(fn, state.buffers, mesh.rank)
        trainable = not all(b.frozen for b in state.layout.buckets)
        fn = weighed = Weighed(fn, mesh.rank, trainable)
        if state.scaler is not None:
            fn = ScaledLoss(fn, state.scaler.scale, mesh.rank)
        compiled = None
        if o.compile is not None:
            compiled = cache.compiled(
                state.layout,
                state.precision,
                lambda: CompiledLoss(
                    loss_fn,
                    state.layout,
                    o.stage,
                    mesh,
                    o.compile,
                    o.reduce_bucket_bytes,
                    state.precision,
                    jit_units(state.layout) if o.just_in_time else frozenset(),
                    o.reshard,
                    o.accumulate == "local",
                    cache.hooked_units(state.layout, o.module),
                    o.quantize,
                ),
            )
            # A rank without data runs a batch of its own again (`stand_in`), if it has one.
            agree_present(micro, mesh, stands_in(compiled, micro))
        # A collective that fails or times out is said as a peer's failure or a stall.
        with said_stalled("sharded_step", mesh.rank, state.step):
            # Compiled, no gradient is handed over during the backward (it is the graph's).
            overlap = compiled is None and _may_overlap(o, cache, state, ctx)
            thread = cache.host_thread() if overlap else None
            # torch's activation checkpoints (Hugging Face's layers' too) recompute with
            # the forward's parameters: eagerly, and those a compiled loss runs in the
            # Python between its pieces (a traced one is the graph's, with its own).
            # Until one has weight somewhere, eager steps record which leaves a gradient
            # reached (`_unused`).
            used: set[int] | None = set() if compiled is None and not cache.checked_use else None
            rebound = checkpoints_rebound(o.module, compiled is not None)
            casts = forward_casts(
                o.module, cache.hooked_units(state.layout, o.module), state.precision
            )
            # torch's functional_call can leave a submodule reached by two paths holding
            # the step's tensors (`shared_slots`): the module's own are put back.
            with rebound, casts, restored(cache.shared_slots(o.module, state.buffers)):
                out = body(
                    fn, weighed, optimizer, o, ctx, state, micro, cache.order, thread, compiled,
                    used,
                )  # fmt: skip
        cache.pool.reclaim()
        cache.micro, cache.order = len(micro), out.order
        if used is not None and out.tally.weight != 0:
            cache.checked_use = True
            say_unused(used, state.layout, mesh)
        if out.looked is not None:
            cache.looked = bool(cache.looked) or out.looked
        tally = out.tally
        local = weighed.local_loss()
        # Scalar losses: this rank's mean, as always; pairs: the global weighted mean.
        loss = tally.loss() if tally.pairs or local is None else local
        if aux is not None:
            loss = (loss, aux.handed(micro, o.accumulate is not None))
        if tally.weight == 0:  # nothing counted anywhere: the state is returned as it was
            if not cache.warned:
                cache.warned = True
                warnings.warn(
                    f"fzero: step {state.step}: the losses' weights sum to 0 over every rank "
                    "(no data, or no tokens, anywhere): no update. Reported once",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return state, loss
        buffers = None
        if threaded is not None:
            buffers = sync_buffers(threaded.buffers, o.buffer_sync, mesh, tally.present)
        scaler = None if state.scaler is None else state.scaler.next(found_inf=not out.applied)
        new = dataclasses.replace(
            state,
            params=out.params,
            opt_state=out.opt_state,
            step=state.step + int(out.applied),
            buffers=buffers,
            master=out.master,
            scaler=scaler,
        )
        if o.donate:
            mark_consumed(state)
        return new, loss

    return step


def _may_overlap(o: StepOptions, cache: StepCache, state: ShardedState, ctx: Context) -> bool:
    """Whether an offloaded state's buckets may step during the backward: nothing in the
    step needs the whole gradient first. Not the loss scaler (its inf check), qgZ's
    check, nor an optimizer that asked for the global norm: an earlier offloaded step of
    this function, run after its backward, showed it did not ask (docs/design.md, [Note:
    offload])."""
    if state.offload is None or not state.offload.offload.overlap:
        return False
    if state.scaler is not None or ctx.schedule.all_reduce:
        return False
    if o.quantize is not None and o.quantize.grads:
        return False
    return cache.looked is False


def _first_step(
    o: StepOptions, optimizer: Optimizer, cache: StepCache, state: ShardedState, batch: Any
) -> list[Any]:
    """The first call's checks, agreed among the ranks before any collective of the step:
    each rank's own (its state, its batch, its optimizer state), then the configuration
    every rank must share (`_config`). The same error on every rank otherwise. Returns the
    micro-batches."""
    mesh = o.mesh
    micro, config, error = [], None, None
    try:
        check_step_state(state, o.stage.number, o.layout, o.units, mesh)
        micro = micro_batches(batch, o.accumulate, cache.micro)
        check_optimizer_state(optimizer, state, mesh.rank, mesh.shard_rank)
        check_module(o.module, state, mesh.rank)
        say_frozen_trained(o.module, state, mesh.rank)
        # Refuses what would never run (a post-accumulate-grad hook).
        hooks = gradient_hooks(cache.trained_parameters(state.layout, o.module), mesh.rank, True)
        if state.offload is not None:
            check_offload(state.offload.offload, state.stage, o.donate)
        if o.compile is not None:
            check_compiled(o, bool(hooks))
        config = configuration(o, state, optimizer)
        config["micro-batches"] = str(len(micro))
    except Exception as exc:
        error = exc
    cache.present = agree(mesh, config, error, any(mb is not None for mb in micro))
    return micro


def _first_batches(ctx: Context, cache: StepCache, micro: list[Any], mesh: Mesh) -> None:
    """On the first call, a rank without data has no units to follow where the forward
    enters units just in time: every rank raises, naming the ranks without a batch."""
    absent = [r for r, p in enumerate(cache.present) if not p]
    if ctx.schedule.jit and absent:
        raise _comm.agreed(
            ValueError(
                f"rank(s) {absent} called step(state, None) on the first call of a step "
                "function with just-in-time units (module= or just_in_time=True): a rank "
                "without data enters the units the step called last time, and there was no "
                "last time. Give every rank a batch on the first call (with weight 0 if it "
                "should not count)"
            )
        )


def _context(o: StepOptions, cache: StepCache, state: ShardedState, hooks: Any) -> Context:
    """The engine's context for the state's layout and precision, under the options, with
    `module=`'s parameters' gradient `hooks`. A step that differentiates by leaf enters
    no unit: it never hooks `module=`'s submodules."""
    lay = state.layout
    by_leaf = differentiates_by_leaf(o.stage, o.mesh.size)
    hooked = {} if by_leaf else cache.hooked_units(lay, o.module)
    sched = o.schedule(lay, state.precision, hooked)
    own = cache.trained_parameters(lay, o.module)
    return context(sched, lay, o.mesh, cache.pool, o.ledger, hooks, own)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector is paused for the duration of a step: a step's
    objects die by reference counting, and a full collection in the middle of one stalls
    every rank (docs/design.md, [Note: the collector]). Collections resume (and collect
    any cycles the loss made) once the step returns.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
