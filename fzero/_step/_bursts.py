"""Bursts: how a compiled step's buckets share collectives (runs of consecutive buckets
up to a byte cap, one entry each) and how each bucket's full buffer is cut into its leaves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._core import Bucket, ShardLayout


def cuts(bucket: Bucket) -> tuple[tuple[int, ...], tuple[tuple[int, int, tuple[int, ...]], ...]]:
    """How a bucket's full buffer splits into its leaves (`CompiledLoss._cut`), as the
    eager engine's `cut` splits it (one row, `Bucket.rows`): the sizes of one `split`
    (padding and gaps pieces of their own), and per leaf `(tree index, its piece, its
    shape)`. Worked out before the trace: dynamo cannot trace the bucket's cached
    properties on their first use."""
    rows = bucket.rows(bucket.full_numel, bucket.full_numel)
    if not rows:
        return (), ()
    slots = bucket.ordered
    where = tuple(
        (slots[k].index, j, slots[k].shape) for j, (k, _, _) in enumerate(rows[0].owners) if k >= 0
    )
    return rows[0].sizes, where


def bursts(
    layout: ShardLayout,
    cap: int,
    reduce: list[torch.dtype] | None = None,
    among: Sequence[int] | None = None,
) -> list[list[int]]:
    """The buckets (those of `among`, in order; None: all) in runs of consecutive
    trainable buckets of one dtype, each up to `cap` bytes in full in its reduce dtype
    (`reduce`, per bucket; None: its own), one collective each, as the eager step's
    bursts (0: a bucket each); a frozen bucket is a run of its own."""
    runs: list[list[int]] = []
    size = 0
    for i in range(len(layout.buckets)) if among is None else among:
        b = layout.buckets[i]
        nbytes = b.full_numel * (reduce[i] if reduce is not None else b.dtype).itemsize
        head = layout.buckets[runs[-1][0]] if runs else None
        joins = (
            head is not None
            and not (b.frozen or head.frozen)
            and head.dtype == b.dtype
            and size + nbytes <= cap
        )
        if joins:
            runs[-1].append(i)
            size += nbytes
        else:
            runs.append([i])
            size = nbytes
    return runs


def jit_bursts(
    layout: ShardLayout, units: Sequence[str], cap: int, reduce: list[torch.dtype]
) -> list[tuple[str, ...]]:
    """Just-in-time `units` (in the layout's order) in bursts of consecutive units whose
    full buckets, in the reduce dtype, come to at most `cap` bytes together (0: a unit
    each; a larger unit alone): a burst enters where the loss asks for its first unit,
    as one entry, as eager prefetching gathers the units after it."""
    out: list[tuple[str, ...]] = []
    size = 0
    for u in units:
        nbytes = sum(
            layout.buckets[i].full_numel * reduce[i].itemsize for i in layout.unit_buckets(u)
        )
        if out and size + nbytes <= cap:
            out[-1] += (u,)
            size += nbytes
        else:
            out.append((u,))
            size = nbytes
    return out


def jit_units(layout: ShardLayout) -> frozenset[str]:
    """`just_in_time=True`'s units: every unit with parameters but the root."""
    return frozenset(u for u in layout.units if u and layout.unit_buckets(u))
