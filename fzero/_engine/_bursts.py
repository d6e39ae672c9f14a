"""Gradient bursts: several units' gradients in one buffer, reduced by one collective.

Each leaf's gradient is written straight into the current burst (divided by the mesh
size on the way in); a burst opens as wide as the units that will fill it and is reduced
as soon as the last of them is in. Stage 0's burst is its buckets end to end (for an
all-reduce); stages 1-3 lay a burst out rank by rank (for a reduce-scatter), so that
rank r receives its slice of every bucket as one row (docs/design.md, [Note: bursts]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._pool import Pool


@dataclass
class Burst:
    """One buffer of `rows` rows, filled column-wise from the front, reduced as one."""

    buffer: torch.Tensor
    rows: int = 1
    used: int = 0  # columns filled (elements per row)
    parts: list[tuple[int, int, str]] = field(default_factory=list)  # (bucket, column, unit)

    @property
    def width(self) -> int:
        return self.buffer.numel() // self.rows

    def take(self, bucket: int, columns: int, unit: str) -> torch.Tensor | None:
        """The next `columns` columns of every row (`[rows, columns]`), for `bucket` of
        `unit`; None if they do not fit."""
        if self.used + columns > self.width:
            return None
        self.parts.append((bucket, self.used, unit))
        self.used += columns
        return self.buffer.view(self.rows, self.width)[:, self.used - columns : self.used]

    @property
    def filled(self) -> torch.Tensor:
        """The filled columns of every row, row after row, as one 1-D tensor: a view when
        the rows are full or there is one row, else a copy (a burst closed with columns to
        spare: `Reductions` sizes each burst to the calls that will fill it, to avoid
        this copy of the burst on every step)."""
        if self.rows == 1:
            return self.buffer[: self.used]
        return self.buffer.view(self.rows, self.width)[:, : self.used].reshape(-1)


class Bursts:
    """The bursts of one step on one rank, one open per dtype.

    A new burst is as wide as its opener says (`take`'s `width`: `Reductions` gives the
    calls that will fill it, consecutive in the reduction order), and is full once every
    column is used. Its buffer comes from `pool` (the same sizes every step). `rows`: 1
    for all-reduces, the shard axis's size for reduce-scatters.
    """

    def __init__(self, rows: int, pool: Pool) -> None:
        self.rows, self.pool = rows, pool
        self.open: dict[torch.dtype, Burst] = {}

    def take(
        self,
        bucket: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        unit: str,
        width: Callable[[], int],
    ) -> tuple[torch.Tensor, Burst | None]:
        """Room (`[rows, numel / rows]`) for one bucket's `numel`-element gradient, and the
        burst it closed to make room (if any); `width`: asked only when a burst opens for
        it, its columns (at least the bucket's)."""
        columns = numel // self.rows
        closed = None
        burst = self.open.get(dtype)
        view = burst.take(bucket, columns, unit) if burst is not None else None
        if view is None:
            closed = self.open.pop(dtype, None)
            wide = max(columns, width())
            buffer = self.pool.take(wide * self.rows, dtype, device)
            burst = self.open[dtype] = Burst(buffer, self.rows)
            view = burst.take(bucket, columns, unit)
            assert view is not None
        return view, closed

    def full(self) -> list[Burst]:
        """Closes and returns the open bursts with every column used."""
        done = [b for b in self.open.values() if b.used == b.width]
        for b in done:
            del self.open[b.buffer.dtype]
        return done

    def close_all(self) -> list[Burst]:
        """Closes and returns every open burst that holds anything."""
        done = [b for b in self.open.values() if b.used]
        self.open.clear()
        return done
