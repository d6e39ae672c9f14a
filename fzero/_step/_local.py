"""Local accumulation compiled (DDP's `no_sync`): each micro-batch's graph takes the
gradient of the full buffers without a collective, the micro-batches' full gradients
are summed, and the sum is reduced once, after the last, as the stage reduces it.

The graph is the compiled loss's with every unit entering as its full buffer (no entry
function, so no collective in the forward or the backward); the reduction after it runs
the entries' own collectives (`_entries.all_reduced`, `scattered`) eagerly, in bursts.
Stage 3 has no full buffers to hand: the shards are all-gathered once for the step, here,
and every micro-batch reads them (one gather a step where eager "local" gathers each
unit for each micro-batch, at the price of the whole model's parameters held through the
step beside its full gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as fc

from .. import _comm
from .._comm import Mesh
from .._core import Shards
from .._state import ShardedState, params_apart, update_dtypes
from ._bursts import bursts
from ._entries import all_reduced, computing, gathered, scattered
from ._traced_comm import check_sent, sent_finite


def local_leaves(
    compiled: Any, state: ShardedState, local: tuple[torch.Tensor, ...] | None
) -> list[torch.Tensor]:
    """The graph's inputs: each bucket's full buffer, detached, requiring a gradient
    where trainable (the replicas at stages 0-2; stage 3's shards gathered here, a
    host-held one copied to its compute device first, a qwZ gather's blocks checked for
    inf or NaN as the eager gather checks them)."""
    lay = state.layout
    if compiled.stage.shards_params:
        a, fulls = compiled.axes, [torch.empty(0)] * len(lay.buckets)
        apart = params_apart(state)
        sent: list[tuple[tuple[str, ...], torch.Tensor]] = []  # qwZ: per gather, finite?
        with torch.no_grad():
            for run in bursts(lay, compiled.burst_bytes, compiled.reduce):
                shards = [computing(state.params.buffers[i], apart) for i in run]
                dtype = lay.buckets[run[0]].dtype
                out = gathered(a, compiled.travel[run[0]], dtype, shards)
                sent_finite(sent, a, lay, run, out)
                for i, x in zip(run, out):
                    fulls[i] = plain(x)
        check_sent(sent, compiled.rank)  # the same blocks everywhere: every rank raises
    else:
        assert local is not None
        fulls = list(local)
    return [x.detach().requires_grad_(not b.frozen) for x, b in zip(fulls, lay.buckets)]


def reduce_sums(
    compiled: Any,
    sums: list[torch.Tensor | None],
    leaves: list[torch.Tensor],
    state: ShardedState,
    mesh: Mesh,
    n: int,
) -> Any:
    """The step's gradient from the micro-batches' summed full gradients `sums` (in the
    reduce dtype; None for frozen buckets), reduced once, in bursts, and divided by the
    `n` micro-batches: shaped as `compiled_grad`'s (`leaves`: the graph's inputs)."""
    lay, stage, a = state.layout, compiled.stage, compiled.axes
    grads = [x.new_empty(0) for x in leaves]  # frozen buckets' placeholders
    means = update_dtypes(state)
    # A functional collective's wait cannot look for a peer's failure, and a rank may
    # have failed after the last check (in its last backward): the polled barrier sees it.
    if mesh.size > 1:
        _comm.barrier(mesh)
    for run in bursts(lay, compiled.burst_bytes, compiled.reduce):
        if lay.buckets[run[0]].frozen:
            continue
        gs = [sums[i] for i in run]  # every trainable bucket's (zeros where unused)
        dtype = compiled.reduce[run[0]]
        if stage.shards_optimizer:
            reduced = scattered(gs, dtype, a, [lay.buckets[i].shard_numel for i in run])
        else:
            reduced = all_reduced(gs, dtype, a)
        for i, g in zip(run, reduced):
            g = plain(g)
            if n > 1:  # the mean in the dtype the optimizer updates, as eagerly
                g = (g if means[i] is None else g.to(means[i])) / n
            grads[i] = g
    if stage.shards_optimizer:
        return Shards(tuple(grads), lay, mesh.shard_rank)
    full = [x.detach() if b.frozen else g for x, g, b in zip(leaves, grads, lay.buckets)]
    return lay.trainable(lay.unflatten(full))


def plain(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, run eagerly, as a plain tensor: it may come back
    as an `AsyncCollectiveTensor` (views of one stay one), a subclass that a compiled
    graph took as an input without a gradient (the loss came out not requiring grad)."""
    return fc.wait_tensor(x)
