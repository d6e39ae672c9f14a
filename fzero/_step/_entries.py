"""Compiled steps' unit entries: the stage table's transposes as autograd.Functions over
traceable functional collectives (`_compiled` builds the graph from them).

Each takes a run of buckets (`_bursts.bursts`) as one collective. The leaves that receive the
gradients are in the reduce dtype, and each rank divides its share by the ranks before
the collective sums it, as the eager engine and DDP do. On a 2-D mesh the shard axis
gathers and reduce-scatters, and a reduced shard is then summed across the replicas
(`Axes.across`), as the eager engine's hybrid sharding sums it. On gloo a burst's
reduce-scatter runs as an all-to-all, as the eager engine's does (`_traced_comm`).
Stage 3's entry of a resharded unit is checkpointed (`entered_gather`); with hpZ its
gather is cut in two so that the recompute is the in-group half (`Regather`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .._comm import Mesh
from .._core import ShardLayout
from .._engine import own_slices, stand_in
from .._state import Precision, ShardedState, params_apart
from ._traced_comm import (
    Axes,
    Hpz,
    all_reduce_sum,
    gather_rows,
    group_gather,
    peer_gather,
    reduce_rows,
)


def share(g: torch.Tensor, dtype: torch.dtype, ranks: int) -> torch.Tensor:
    """A rank's share of the mean gradient, in the reduce dtype: divided before the
    collective sums it, as the eager engine and DDP divide (an fp16 sum over the ranks
    could overflow where the mean does not)."""
    g = g.to(dtype)
    return g / ranks if ranks > 1 else g


def scattered_flat(gs: Sequence[torch.Tensor], dtype: torch.dtype, axes: Axes) -> torch.Tensor:
    """This rank's shards of the mean of the full gradients `gs` over every rank, in
    `dtype`, side by side in one 1-D tensor: one reduce-scatter along the shard axis, of
    a table whose row r is rank r's slice of every bucket, then a sum across the replicas."""
    table = torch.cat([share(g, dtype, axes.ranks).reshape(axes.rows, -1) for g in gs], 1)
    return reduce_rows(table, axes)


def scattered(
    gs: Sequence[torch.Tensor], dtype: torch.dtype, axes: Axes, sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """`scattered_flat`, cut into the shards (of `sizes` elements)."""
    return scattered_flat(gs, dtype, axes).split(sizes)


def all_reduced_flat(gs: Sequence[torch.Tensor], dtype: torch.dtype, axes: Axes) -> torch.Tensor:
    """The mean of the full gradients `gs` over the ranks, in `dtype`, side by side in one
    1-D tensor: one all-reduce of them."""
    return all_reduce_sum(torch.cat([share(g, dtype, axes.ranks).reshape(-1) for g in gs]), axes)


def all_reduced(
    gs: Sequence[torch.Tensor], dtype: torch.dtype, axes: Axes
) -> tuple[torch.Tensor, ...]:
    """`all_reduced_flat`, each gradient's mean in its shape."""
    summed = all_reduced_flat(gs, dtype, axes)
    return tuple(p.view_as(g) for p, g in zip(summed.split([g.numel() for g in gs]), gs))


def joined(shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """A run's gradient receivers (its shards, or stages 0-2's stand-ins) as the one 1-D
    tensor an entry's autograd.Function takes, whose gradient it returns whole and whose
    `cat` splits it back to them. Dynamo traces a Function's output check in Python as
    outputs × tensor arguments: with a tensor argument per bucket, a run of 100 buckets
    took 30 s of a 50 s trace (torch/_functorch/autograd_function.py's `is_tensor_arg`)."""
    if len(shards) == 1:
        return shards[0].reshape(-1)
    return torch.cat([s.reshape(-1) for s in shards])


def joined_receivers(stand_ins: Sequence[torch.Tensor]) -> torch.Tensor:
    """`joined` for an entry that reads only the joint's dtype (stages 0-2's). Run as
    Python (`set_stance("force_eager")`, or a frame dynamo skips) the stand-ins are joined
    storage-free, where `cat` would write a run's worth of zeros (a graph drops that copy;
    and a Function of a tensor per bucket is what `joined` keeps out of dynamo's trace)."""
    if len(stand_ins) == 1 or torch.compiler.is_compiling():
        return joined(stand_ins)
    return _JoinedStandIns.apply(*stand_ins)


class _JoinedStandIns(torch.autograd.Function):
    """Stand-ins joined as one expanded zero (their values are never read); the joint's
    gradient split back to them, as `cat`'s backward splits it."""

    @staticmethod
    def forward(*stand_ins: torch.Tensor) -> torch.Tensor:
        total = sum(s.numel() for s in stand_ins)
        dtype = functools.reduce(torch.promote_types, (s.dtype for s in stand_ins))
        return stand_in(torch.Size([total]), dtype, stand_ins[0].device)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.shapes, ctx.dtypes = [s.shape for s in inputs], [s.dtype for s in inputs]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = g.split([s.numel() for s in ctx.shapes])
        return tuple(p.reshape(s).to(d) for p, s, d in zip(parts, ctx.shapes, ctx.dtypes))


class AllReduce(torch.autograd.Function):
    """Replicated buckets as they are (`fulls`, a list: what the forward reads); their
    gradients all-reduced to the mean over the `rows` ranks as one flat collective, in
    the dtype of the leaves they are for (the reduce dtype), returned as the gradient of
    those leaves `joined`."""

    @staticmethod
    def forward(axes: Axes, fulls: list[torch.Tensor], joint: torch.Tensor) -> tuple:
        return tuple(f.view_as(f) for f in fulls)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.axes, ctx.dtype = inputs[0], inputs[2].dtype

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        return None, None, all_reduced_flat(gs, ctx.dtype, ctx.axes)


class Scatter(torch.autograd.Function):
    """Replicated buckets as they are (`fulls`, a list: what the forward reads); their
    gradients reduce-scattered (summed) as one collective, each rank's row its shards'
    gradients, in the shards' dtype, returned as the gradient of the shards `joined`."""

    @staticmethod
    def forward(axes: Axes, fulls: list[torch.Tensor], joint: torch.Tensor) -> tuple:
        return tuple(f.view_as(f) for f in fulls)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.axes, ctx.dtype = inputs[0], inputs[2].dtype

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        return None, None, scattered_flat(gs, ctx.dtype, ctx.axes)


def gathered(
    axes: Axes, travel: torch.dtype, compute: torch.dtype, shards: Any
) -> tuple[torch.Tensor, ...]:
    """The shards cast to `travel`, all-gathered along the shard axis as one collective
    (qwZ: as int8 blocks of the burst, `gather_rows`), each bucket cut from the rank-major
    table and cast to `compute`."""
    travel = travelling(axes, travel, compute)
    flat = torch.cat([s.to(travel) for s in shards]) if len(shards) > 1 else shards[0]
    return gathered_joint(axes, travel, compute, flat, [s.numel() for s in shards])


def gathered_joint(
    axes: Axes, travel: torch.dtype, compute: torch.dtype, joint: torch.Tensor, sizes: Any
) -> tuple[torch.Tensor, ...]:
    """`gathered` of the shards `joined` (of `sizes` elements each)."""
    table = gather_rows(joint.to(travelling(axes, travel, compute)), axes)
    return columns(table, sizes, compute)


def travelling(axes: Axes, travel: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype shards are gathered in: `travel`; quantized (qwZ), their cast to the
    compute dtype, as the eager gather quantizes it (the blocks are then int8)."""
    return compute if axes.qw is not None else travel


def columns(table: torch.Tensor, sizes: list[int], compute: torch.dtype) -> tuple:
    """Each bucket's full buffer from a gathered `table` whose last dimension holds every
    bucket's shard side by side (`sizes` elements each) and whose other dimensions run
    over the ranks in rank order: its columns, read in that order, cast to `compute`."""
    out, at = [], 0
    for n in sizes:
        out.append(table[..., at : at + n].reshape(-1).to(compute))
        at += n
    return tuple(out)


class Gather(torch.autograd.Function):
    """Stage 3's entry: the shards (`joined`, of `sizes` elements each) cast to the travel
    dtype, all-gathered as one collective, each bucket cut from the rank-major table and
    cast to the compute dtype; their gradients cast to the reduce dtype and
    reduce-scattered back to the shards."""

    @staticmethod
    def forward(
        axes: Axes,
        travel: torch.dtype,
        compute: torch.dtype,
        reduce: torch.dtype,
        sizes: tuple[int, ...],
        joint: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return gathered_joint(axes, travel, compute, joint, sizes)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.axes, ctx.reduce = inputs[0], inputs[3]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        return (None,) * 5 + (scattered_flat(gs, ctx.reduce, ctx.axes),)


def peer_rows(
    hpz: Hpz, travel: torch.dtype, compute: torch.dtype, shards: Any
) -> tuple[torch.Tensor, ...]:
    """hpZ's first gather, outside the graph's autograd (`peer_gather`): the shards, cast
    to `travel` (qwZ: to `compute`, then int8 blocks, as `gathered`'s), of the ranks at
    this rank's place in every group of k; what the backward keeps of a unit (1/k of
    it) to gather it again inside the group (`Regather`)."""
    travel = travelling(hpz.peers, travel, compute)
    flat = torch.cat([s.detach().to(travel) for s in shards])  # a fresh, detached copy
    return peer_gather(flat, hpz)


def regathered(
    hpz: Hpz, compute: torch.dtype, kept: Sequence[torch.Tensor], sizes: list[int]
) -> tuple[torch.Tensor, ...]:
    """hpZ's second gather (`group_gather`) of `peer_rows`' rows, each bucket (of
    `sizes` elements a rank) cut from it in the compute dtype."""
    got = group_gather(tuple(kept), hpz, compute)
    # `got[m, h]` is the shard axis's rank h * k + m: taken group-major, in rank order.
    return columns(got.transpose(0, 1), sizes, compute)


class Regather(torch.autograd.Function):
    """hpZ's stage-3 entry of a resharded unit, checkpointed: the full buckets gathered
    from `peer_rows`' rows (`kept`) inside the group of k and cast to the compute dtype
    (the forward's gather and, recomputed, the backward's, never crossing groups; qwZ's
    blocks travel as int8 both times); their gradients reduce-scattered to the shards
    (`joined`, of `sizes` elements each) over the whole shard axis as `Gather`'s are (the
    shards are an input for that alone: the forward reads only the rows)."""

    @staticmethod
    def forward(
        hpz: Hpz,
        axes: Axes,
        compute: torch.dtype,
        reduce: torch.dtype,
        sizes: tuple[int, ...],
        joint: torch.Tensor,
        *kept: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return regathered(hpz, compute, kept, list(sizes))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.axes, ctx.reduce, ctx.kept = inputs[1], inputs[3], inputs[0].kept

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        joint = scattered_flat(gs, ctx.reduce, ctx.axes)
        return (None,) * 5 + (joint,) + (None,) * ctx.kept


def bare_gather(
    axes: Axes,
    hpz: Hpz | None,
    travel: torch.dtype,
    compute: torch.dtype,
    shards: list[torch.Tensor],
    recompute: bool,
) -> tuple[torch.Tensor, ...]:
    """Stage 3's gather of a run with no gradient of its own (frozen, or under no_grad):
    `gathered`. Resharded under autograd, checkpointed: an earlier unit's backward
    through this one needs its parameters, gathered again for it as eagerly rather than
    kept from the forward (a frozen base model's, LoRA's); with hpZ from the rows of the
    first of its two gathers, inside the group."""
    if not (recompute and torch.is_grad_enabled()):
        return gathered(axes, travel, compute, shards)
    if hpz is None:
        again = functools.partial(gathered, axes, travel, compute)
        return checkpoint(lambda *s: again(s), *shards, use_reentrant=False)
    kept = peer_rows(hpz, travel, compute, shards)
    sizes = [s.numel() for s in shards]
    return checkpoint(lambda *k: regathered(hpz, compute, k, sizes), *kept, use_reentrant=False)


def entered_gather(
    axes: Axes,
    hpz: Hpz | None,
    travel: torch.dtype,
    compute: torch.dtype,
    reduce: torch.dtype,
    shards: list[torch.Tensor],
    recompute: bool,
) -> tuple[torch.Tensor, ...]:
    """Stage 3's entry of a run of buckets (`shards`): `Gather`; where resharded
    (`recompute`), checkpointed, so that the compiler gathers it again for the backward
    rather than keep the full buffers from the forward; with hpZ, `peer_rows` (kept:
    1/k of the unit) then a checkpointed `Regather` inside the group of k."""
    sizes = tuple(s.numel() for s in shards)
    if not recompute:
        return Gather.apply(axes, travel, compute, reduce, sizes, joined(shards))
    if hpz is None:

        def enter(*s: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return Gather.apply(axes, travel, compute, reduce, sizes, joined(s))

        return checkpoint(enter, *shards, use_reentrant=False)
    kept = peer_rows(hpz, travel, compute, shards)

    def regather(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        joint = joined(t[hpz.kept :])
        return Regather.apply(hpz, axes, compute, reduce, sizes, joint, *t[: hpz.kept])

    return checkpoint(regather, *kept, *shards, use_reentrant=False)


def comm_dtypes(
    precision: Precision | None, layout: ShardLayout
) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """Per bucket, the dtypes parameters travel in and gradients are reduced in (the
    compute dtype where `precision` names none), as the eager engine's."""
    gather = precision.gather_dtype if precision is not None else None
    reduce = precision.reduce_dtype if precision is not None else None
    return [gather or b.dtype for b in layout.buckets], [reduce or b.dtype for b in layout.buckets]


def entry_inputs(
    compiled: Any,
    state: ShardedState,
    local: tuple[torch.Tensor, ...] | None,
    mesh: Mesh,
) -> tuple[list[torch.Tensor], list[Any]]:
    """A `CompiledLoss`'s `(leaves, fulls)` for `state`, detached: at stage 3 the shards
    (at least in the reduce dtype);
    at stages 0-2 the replicas `local` as what the forward reads, and as leaves fresh
    zero-stride tensors in the reduce dtype, storage-free, that only receive the
    gradients (not views of the buffers, so the graph's inputs do not alias)."""
    if compiled.stage.shards_params:
        # A shard narrower than the reduce dtype (an offloaded state's device copy, in the
        # parameter dtype, its master on the host) is upcast, exactly: a leaf of its own
        # dtype would have autograd cast the reduced gradient down to it. A host-held
        # shard (`Offload(params=True)`) is copied to the device the graph computes on,
        # every shard at the step's start (eagerly each unit's just before its gather):
        # the device holds the shards for the step, and none of them between steps.
        apart = params_apart(state)
        return [
            computing(x, apart).detach().to(torch.promote_types(x.dtype, r))
            for x, r in zip(state.params.buffers, compiled.reduce)
        ], []
    assert local is not None
    lay = state.layout
    mine = own_slices(local, lay, mesh.shard_rank) if compiled.stage.shards_optimizer else local
    held = [stand_in(x.shape, d, x.device) for x, d in zip(mine, compiled.reduce)]
    return held, [x.detach() for x in local]


def computing(shard: torch.Tensor, apart: torch.device | None) -> torch.Tensor:
    """A stage-3 shard where the graph computes with it: a host-held one
    (`Offload(params=True)`, `apart` its compute device) copied there, asynchronously
    from pinned memory, as the eager gather copies it."""
    if apart is None or shard.device == apart:
        return shard
    return shard.to(apart, non_blocking=shard.is_pinned())
