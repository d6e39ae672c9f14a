"""Flat buffers and the leaves in them: where each leaf lives in its bucket (`Slot`,
`Bucket`), cutting a bucket's buffer into leaf views, pasting leaf gradients back into
one, packing leaves into a new one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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


def by_offset(bucket: Bucket) -> list[Slot]:
    return sorted(bucket.slots, key=lambda s: s.offset)


def cut(bucket: Bucket, flat: torch.Tensor) -> list[tuple[Slot, torch.Tensor]]:
    """Each slot's leaf as a view into the full flat buffer (by offset), cut with one split.

    One split, not a slice per leaf: the backward of a slice builds a zero-filled gradient
    the size of the whole buffer, so a unit of P leaves would cost P buffer-sized fills;
    split's backward assembles one gradient for all of them.
    """
    slots = by_offset(bucket)
    sizes: list[int] = []
    kept: list[Slot | None] = []
    cursor = 0
    for s in slots:
        if s.offset > cursor:  # padding between ranks' segments ("tensor" layout)
            sizes.append(s.offset - cursor)
            kept.append(None)
        sizes.append(s.numel)
        kept.append(s)
        cursor = s.offset + s.numel
    if flat.numel() > cursor:
        sizes.append(flat.numel() - cursor)
        kept.append(None)
    parts = torch.split(flat, sizes) if sizes else ()
    return [(s, p.view(s.shape)) for s, p in zip(kept, parts) if s is not None]


def paste(
    bucket: Bucket, grads: Sequence[torch.Tensor | None], out: torch.Tensor, divisor: int = 1
) -> torch.Tensor:
    """Writes `bucket`'s full flat gradient into `out` and returns it: the leaves' gradients
    `grads` (by offset, as `cut` cuts them; None: zero) divided by `divisor`, zero padding.

    `out` is the flat buffer (1-D), or its rows (2-D `[R, n]`, `R * n` the bucket's full
    size, rows apart in memory): row r takes elements `[r n, (r + 1) n)`, the slice rank r
    of the shard axis reduces, so a reduce-scatter burst can lay several buckets out rank
    by rank (`_burst`). A leaf that straddles rows is written in pieces.

    The division rides on the copy (DDP's reducer does the same): a pass over the gradient
    that assembling it costs anyway. A division into a wider `out` (bfloat16 gradients, a
    float32 reduction) is done there, so it rounds in the wider dtype.
    """
    rows = out.view(1, -1) if out.dim() == 1 else out
    n = rows.shape[1]

    def spans(lo: int, hi: int) -> Iterator[tuple[torch.Tensor, int, int]]:
        # Flat elements [lo, hi) as (destination, its first and last flat element + 1).
        while lo < hi:
            r, c = divmod(lo, n)
            end = min(hi, (r + 1) * n)
            yield rows[r, c : c + end - lo], lo, end
            lo = end

    cursor = 0
    for s, g in zip(by_offset(bucket), grads, strict=True):
        for dst, _, _ in spans(cursor, s.offset):
            dst.zero_()
        flat = None if g is None else g.reshape(-1)
        for dst, lo, hi in spans(s.offset, s.offset + s.numel):
            if flat is None:
                dst.zero_()
                continue
            src = flat[lo - s.offset : hi - s.offset]
            if divisor == 1:
                dst.copy_(src)
            elif src.dtype == dst.dtype:
                torch.div(src, divisor, out=dst)
            else:
                dst.copy_(src).div_(divisor)
        cursor = s.offset + s.numel
    for dst, _, _ in spans(cursor, rows.shape[0] * n):
        dst.zero_()
    return out


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
    for s in by_offset(bucket):
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
