"""Compiled steps' unit entries: the stage table's transposes as autograd.Functions over
traceable functional collectives (`_compiled` builds the graph from them).

Each takes a run of buckets (`bursts`) as one collective. The leaves that receive the
gradients are in the reduce dtype, and each rank divides its share by the ranks before
the collective sums it, as the eager engine and DDP do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as fc


def share(g: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """A rank's share of the mean gradient, in the reduce dtype: divided before the
    collective sums it, as the eager engine and DDP divide (an fp16 sum over the ranks
    could overflow where the mean does not)."""
    g = g.to(dtype)
    return g / rows if rows > 1 else g


class AllReduce(torch.autograd.Function):
    """Replicated buckets as they are; their gradients all-reduced to the mean over the
    `rows` ranks as one flat collective, in the dtype of the leaves they are for (the
    reduce dtype: the forward reads the buckets, in the compute dtype)."""

    @staticmethod
    def forward(group: Any, rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(f.view_as(f) for f in tensors[len(tensors) // 2 :])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        leaves = inputs[2 : 2 + (len(inputs) - 2) // 2]
        ctx.group, ctx.rows, ctx.dtype = inputs[0], inputs[1], leaves[0].dtype
        ctx.sizes = [x.numel() for x in leaves]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        flat = torch.cat([share(g, ctx.dtype, ctx.rows).reshape(-1) for g in gs])
        summed = fc.all_reduce(flat, "sum", ctx.group)
        mine = (p.view_as(g) for p, g in zip(summed.split(ctx.sizes), gs))
        return (None, None, *mine, *([None] * len(gs)))


class Scatter(torch.autograd.Function):
    """Replicated buckets as they are; their gradients reduce-scattered (summed) as one
    collective, each rank's row its shards' gradients, in the shards' dtype (the shards
    are the leaves the gradients are for; the forward reads the full buckets)."""

    @staticmethod
    def forward(group: Any, rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fulls = tensors[len(tensors) // 2 :]
        return tuple(f.view_as(f) for f in fulls)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        shards = inputs[2 : 2 + (len(inputs) - 2) // 2]
        ctx.group, ctx.rows, ctx.sizes = inputs[0], inputs[1], [s.numel() for s in shards]
        ctx.dtype = shards[0].dtype

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        # Rank r's row: its slice of every bucket, so one reduce-scatter hands each rank
        # its shards of all of them.
        table = torch.cat([share(g, ctx.dtype, ctx.rows).reshape(ctx.rows, -1) for g in gs], 1)
        mine = fc.reduce_scatter_tensor(table.reshape(-1), "sum", 0, ctx.group)
        return (None, None, *mine.split(ctx.sizes), *([None] * len(gs)))


def gathered(
    group: Any, rows: int, travel: torch.dtype, compute: torch.dtype, shards: Any
) -> tuple[torch.Tensor, ...]:
    """The shards cast to `travel`, all-gathered as one collective, each bucket cut from
    the rank-major table and cast to `compute`."""
    flat = torch.cat([s.to(travel) for s in shards]) if len(shards) > 1 else shards[0]
    table = fc.all_gather_tensor(flat.to(travel), 0, group).view(rows, -1)
    out, at = [], 0
    for s in shards:
        out.append(table[:, at : at + s.numel()].reshape(-1).to(compute))
        at += s.numel()
    return tuple(out)


class Gather(torch.autograd.Function):
    """Stage 3's entry: the shards cast to the travel dtype, all-gathered as one
    collective, each bucket cut from the rank-major table and cast to the compute dtype;
    their gradients cast to the reduce dtype and reduce-scattered back to the shards."""

    @staticmethod
    def forward(
        group: Any,
        rows: int,
        travel: torch.dtype,
        compute: torch.dtype,
        reduce: torch.dtype,
        *shards: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return gathered(group, rows, travel, compute, shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.group, ctx.rows, ctx.reduce = inputs[0], inputs[1], inputs[4]
        ctx.sizes = [s.numel() for s in inputs[5:]]

    @staticmethod
    def backward(ctx: Any, *gs: torch.Tensor) -> tuple[Any, ...]:
        table = torch.cat([share(g, ctx.reduce, ctx.rows).reshape(ctx.rows, -1) for g in gs], 1)
        mine = fc.reduce_scatter_tensor(table.reshape(-1), "sum", 0, ctx.group)
        return (None, None, None, None, None, *mine.split(ctx.sizes))
