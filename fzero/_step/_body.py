"""One step's body, read as the stage table (`fzero._core._stages`), column by column.

    enter and differentiate -> weigh -> update this rank's part -> after the update

A unit's parameters enter the loss as the stage enters them (`Stage.enter`: the rank's
replica, or the all-gather of every rank's shard) and its gradient leaves through the
transpose (`Stage.reduce`); the ranks agree on what each loss counts for; the optimizer
updates what this rank owns (`Stage.optimizer`); and what follows the update follows
(`Stage.after`: nothing, or the all-gather of the updated shards). `sharded_step` wraps
it: loss wrappers, the loss scaler's next state, buffers, donation.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, NamedTuple

from .._core import LossFn, PyTree, Shards, Stage
from .._engine import Context, full_buckets, local_shard, own_slices
from .._state import ShardedState, compute_device
from ..optim import Optimizer
from ..optim._fused import compiled_updates
from ._compiled import CompiledLoss
from ._compiled_grad import compiled_grad
from ._gradient import mean_grad
from ._loss_weights import Weighed
from ._options import StepOptions
from ._overlap import overlapping
from ._sync import StepSync, Tally
from ._update import after_update, apply_update, check_finite, streamer


class Out(NamedTuple):
    """What a step's body gives back: the new values, whether they changed, the step's
    sums over the ranks, and the just-in-time units it called (for the next step)."""

    params: PyTree
    opt_state: Any
    master: Any
    applied: bool  # False: the loss scaler found an inf, or the weights summed to 0
    tally: Tally
    order: list[str] | None
    looked: bool | None = None  # an offloaded update asked for the global norm (None: none ran)


def body(
    loss_fn: LossFn,
    weighed: Weighed,
    optimizer: Optimizer,
    o: StepOptions,
    ctx: Context,
    state: ShardedState,
    micro: list[Any],
    order: list[str] | None,
    overlap: ThreadPoolExecutor | None = None,
    compiled: CompiledLoss | None = None,
    used: set[int] | None = None,
) -> Out:
    """One step of `o.stage` on `micro` (this rank's micro-batches); `weighed` is the
    loss under its wrappers (`loss_fn`), keeping what each call counts for; `order` the
    just-in-time units last step called (None: no step yet). `overlap`: the host thread
    on which an offloaded state steps its host buckets during the backward (`_overlap`;
    None: not this step, where something needs the whole gradient first). `compiled`:
    the forward and backward as one compiled graph (`_compiled`), run for each
    micro-batch. `used`: if given, the leaves a gradient reached here are added to it
    (eager steps only)."""
    stage, mesh = o.stage, o.mesh
    local = None if stage.shards_params else full_buckets(state.params, state.layout)
    target = _own_part(stage, state, local, o)
    present = any(mb is not None for mb in micro)
    device = compute_device(state)
    sync = StepSync(mesh, weighed, present, device, len(micro), o.accumulate is not None)

    # An offloaded state is updated unit by unit (`streamed`), its host units on a host
    # thread during the backward (`early`) where nothing needs the whole gradient first.
    streamed = streamer(optimizer, state, target, mesh, o.donate)
    with overlapping(streamed, sync.early_factor, overlap, state, device, mesh.rank) as early:
        # Enter and differentiate: the gradient leaves each unit reduced as the stage reduces.
        if compiled is not None:
            grads = compiled_grad(
                compiled, loss_fn, weighed, micro, state, local, sync, mesh, ctx.own
            )
        else:
            grads, order = mean_grad(
                loss_fn, micro, ctx, state, target, local, sync, o.accumulate, order, early, used
            )

        # Weigh: what every rank's losses count for, agreed behind the backward.
        tally = sync.tally()
        if o.quantize is not None and o.quantize.grads and state.scaler is None:
            check_finite(grads, mesh, state.step)
        factor = tally.factor(mesh.size, len(micro))
        if factor is None:  # no weight anywhere: nothing to update by
            return Out(state.params, state.opt_state, state.master, False, tally, order)

        # Update this rank's part: the optimizer on what the stage has it own (an offloaded
        # state's buckets stepped during the backward, done first).
        if early is not None:
            early.join()
        # Compiled, fzero's optimizers run fused kernels (`fused=None`: the step's backend).
        fusing = nullcontext() if compiled is None else compiled_updates(o.compile)
        with fusing:
            new, opt_state, applied, held = apply_update(
                optimizer,
                state,
                target,
                grads,
                mesh,
                o.donate,
                factor=factor,
                streamed=streamed,
                taken=None if early is None else early.taken,
            )
        master = None if state.master is None else new
        looked = streamed.looked if streamed is not None and streamed.ran else None
        if not applied:  # the loss scaler skipped the step everywhere: nothing to gather
            return Out(state.params, opt_state, master, False, tally, order, looked)
        del grads  # used: what follows has the memory they held

        # After the update: the updated shards (`held`: as on the device, where the state is
        # offloaded) all-gathered where the stage replicates.
        params = after_update(stage, held, local, state, mesh, o.donate, o.reduce_bucket_bytes)
        return Out(params, opt_state, master, True, tally, order, looked)


def _own_part(stage: Stage, state: ShardedState, local: Any, o: StepOptions) -> Any:
    """What this rank's optimizer updates: the masters if there are any; else the
    parameters (all of the trainable tree, or this rank's shard of it). Stages 1-2,
    donating, update the rank's slice of the replicated buffers where it lies, so the
    gather after the update only fills the peers' slices; not donating, a copy of it."""
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
