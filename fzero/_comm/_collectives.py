"""Collectives: what each moves along which mesh axis, recorded in the ledger.

Gloo's fast paths live in `_gloo`, the objects `wait()` finishes in `_pending`, process
groups in `_groups`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._functorch import get_unwrapped, is_gradtrackingtensor

from . import _quant
from ._axis import Axis
from ._failure import check_alive
from ._gloo import _gather_by_broadcast, _is_gloo, _reduce_scatter_gloo
from ._ledger import record
from ._mesh import Mesh
from ._pending import _CastOnWait, _Dequantize, _SumArrived, _Then
from ._polled import Polled

# torch 2.13 deprecates the *_into_tensor / *_tensor names in favour of *_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# A backward that runs under torch.func.grad receives functorch-wrapped tensors, and c10d's
# in-place writes into an output buffer are refused as "mutating a captured tensor".
# Collectives are opaque to autodiff anyway (the autograd.Function around them supplies
# the derivative), so they run on the unwrapped tensors, under torch's own guard (a C++
# object, cheaper than a Python context manager on every collective).
_plain_tensors: Callable[[], Any] = getattr(torch._C, "_DisableFuncTorch", contextlib.nullcontext)


def _unwrap(tensor: torch.Tensor) -> torch.Tensor:
    while is_gradtrackingtensor(tensor):
        tensor = get_unwrapped(tensor)
    return tensor


def _over(mesh: Mesh | Axis) -> Axis:
    """The axis shards travel along: a mesh's shard axis, or the axis given."""
    return mesh if isinstance(mesh, Axis) else mesh.shard


def all_gather(
    shard: torch.Tensor,
    mesh: Mesh | Axis,
    dtype: torch.dtype | None = None,
    quant: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Concatenation of every rank's 1-D `shard` along the shard axis, in rank order (into
    `out`, else a new tensor). With `dtype`, the shards travel in that dtype (e.g.
    bfloat16, halving the bytes) and come back in `shard`'s dtype, rounded through
    `dtype` even on one rank; with `quant` (a block size) they travel as int8 blocks
    (see `all_gather_async`)."""
    out, work = all_gather_async(shard, mesh, out=out, dtype=dtype, quant=quant)
    if work is not None:
        work.wait()
    return out


def all_gather_async(
    shard: torch.Tensor,
    mesh: Mesh | Axis,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    quant: int | None = None,
    what: str | None = "all-gather",
) -> tuple[torch.Tensor, Any]:
    """Starts an all-gather of the 1-D `shard` into `out` (new if None, `shard`'s dtype;
    given in another dtype, every shard is gathered as its cast to it), along the mesh's
    shard axis (or the `Axis` given).

    Returns `(out, work)`; `out` is valid after `work.wait()` (`work` is None when there was
    nothing to wait for). Prefetching issues the next unit's gather with this while the
    current unit computes. With `dtype` the shards travel in that dtype and `wait()` casts
    the result into `out`. With `quant` (qwZ) they travel as int8 blocks of `quant`
    elements with a float32 scale each, and every rank, this one included, receives the
    dequantized values (`_quant`); inf or NaN raise a ValueError naming `what` on every
    rank at `wait()` (None: they arrive as NaN).
    """
    check_alive()
    axis = _over(mesh)
    with _plain_tensors():
        shard = _unwrap(shard).detach().contiguous()
        if out is None:
            out = shard.new_empty(shard.numel() * axis.size)
        if shard.dtype != out.dtype:
            # A shard held at higher precision than it is gathered in (stage 3's fp32
            # masters, gathered in bf16) stands for its cast: quantized or travelling in
            # `dtype`, it is cast first, as if held in `out`'s dtype. Alone (one rank, or
            # gloo's broadcasts from its slice of `out`) the copy into `out` casts.
            alone = axis.size == 1 or shard.numel() == 0 or _is_gloo(axis, shard)
            if quant is None and dtype not in (None, out.dtype):
                # Straight to the dtype it travels in: through `out`'s first would round
                # twice (float32 masters, fp16 compute, bf16 travel), unlike stages 1-2
                # gathering updated masters, or step 0's parameters (`compute_params`).
                shard = shard.to(dtype)
            elif quant is not None or not alone:
                shard = shard.to(out.dtype)
        if quant is not None and shard.is_floating_point() and shard.numel():
            codes, scales = _quant.quantize(shard, quant)
            codes_all, w1 = all_gather_async(codes.view(-1), axis)
            scales_all, w2 = all_gather_async(scales.view(-1), axis)
            works = [w for w in (w1, w2) if w is not None]
            scales_all = scales_all.view(axis.size, -1)
            return out, _Dequantize(works, codes_all, scales_all, out, quant, what)
        if dtype is not None and dtype != out.dtype:
            tmp, work = all_gather_async(shard.to(dtype), axis)
            return out, _CastOnWait(work, tmp, out)
        if axis.size == 1 or shard.numel() == 0:
            if out.data_ptr() != shard.data_ptr():  # else updated in place: nothing to do
                out.copy_(shard)  # one rank (or nothing): its shard is the whole
            return out, None
        record("all_gather", out.dtype, out.numel(), axis.name)
        if _is_gloo(axis, shard):
            return out, _gather_by_broadcast(shard, out, axis)
        return out, _all_gather_single(out, shard, group=axis.group, async_op=True)


def all_gather_many_async(
    shards: list[torch.Tensor], outs: list[torch.Tensor], mesh: Mesh | Axis, dtype: torch.dtype
) -> Any:
    """Starts one all-gather of several 1-D shards into their full buffers `outs` (each
    `outs[i]` the concatenation of every rank's `shards[i]`, cast to its dtype), all
    travelling in `dtype`; returns what to `wait()` on.

    One collective instead of one per buffer: the shards are packed end to end, gathered
    into one buffer of a row per rank, and each row's pieces copied into place on wait.
    The copies cost a pass over the buffers; a collective costs a round trip between
    every pair of ranks (on gloo, socket writes and thread wake-ups on both sides), which
    for a model's worth of small buckets costs more. This rank's own piece is not copied
    back where `outs` already holds it in `dtype` (a donated shard updated in place).
    """
    check_alive()
    axis = _over(mesh)
    with _plain_tensors():
        widths = [s.numel() for s in shards]
        own = torch.empty(sum(widths), dtype=dtype, device=shards[0].device)
        at = 0
        for s, w in zip(shards, widths):
            own[at : at + w].copy_(_unwrap(s).detach().reshape(-1))
            at += w
        rows, work = all_gather_async(own, axis)
        grid = rows.view(axis.size, -1)

        def unpack() -> None:
            at, r = 0, axis.rank
            for s, o, w in zip(shards, outs, widths):
                full, part = o.view(axis.size, w), grid[:, at : at + w]
                if o.dtype == dtype and o.narrow(0, r * w, w).data_ptr() == s.data_ptr():
                    full[:r].copy_(part[:r])  # this rank's row is in place already
                    full[r + 1 :].copy_(part[r + 1 :])
                else:  # narrower in transit: all rows come back rounded, as peers see them
                    full.copy_(part)
                at += w
            # Freed now, not whenever the backend's worker thread lets go of its work
            # (which holds them too): the next burst, or step, may need the memory.
            for staging in (own, rows):
                staging.untyped_storage().resize_(0)

        return _Then(work, unpack)


def reduce_scatter_mean(
    full: torch.Tensor, mesh: Mesh, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """This rank's slice of the mean over all ranks of the 1-D `full` (a new tensor).

    SUM then divide, rather than ReduceOp.AVG: older gloo rejects AVG, and NCCL's AVG is
    not available for every dtype. On gloo it runs as an all-to-all or as point-to-point
    messages (see `reduce_scatter_async`). With `dtype` the reduction (and the result) is
    in that dtype.
    """
    with _plain_tensors():
        out, work = reduce_scatter_async(full, mesh, dtype)
        if work is None:  # one rank, or nothing to reduce
            return out
        work.wait()
        return out.div_(mesh.size)


def reduce_scatter_async(
    full: torch.Tensor,
    mesh: Mesh,
    dtype: torch.dtype | None = None,
    owned: bool = False,
    quant: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Starts a reduce-scatter (SUM over every rank) of the 1-D `full`; returns `(out, work)`.

    `out` holds this rank's shard-axis slice of the sum over all `mesh.size` ranks after
    `work.wait()` (`work` is None when there was nothing to wait for); divide by
    `mesh.size` for the mean. On a 2-D mesh the slice is reduce-scattered inside the
    group, then all-reduced across the groups: only 1/S of `full` crosses them.
    Overlaps a unit's gradient reduction with the backward of the units before it. With
    `dtype` the reduction (and `out`) is in that dtype. `owned`: the caller gives `full`
    away (a fresh gradient), so on one rank it is returned as it is instead of copied.
    `out`: where the slice goes (a buffer of the slice's size and dtype), else a new one;
    not with `quant`. With `quant` (qgZ) both halves travel as int8 blocks
    (`_reduce_scatter_quantized`); inf or NaN arrive as NaN, as an unquantized sum carries
    them (the step checks).

    On gloo, whose own reduce-scatter is an all-reduce underneath (twice the bytes), each
    rank sends every peer that peer's slice and sums the slices it receives, in rank
    order: the reduce-scatter's volume, and `full` is never written. Up to 8 MiB that is
    one all-to-all on the shard axis's twin group, beyond it point-to-point messages.
    """
    check_alive()
    axis, across = mesh.shard, mesh.replica
    with _plain_tensors():
        full = _unwrap(full).detach().to(dtype or full.dtype).contiguous()
        if full.numel() % axis.size:
            raise ValueError(f"reduce-scatter of {full.numel()} elements over {axis.size} ranks")
        work: Any
        if full.numel() == 0:
            return full.clone(), None
        if quant is not None and axis.size > 1:
            out, work = _reduce_scatter_quantized(full, axis, quant)
        elif axis.size == 1:
            work = None
            if out is not None:
                out.copy_(full)
            else:
                out = full if owned else full.clone()
        else:
            record("reduce_scatter", full.dtype, full.numel(), axis.name)
            if out is None:
                out = full.new_empty(full.numel() // axis.size)
            if _is_gloo(axis, full):
                work = _reduce_scatter_gloo(full, out, axis)
            else:
                work = _reduce_scatter_single(
                    out, full, op=dist.ReduceOp.SUM, group=axis.group, async_op=True
                )
        if across.size == 1:
            return out, work
        if quant is not None:
            return out, _Then(work, lambda: _all_reduce_quantized(out, across, quant))
        return out, _Then(work, lambda: _all_reduce_on(out, across))


def _all_reduce_on(out: torch.Tensor, axis: Axis, control: bool = False) -> Any:
    """Starts summing `out` in place along `axis`."""
    record("all_reduce", out.dtype, 2 * out.numel(), axis.name, control=control)
    work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
    return _polled(work, axis, out)


def _polled(work: Any, axis: Axis, tensor: torch.Tensor) -> Any:
    """`work`, polling for a peer's failure while waited for where the host waits for
    it (gloo); a GPU backend's wait only orders streams, and stays as it is."""
    return Polled(work) if _is_gloo(axis, tensor) else work


def _all_to_all(rows: torch.Tensor, axis: Axis) -> tuple[torch.Tensor, Any]:
    got = torch.empty_like(rows)
    record("all_to_all", rows.dtype, rows.numel(), axis.name)
    # A reduction: on the twin group where there is one, apart from the gathers.
    group = axis.twin if axis.twin is not None and _is_gloo(axis, rows) else axis.group
    return got, _polled(dist.all_to_all_single(got, rows, group=group, async_op=True), axis, rows)


def _reduce_scatter_quantized(
    full: torch.Tensor, axis: Axis, block: int
) -> tuple[torch.Tensor, Any]:
    # qgZ: each rank's slice for rank j travels to j as int8 blocks (an all-to-all, the
    # reduce-scatter's volume in a quarter of the bytes), and j sums in float32 (float64
    # for float64 gradients: its own part exact there too).
    rows = full.view(axis.size, -1)
    codes, scales = _quant.quantize(rows, block)
    got_codes, w1 = _all_to_all(codes, axis)
    got_scales, w2 = _all_to_all(scales, axis)
    out = full.new_empty(rows.shape[1])
    own = rows[axis.rank].to(torch.promote_types(torch.float32, full.dtype))
    return out, _SumArrived([w1, w2], (got_codes, got_scales), own, out, axis, block)


def _all_reduce_quantized(out: torch.Tensor, axis: Axis, block: int) -> None:
    """Sums `out` in place along `axis` with int8 traffic: a quantized reduce-scatter,
    then a quantized all-gather whose values every rank (the owner too) takes, so the
    replicas stay identical. Synchronous; returns None (nothing left to wait for)."""
    n, r = out.numel(), axis.size
    padded = torch.nn.functional.pad(out, (0, -n % r)) if n % r else out
    part, work = _reduce_scatter_quantized(padded, axis, block)
    work.wait()
    full, work = all_gather_async(part, axis, quant=block, what=None)
    work.wait()
    out.copy_(full[:n])


def all_reduce_async(
    flat: torch.Tensor, mesh: Mesh, dtype: torch.dtype | None = None, owned: bool = False
) -> tuple[torch.Tensor, Any]:
    """Starts an all-reduce (SUM over every rank) of a copy of `flat`, in `dtype` if given;
    returns `(out, work)` like `reduce_scatter_async` (divide by `mesh.size` for the mean).

    `owned`: the caller gives `flat` away (a fresh gradient), so it is reduced in place
    instead of copied first: one gradient-sized copy less per step, as DDP's buckets.
    On a 2-D mesh it is hierarchical: reduce-scatter inside the group, all-reduce of the
    slice across the groups, all-gather inside the group (1/S of it crosses groups).
    """
    check_alive()
    with _plain_tensors():
        flat = _unwrap(flat).detach()
        contiguous = torch.contiguous_format
        if dtype is not None and dtype != flat.dtype:
            out = flat.to(dtype, memory_format=contiguous)
        else:
            out = flat.contiguous() if owned else flat.clone(memory_format=contiguous)
        if mesh.size == 1 or out.numel() == 0:
            return out, None
        if mesh.replicas == 1 or mesh.shard_size == 1:
            axis = mesh.shard if mesh.replicas == 1 else mesh.replica
            return out, _all_reduce_on(out, axis)
        # Cut along its elements, whatever its shape (a buffer's: 0-d, or a matrix).
        n, s, line = out.numel(), mesh.shard_size, out.view(-1)
        padded = torch.nn.functional.pad(line, (0, -n % s)) if n % s else line
        part, work = reduce_scatter_async(padded, mesh)  # summed across groups on wait

        def gather_back() -> None:
            work.wait()
            all_gather(part, mesh, out=padded)
            if padded is not line:
                line.copy_(padded[:n])

        return out, _Then(None, gather_back)


def all_reduce_mean(
    flat: torch.Tensor, mesh: Mesh, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Mean over all ranks of `flat` (a new tensor), reduced in `dtype` if given."""
    out, work = all_reduce_async(flat, mesh, dtype)
    if work is not None:
        work.wait()
    return out.div_(mesh.size) if mesh.size > 1 else out


def all_reduce_sum(tensor: torch.Tensor, mesh: Mesh | Axis, control: bool = False) -> torch.Tensor:
    """Sum of `tensor` over the ranks of a mesh, or along an `Axis` (a new tensor);
    `control`: a few bytes of agreement, not data (for the ledger)."""
    check_alive()
    axis = mesh if isinstance(mesh, Axis) else mesh.world
    out = tensor.detach().clone()
    if axis.size > 1 and out.numel():
        _all_reduce_on(out, axis, control).wait()
    return out


def all_reduce_sum_async(tensor: torch.Tensor, axis: Axis) -> tuple[torch.Tensor, Any]:
    """Starts summing small metadata `tensor` along `axis` in place; returns
    `(tensor, work)` (work None on one rank). Not a gradient reduction: kept apart from
    those. Host values go along `mesh.control` (a CPU tensor: no wait for the GPU)."""
    check_alive()
    if axis.size == 1:
        return tensor, None
    return tensor, _all_reduce_on(tensor, axis, control=True)


def broadcast_(tensor: torch.Tensor, mesh: Mesh, src: int = 0) -> torch.Tensor:
    """Overwrites `tensor` in place with rank `src`'s values and returns it."""
    check_alive()
    if mesh.size > 1:
        record("broadcast", tensor.dtype, tensor.numel(), "world")
        src = dist.get_global_rank(mesh.group, src) if mesh.group else src
        work = dist.broadcast(tensor, src=src, group=mesh.group, async_op=True)
        _polled(work, mesh.world, tensor).wait()
    return tensor
