"""Replicated parameters (stages 0-2): the flat buffers a tree's leaves are views of, and
`Replica`, how a unit enters a step from them (`_gathers.Gathers` is stage 3's)."""

from __future__ import annotations

import torch

from .._core import PyTree, ShardLayout, tree_flatten
from ._entry import Call


def full_buckets(params: PyTree, layout: ShardLayout) -> tuple[torch.Tensor, ...]:
    """The flat buffers a replicated tree's leaves are views of (packed afresh if not)."""
    leaves = tree_flatten(params)[0]
    out = []
    for bucket in layout.buckets:
        base = leaves[bucket.slots[0].index]._base if bucket.slots else None
        if base is None or base.numel() != bucket.full_numel or base.dtype != bucket.dtype:
            return layout.flatten(params)
        out.append(base)
    return tuple(out)


def own_slices(
    full: tuple[torch.Tensor, ...], layout: ShardLayout, rank: int
) -> tuple[torch.Tensor, ...]:
    """Views of `rank`'s slice of each full flat bucket."""
    return tuple(
        f.narrow(0, rank * b.shard_numel, b.shard_numel) for f, b in zip(full, layout.buckets)
    )


class Replica:
    """Stages 0-2: a unit enters as this rank's replica (identity)."""

    def __init__(self, local: tuple[torch.Tensor, ...]) -> None:
        self.local = local

    def open(self, call: Call, jit: bool) -> tuple[torch.Tensor, ...]:
        return tuple(self.local[i].detach() for i in call.buckets)

    def again(self, call: Call) -> tuple[torch.Tensor, ...]:
        return self.open(call, False)

    def prefetch_after(self, unit: str) -> None:
        pass

    def prefetch_first(self, upfront: list[str]) -> None:
        pass

    def drop(self, call: Call) -> None:
        pass

    def regather_rest(self) -> None:
        pass

    def release(self, call: Call) -> None:
        pass

    def settle(self) -> None:
        pass

    def end_forward(self, calls: list[Call]) -> None:
        pass

    def flags(self) -> list[bool]:
        return []
