"""sharded_step: every ZeRO stage as one composition of the per-unit primitives.

    enter (per unit) -> value and grad -> sharded_update -> all-gather (stages 1-2)

That composition is `_train.train`, which reads as the stage table (`_stages`). Here is
what wraps it: the options checked once, module buffers threaded through the loss, the
losses' weights (`_weight`), the loss scaler, donation, and the collector paused.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .._comm import Mesh, QuantizedComm, is_peer_failure
from .._core import UnitSpec, differentiating, stage_of
from .._engine import UnitLedger
from .._state import ShardedState, check_step_state, mark_consumed
from ..optim import Optimizer
from ._body import Options, train
from ._gradient import LossFn, Memory
from ._loss import BufferThread, ScaledLoss, sync_buffers
from ._loss_weights import Weighed
from ._options import check_quantize, secondary_axis

Step = Callable[[ShardedState, Any], tuple[ShardedState, torch.Tensor]]


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
    reduce_bucket_bytes: int = 25 * 2**20,
) -> Step:
    """A training step for ZeRO `stage`: `step(state, batch) -> (state, loss)`.

    `loss_fn(params, batch)` is this rank's loss on its micro-batch; the update uses the
    mean over ranks of the gradients (DDP semantics), so N ranks on micro-batches of size b
    train exactly like one process on their concatenation with a mean loss.

    `loss_fn` may instead return a pair `(total, weight)` (the sum of token losses and the
    number of real tokens, say): the update then uses the gradient of sum(total) /
    sum(weight) over every rank and micro-batch, one process minimising the global token
    mean, and the loss returned is that mean. A rank without data calls `step(state,
    None)`: it takes part in every collective with zero gradients and zero weight (the
    mean is over the data that existed) and gets the same state. Every rank must call
    `step` the same number of times; one that stops leaves the others to fail at the
    process group's timeout. A step whose weights sum to 0 everywhere changes nothing and
    warns once (see the README's "Uneven work").

    Every stage works unit by unit (`units=` of `shard_state`): a unit's parameters
    enter the loss through the stage's primitive (identity at stages 0-2, all-gather at
    stage 3) and leave it through its transpose (all-reduce at stage 0, reduce-scatter at
    stages 1-3), once the unit's backward is complete (at stages 0-1 together with the
    next units', `reduce_bucket_bytes` at a time). When a unit enters:

    - with `module=` (the module `loss_fn` calls through `torch.func.functional_call`,
      params keyed by `named_parameters`), a unit that names a submodule enters just
      before that submodule's forward, and its parameters may only be used there (a
      group of submodules: before the first of them runs, until the last is done);
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
      loss_fn: `(params, batch) -> scalar tensor or (total, weight)`, params being the full
        tree; the weight a number or one-element tensor, finite and >= 0.
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
        gathered again for its backward (less memory, one more all-gather), all but the
        forward's last one (two with `prefetch`), which the backward starts with, and the
        units no rank's backward uses the parameters of (an embedding). An int k
        (hpZ, FSDP2's int): before they are freed each rank keeps its 1/k of them, and
        the backward gathers them from the k consecutive ranks of its group (k divides
        the mesh's shard_size), so no backward all-gather leaves a group of k, for 1/k
        of each unit held from its forward to its backward. Creating the groups is
        collective: every rank builds the step with the same k.
      prefetch: stage 3: start gathering the next unit (in last step's order) while the
        current one computes, in forward and backward; at the start of the forward, the
        first units up to the size of the largest one.
      quantize: a `fzero.QuantizedComm` (ZeRO++): parameter all-gathers (stage 3, qwZ)
        and gradient reduce-scatters (stages 1-3, qgZ) travel as int8 blocks with a
        float32 scale each, a quarter of the bytes; the error bound is in `_quant`'s
        docstring and the README. Off by default. Non-finite values raise a ValueError,
        except gradients under a loss scaler, which arrive as NaN for the scaler to skip.
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
        As DDP, the units' gradients are written into one buffer of at most this size
        (a larger unit gets its own), reduced as one collective: all-reduced at stage
        0, reduce-scattered at stage 1 (laid out rank by rank); with local accumulation
        or qgZ, stage 1 waits until this many bytes of unit gradients are ready and
        starts their reduce-scatters together. 0 starts each unit's reduction as soon
        as it is complete. Stages 2-3 hold no more than their memory bound allows: a
        burst is one unit, or consecutive units no larger together than the largest
        one (embeddings, norms), reduced as soon as the last of its units is in. On
        the CPU, where no caching allocator does, the step function keeps these
        buffers, stage 1's reduce-scattered gradient and stage 3's gathered parameters
        from one call to the next (`fzero._pool`), as DDP keeps its buckets: at rest,
        stage 0's full gradient, stage 1's gradient shard and a burst or two, at stages
        2-3 the few units' buffers a step had in use at once. Stages 1-2 also gather
        the updated shards of buckets up to 1 MiB in bursts of up to this many bytes,
        one collective each (DeepSpeed's `allgather_bucket_size`).

    Returns:
      `step(state, batch) -> (new_state, loss)`, loss detached: this rank's mean over its
      micro-batches for scalar losses (a rank without data: the mean over the ranks that
      had some, float64), the global weighted mean (float64) for pairs.
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
    check_quantize(quantize, stage)
    secondary = secondary_axis(reshard_after_forward, stage, mesh)
    opts = Options(
        mesh,
        module,
        bool(just_in_time),
        bool(reshard_after_forward),
        secondary,
        quantize,
        prefetch,
        ledger,
        donate,
        accumulate,
        buffer_sync,
        overlap_reduce,
        reduce_bucket_bytes,
    )
    memory = Memory()

    def step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        with collector_paused(), differentiating("sharded_step", mesh.rank):
            return _step(state, batch)

    def _step(state: ShardedState, batch: Any) -> tuple[ShardedState, torch.Tensor]:
        check_step_state(state, stage, layout, units, mesh)
        fn: LossFn = loss_fn
        threaded = None
        if state.buffers is not None:
            fn = threaded = BufferThread(loss_fn, state.buffers)
        fn = weighed = Weighed(fn, mesh.rank)
        if state.scaler is not None:
            fn = ScaledLoss(fn, state.scaler.scale, mesh.rank)
        try:
            out = train(fn, weighed, optimizer, opts, memory, state, batch)
        except RuntimeError as exc:
            if not is_peer_failure(exc):
                raise
            raise _stalled(exc, state, mesh) from exc
        memory.pool.reclaim()
        tally = out.tally
        local = weighed.local_loss()
        # Scalar losses: this rank's mean, as always; pairs: the global weighted mean.
        loss = tally.loss() if tally.pairs or local is None else local
        if tally.weight == 0:  # nothing counted anywhere: the state is returned as it was
            if not memory.warned:
                memory.warned = True
                warnings.warn(
                    f"fzero: step {state.step}: the losses' weights sum to 0 over every rank "
                    "(no data, or no tokens, anywhere): no update. Reported once",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return state, loss
        buffers = None
        if threaded is not None:
            buffers = sync_buffers(threaded.buffers, buffer_sync, mesh, tally.present)
        scaler = None if state.scaler is None else state.scaler.next(found_inf=not out.applied)
        new = ShardedState(
            out.params,
            out.opt_state,
            state.step + int(out.applied),
            state.layout,
            stage,
            buffers,
            out.master,
            scaler,
            state.precision,
        )
        if donate:
            mark_consumed(state)
        return new, loss

    return step


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
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


def _stalled(exc: Exception, state: ShardedState, mesh: Mesh) -> RuntimeError:
    """A collective of the step failed: say what usually causes it."""
    return RuntimeError(
        f"rank {mesh.rank}: step {state.step}: a collective failed or timed out ({exc}). "
        "Usually a peer stopped calling step (every rank must call it the same number of "
        "times: a rank without data this step calls step(state, None)), died, or took "
        "longer than the process group's timeout"
    )
