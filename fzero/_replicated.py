"""Replicated parameters (stages 0-2): the flat buffers a tree's leaves are views of."""

from __future__ import annotations

import torch

from ._layout import ShardLayout
from ._tree import PyTree, tree_flatten


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
