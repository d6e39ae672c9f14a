"""Flat buffers and the leaves in them: where each leaf lives in its bucket (`Slot`,
`Bucket`), cutting a bucket's buffer into leaf views, pasting leaf gradients back into
one, packing leaves into a new one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch


@dataclass(frozen=True)
class Slot:
    """Where one leaf lives inside its bucket's padded flat buffer."""

    index: int  # position in the flattened parameter tree
    path: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    owner: int  # rank owning the whole leaf ("tensor" layout); -1 for "flat"


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: the leaves of one unit and one dtype, split evenly over the ranks."""

    dtype: torch.dtype
    slots: tuple[Slot, ...]
    shard_numel: int
    world_size: int
    unit: str = ""  # the unit's path prefix; "" is the root unit
    frozen: bool = False  # frozen leaves: gathered for compute, never reduced or updated

    @property
    def full_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def numel(self) -> int:
        """Real (unpadded) elements."""
        return sum(s.numel for s in self.slots)

    @cached_property
    def ordered(self) -> tuple[Slot, ...]:
        """The slots by offset: the order `cut` hands out leaves and `paste` takes them."""
        return tuple(sorted(self.slots, key=lambda s: s.offset))

    @cached_property
    def _rows(self) -> dict[tuple[int, int], tuple[Row, ...]]:
        return {}  # (row width, total) -> rows (`rows`); a step asks for the same ones

    def rows(self, n: int, total: int) -> tuple[Row, ...]:
        """The flat buffer of `total` elements (at least the slots' extent) cut into rows
        of `n` elements, each row into pieces that lie in one slot or in padding."""
        got = self._rows.get((n, total))
        if got is None:
            got = self._rows[(n, total)] = _rows_of(self.ordered, n, total)
        return got


class Row(NamedTuple):
    """One row of a flat buffer cut for a bucket: `torch.split` sizes, and per piece the
    position of its slot in `Bucket.ordered` (-1: padding) and the slot's elements."""

    sizes: tuple[int, ...]
    owners: tuple[tuple[int, int, int], ...]  # (slot position, first, last + 1)


def _rows_of(slots: tuple[Slot, ...], n: int, total: int) -> tuple[Row, ...]:
    # Every boundary: slot starts and ends, and row ends.
    pieces: list[tuple[int, int, int, int]] = []  # (start, end, slot position, its start)
    cursor = 0
    for k, s in enumerate(slots):
        if s.offset > cursor:
            pieces.append((cursor, s.offset, -1, cursor))
        pieces.append((s.offset, s.offset + s.numel, k, s.offset))
        # Not back: a zero-size leaf may share its offset with the leaf before it (the
        # "tensor" layout's placement puts it first in a rank's segment at equal loads).
        cursor = max(cursor, s.offset + s.numel)
    if total > cursor:
        pieces.append((cursor, total, -1, cursor))
    rows: list[Row] = []
    sizes: list[int] = []
    owners: list[tuple[int, int, int]] = []
    row_end = n
    for lo, hi, k, base in pieces:
        if lo == hi:  # a zero-size leaf: an empty piece of the row it falls in
            sizes.append(0)
            owners.append((k, 0, 0))
        while lo < hi:
            end = min(hi, row_end)
            sizes.append(end - lo)
            owners.append((k, lo - base, end - base))
            lo = end
            if lo == row_end:
                rows.append(Row(tuple(sizes), tuple(owners)))
                sizes, owners, row_end = [], [], row_end + n
    if sizes and (any(sizes) or not rows):
        rows.append(Row(tuple(sizes), tuple(owners)))
    elif sizes:  # empty leaves after the last full row belong to it
        last = rows[-1]
        rows[-1] = Row(last.sizes + tuple(sizes), last.owners + tuple(owners))
    return tuple(rows)


def cut(bucket: Bucket, flat: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
    """Each slot's leaf as a view into the full flat buffer (by offset), cut with one split.

    One split, not a slice per leaf: the backward of a slice builds a zero-filled gradient
    the size of the whole buffer, so a unit of P leaves would cost P buffer-sized fills;
    split's backward assembles one gradient for all of them.
    """
    slots = bucket.ordered
    rows = bucket.rows(flat.numel(), flat.numel())  # one row; none if nothing to cut
    row = rows[0] if rows else Row((), ())
    # The op itself: `torch.split`'s Python wrapper costs more than the split, per unit.
    parts = flat.split_with_sizes(row.sizes) if row.sizes else ()
    return [(slots[k], p.view(slots[k].shape)) for (k, _, _), p in zip(row.owners, parts) if k >= 0]


def paste(
    bucket: Bucket, grads: Sequence[torch.Tensor | None], out: torch.Tensor, divisor: int = 1
) -> torch.Tensor:
    """Writes `bucket`'s full flat gradient into `out` and returns it: the leaves' gradients
    `grads` (by offset, as `cut` cuts them; None: zero) divided by `divisor`, zero padding.

    `out` is the flat buffer (1-D), or its rows (2-D `[R, n]`, `R * n` the bucket's full
    size, rows apart in memory): row r takes elements `[r n, (r + 1) n)`, the slice rank r
    of the shard axis reduces, so a reduce-scatter burst can lay several buckets out rank
    by rank (`fzero._engine._bursts`). A leaf that straddles rows is written in pieces.

    The division rides on the copy of a large leaf (DDP's reducer does the same): a pass
    over the gradient that assembling it costs anyway. Small leaves are copied, then
    divided, each as one call over all of them: a model's biases and norms are hundreds of
    leaves, where a call per leaf cost more than the copies. Both round alike (a copy is
    exact). A division into a wider `out` (bfloat16 gradients, a float32 reduction) is
    done there, so it rounds in the wider dtype.
    """
    rows = out.view(1, -1) if out.dim() == 1 else out
    zeros: list[torch.Tensor] = []
    small_dst: list[torch.Tensor] = []
    small_src: list[torch.Tensor] = []
    flats: list[torch.Tensor | None] = [None if g is None else g.reshape(-1) for g in grads]
    if len(flats) != len(bucket.slots):
        raise ValueError(f"paste: {len(flats)} gradients for {len(bucket.slots)} leaves")
    for r, row in enumerate(bucket.rows(rows.shape[1], rows.numel())):
        for dst, (k, lo, hi) in zip(rows[r].split_with_sizes(row.sizes), row.owners):
            flat = None if k < 0 else flats[k]
            if flat is None:
                zeros.append(dst)
                continue
            src = flat if lo == 0 and hi == flat.numel() else flat[lo:hi]
            if hi - lo <= _SMALL:
                small_dst.append(dst)
                small_src.append(src)
            elif divisor == 1:
                dst.copy_(src)
            elif src.dtype == dst.dtype:
                torch.div(src, divisor, out=dst)
            else:
                dst.copy_(src).div_(divisor)
    if zeros:
        torch._foreach_zero_(zeros)
    if small_dst:
        torch._foreach_copy_(small_dst, small_src)
        if divisor != 1:
            torch._foreach_div_(small_dst, divisor)
    return out


# Leaves (or pieces of them) of at most this many elements are pasted together (`paste`).
_SMALL = 1 << 15


@torch.no_grad()  # packing copies values; autograd history (params that require grad) stays out
def pack(bucket: Bucket, leaves: list[Any], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of `bucket`'s padded flat buffer built from `leaves` (a new tensor).

    A frozen bucket whose leaves are None (a gradient tree) packs to an empty tensor.
    """
    if bucket.frozen and bucket.slots and leaves[bucket.slots[0].index] is None:
        device = next((x.device for x in leaves if x is not None), None)
        return torch.empty(0, dtype=bucket.dtype, device=device)
    parts, cursor = [], lo
    device = leaves[bucket.slots[0].index].device if bucket.slots else None
    for s in bucket.ordered:
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b:
            continue
        if a > cursor:
            parts.append(torch.zeros(a - cursor, dtype=bucket.dtype, device=device))
        leaf = leaves[s.index]
        if leaf.dtype != bucket.dtype or tuple(leaf.shape) != s.shape:
            raise ValueError(
                f"leaf {s.path!r}: got {tuple(leaf.shape)} {leaf.dtype}, "
                f"layout expects {s.shape} {bucket.dtype}"
            )
        parts.append(leaf.reshape(-1)[a - s.offset : b - s.offset])
        cursor = b
    if hi > cursor:
        parts.append(torch.zeros(hi - cursor, dtype=bucket.dtype, device=device))
    if not parts:
        return torch.zeros(0, dtype=bucket.dtype, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def accumulator(g: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """A new sum of gradients starting from `g`: in `reduce_dtype` where that is wider
    than `g`'s (16-bit gradients summed in float32, as FSDP2 accumulates without
    gradient sync), else a copy of `g`."""
    if reduce_dtype is not None and reduce_dtype.itemsize > g.element_size():
        return g.to(reduce_dtype)
    return g.clone()
