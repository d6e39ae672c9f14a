"""Gloo's collectives the fast way: an all-gather as one broadcast per rank, a reduce-scatter
as one all-to-all (up to a unit's size) or as point-to-point messages (larger); gloo's own
reduce-scatter is an all-reduce underneath."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._axis import Axis
from ._groups import backend_for
from ._pending import _CastOnWait, _SumOnWait, _SumRows, _Works
from ._polled import Polled


def _gather_by_broadcast(shard: torch.Tensor, out: torch.Tensor, axis: Axis) -> _Works:
    # Gloo's all-gather stages the input through a full-size buffer and two copies; one
    # broadcast per rank straight into its slice of `out` moves the same bytes with
    # neither ([Note: gloo's paths]). Every rank issues the broadcasts in rank order.
    n = shard.numel()
    own = out.narrow(0, axis.rank * n, n)
    if own.data_ptr() != shard.data_ptr():  # the caller may have updated it in place
        own.copy_(shard)
    works = []
    for r in range(axis.size):
        part = out.narrow(0, r * n, n)
        works.append(
            Polled(dist.broadcast(part, src=axis.global_rank(r), group=axis.group, async_op=True))
        )
    return _Works(works)


# Tags for the point-to-point messages of reduce-scatters in flight, per process group:
# every rank issues the same reductions in the same order, so counters agree across
# ranks. Far from 0 so that a user's own send/recv (tag 0 by default) cannot match them.
_TAG_BASE, _TAG_SPAN = 0x3F00_0000, 1 << 24
_tags: dict[Any, int] = {}


# Reductions of at most this many bytes run as one all-to-all, larger ones as point-to-point
# messages; both move the reduce-scatter's volume ([Note: gloo's paths]). The bound also
# caps the all-to-all's extra buffer (the whole buffer, received) per reduction in flight.
ALL_TO_ALL_MAX_BYTES = 8 << 20


def _reduce_scatter_gloo(full: torch.Tensor, out: torch.Tensor, axis: Axis) -> Any:
    # Gloo's reduce-scatter is an all-reduce underneath, twice the bytes. Sending slice j
    # straight to rank j and summing what arrives moves (n-1)/n of the buffer per rank,
    # the reduce-scatter's volume ([Note: gloo's paths]).
    # `full` is only read, so the caller's buffer needs no copy whether owned or not.
    if full.device.type != "cpu":
        # Gloo's broadcasts and all-reduces take CUDA tensors, its send/recv only host
        # memory: a device buffer (simulated ranks sharing a GPU) goes through the host.
        host = torch.empty(out.shape, dtype=out.dtype, device="cpu")
        return _CastOnWait(_reduce_scatter_gloo(full.cpu(), host, axis), host, out)
    if axis.twin is not None and full.numel() * full.element_size() <= ALL_TO_ALL_MAX_BYTES:
        # On the twin group: a collective on the shard group itself would pair with a
        # peer's re-gather started in its place (see `Axis.twin`).
        got = torch.empty_like(full)
        work = Polled(dist.all_to_all_single(got, full, group=axis.twin, async_op=True))
        return _SumRows(work, got.view(axis.size, -1), out)
    return _reduce_scatter_p2p(full, out, axis)


def _reduce_scatter_p2p(full: torch.Tensor, out: torch.Tensor, axis: Axis) -> Any:
    # Slice j sent straight to rank j: 2(n-1) messages, paired by tag. Their waits do not
    # poll for a peer's failure (`Polled`): a timed wait on a gloo send or receive breaks
    # the whole group when it runs out. The lowest peer's
    # slice lands in `out` itself, so at 2 ranks nothing else is allocated.
    key = id(axis.group) if axis.group is not None else None
    tag = _TAG_BASE + _tags.get(key, 0)
    _tags[key] = (_tags.get(key, 0) + 1) % _TAG_SPAN
    n = full.numel() // axis.size
    first = 1 if axis.rank == 0 else 0
    works, parts = [], []
    for r in range(axis.size):
        mine = full.narrow(0, r * n, n)
        if r == axis.rank:
            parts.append(mine)
            continue
        peer = axis.global_rank(r)
        works.append(dist.isend(mine, dst=peer, group=axis.group, tag=tag))
        got = out if r == first else full.new_empty(n)
        works.append(dist.irecv(got, src=peer, group=axis.group, tag=tag))
        if r != first:
            parts.append(got)
    return _SumOnWait(works, parts, out)


def _is_gloo(axis: Axis, tensor: torch.Tensor) -> bool:
    """Whether `axis`'s group moves `tensor`'s device on gloo (so its fast paths apply):
    what the group runs for that device, not its name ("cpu:gloo,cuda:nccl" is gloo for
    CPU tensors and NCCL for CUDA ones)."""
    return backend_for(axis.group, tensor.device) == "gloo"
