"""A compiled step's gradient: the compiled loss (`_compiled.CompiledLoss`) run forward
and backward per micro-batch, with the checks every rank passes before any backward
(a refused loss, the units entered, a quantized gather's blocks), summed over the
micro-batches into this rank's part of the mean gradient."""

from __future__ import annotations

from typing import Any

import torch

from .._comm import Mesh
from .._core import LossFn, Shards, grads_of, is_bad_loss
from .._engine import Trained, explained
from .._state import ShardedState
from ._aux import Aux
from ._compiled import CompiledLoss
from ._entries import entry_inputs
from ._local import local_leaves, reduce_sums
from ._loss import BufferThread, copied, private_batch
from ._loss_weights import Weighed
from ._sync import StepSync
from ._traced_comm import check_sent
from ._traced_hooks import check_loss


def compiled_grad(
    compiled: CompiledLoss,
    loss_fn: LossFn,
    weighed: Weighed,
    micro: list[Any],
    state: ShardedState,
    local: tuple[torch.Tensor, ...] | None,
    sync: StepSync,
    mesh: Mesh,
    own: Trained = (),
) -> Any:
    """This rank's part of the mean gradient over the ranks and micro-batches, shaped as
    `mean_grad`'s (the trainable tree at stage 0, this rank's `Shards` otherwise): a
    compiled forward and its backward per micro-batch, each reducing in the graph (as
    eager `accumulate="sharded"`; with `compiled.local`, none reducing, their full sum
    reduced after the last, `_local`), their sum divided by the micro-batch count.
    `loss_fn` is `weighed` under the loss scaler's `ScaledLoss`, if any. `own`: `module=`'s
    parameters, which no gradient may reach (`grads_of`)."""
    lay, stage = state.layout, compiled.stage
    if compiled.local:  # the full buffers, their gradients summed here, reduced after
        leaves, fulls = local_leaves(compiled, state, local), []
    else:
        held, fulls = entry_inputs(compiled, state, local, mesh)
        leaves = [x.requires_grad_(not b.frozen) for x, b in zip(held, lay.buckets)]
    anchor, calls = [], []

    def run(_: Any, mb: Any, buffers: Any = None) -> Any:
        out, zero, called, finite = compiled(leaves, fulls, mb, buffers)
        anchor.append(zero)
        calls.append(list(called))
        check_sent(finite, compiled.rank)
        if compiled.hooks is not None:  # refused as a loss: every rank raises it at the check
            check_loss(out, compiled.rank)
        return out

    # The graph stands in for `loss_fn` under the step's wrappers: with buffers it takes
    # them from the `BufferThread` (which keeps each micro-batch's new ones for the next)
    # and returns `(loss, new_buffers)`; with `has_aux` its output goes to `Aux`.
    threaded = inner = weighed.loss_fn
    if not isinstance(inner, (BufferThread, Aux)):
        inner = weighed
    elif isinstance(inner.loss_fn, Aux):
        inner = inner.loss_fn
    inner.loss_fn = lambda *args: run(None, args[-1], args[1] if len(args) == 3 else None)
    trainable = [x for x, b in zip(leaves, lay.buckets) if not b.frozen]
    sums: list[torch.Tensor | None] = [None] * len(leaves)
    together = collects(compiled)
    for j, mb in enumerate(micro):
        total, error = None, None
        try:
            if mb is not None:
                total = loss_fn(None, mb)
            elif not together:  # nothing to join: zero gradients, as eagerly
                calls.append([])
            else:  # a batch again, for the graph's collectives alone; what it gives is dropped
                bufs = copied(threaded.buffers) if isinstance(threaded, BufferThread) else None
                run(None, stand_in(compiled, micro), bufs)
        except Exception as exc:  # refused after the graph's forward: every rank raises it
            if not is_bad_loss(exc):
                said = explained(exc, compiled.rank)
                if said is None:
                    raise
                raise said from exc
            error = exc
        # Waited for before the first backward: the graph's collectives cannot look for a
        # peer's failure, so a rank whose loss was refused, or that failed after its
        # forward (its loss raising after stage 3's gathers), must not leave the others
        # inside them: where the graph collects, every micro-batch's check exchanges and
        # a refusal raises there. Without collectives in the graph a middle micro-batch's
        # refusal travels with the last check (the state is untouched until then); its
        # backward joins with zero gradients. The units a loss entered are the graph's
        # collectives: where they could differ between ranks (a rank-dependent branch),
        # every rank compares them first.
        compare = bool(compiled.jit) and together  # alike on every rank
        check = sync.check(j, every=together)
        called = (calls[j] if len(calls) > j else []) if compare else None
        check.after_forward(called, mb is not None, error=error)
        check.finish()
        if mb is None and not together:
            continue
        out = total if total is not None and total.requires_grad else anchor[-1]
        got = iter(grads_of(out, trainable, own, compiled.rank) if trainable else ())
        for i, (x, b) in enumerate(zip(leaves, lay.buckets)):
            if b.frozen:
                continue
            g = next(got)
            g = torch.zeros_like(x) if g is None else g
            acc = sums[i]
            if compiled.local:  # summed in the dtype the reduction will run in, owned
                g = g.to(compiled.reduce[i], copy=acc is None)
            sums[i] = g if acc is None else acc.add_(g)  # owned: the first backward's
    n = len(micro)
    for i, (x, b) in enumerate(zip(leaves, lay.buckets)):  # no micro-batch reached it: zeros
        if sums[i] is None and not b.frozen:
            sums[i] = torch.zeros_like(x, dtype=compiled.reduce[i] if compiled.local else None)
    if compiled.local:
        return reduce_sums(compiled, sums, leaves, state, mesh, n)
    grads = [
        x.new_empty(0) if b.frozen else (g.div_(n) if n > 1 else g)
        for x, b, g in zip(leaves, lay.buckets, sums)
    ]
    if stage.shards_optimizer:
        return Shards(tuple(grads), lay, mesh.shard_rank)
    full = [f if b.frozen else g for f, g, b in zip(fulls, grads, lay.buckets)]
    return lay.trainable(lay.unflatten(full))


def collects(compiled: CompiledLoss) -> bool:
    """Whether the step's graph runs collectives, which every rank must join (and whose
    units, entered in order, pair up): not with local accumulation (reduced after the
    graphs) nor on one rank."""
    return not compiled.local and compiled.size > 1


def stands_in(compiled: CompiledLoss, micro: list[Any]) -> bool:
    """Whether this rank can join the graphs of the micro-batches it has no data for:
    where they collect, it needs a batch of its own to run again (`stand_in`)."""
    if not collects(compiled):
        return True
    return compiled.last is not None or any(mb is not None for mb in micro)


def stand_in(compiled: CompiledLoss, micro: list[Any]) -> Any:
    """The batch a rank without data runs through the graph in a micro-batch's place: its
    last (`CompiledLoss.last`), else a private copy of one of this step's own (its loss,
    which may pop from its containers or scale its tensors in place, has yet to run on
    it). Its loss is not counted and its
    gradients are zero (the anchor's); only the collectives matter, which depend on the
    parameters, not on the batch."""
    if compiled.last is not None:
        return compiled.last
    return private_batch(next(mb for mb in micro if mb is not None))
