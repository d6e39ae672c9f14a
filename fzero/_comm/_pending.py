"""Collectives in flight: what `wait()` finishes once the communication is done (casts,
sums of what arrived, dequantizing, the second half of a hierarchical reduction)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _quant
from ._axis import Axis


class _CastOnWait:
    """A pending collective whose result, in the communication dtype, is cast into `out`."""

    def __init__(self, work: Any, tmp: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.tmp, self.out = work, tmp, out

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.out.copy_(self.tmp)


class _Works:
    """Several pending collectives that complete as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class _SumOnWait(_Works):
    """A point-to-point reduce-scatter in flight: on wait, this rank's slice of every rank's
    buffer (its own and those received) summed, in rank order, into `out`."""

    def __init__(self, works: list[Any], parts: list[torch.Tensor], out: torch.Tensor) -> None:
        super().__init__(works)
        self.parts, self.out = parts, out

    def wait(self) -> None:
        super().wait()
        # `out` already holds the first or second part in rank order (received into it);
        # adding the other is the same sum both ways (IEEE addition commutes), then the
        # rest in rank order: the left fold a single process would compute.
        for part in self.parts:
            self.out.add_(part)
        self.works, self.parts = [], []  # the sent slices and the received ones can go


class _SumRows(_Works):
    """An all-to-all reduce-scatter in flight: on wait, the rows received (every rank's
    slice for this one, its own included, in rank order) summed left to right into `out`,
    the fold `_SumOnWait` computes."""

    def __init__(self, work: Any, rows: torch.Tensor, out: torch.Tensor) -> None:
        super().__init__([work])
        self.rows: torch.Tensor | None = rows
        self.out = out

    def wait(self) -> None:
        super().wait()
        if self.rows is None:
            return
        rows, self.rows, self.works = self.rows, None, []
        torch.add(rows[0], rows[1], out=self.out)
        for row in rows[2:]:
            self.out.add_(row)


class _Then:
    """A collective in flight, then more communication once it is done (the second half
    of a hierarchical reduction, run by `wait`). Waiting twice is waiting once."""

    def __init__(self, first: Any, then: Callable[[], Any]) -> None:
        self.first, self.then = first, then

    def wait(self) -> None:
        if self.then is None:
            return
        if self.first is not None:
            self.first.wait()
        second, self.then = self.then(), None
        if second is not None:
            second.wait()


class _Dequantize(_Works):
    """Int8 codes and their scales gathered: on wait, their values into `out`."""

    def __init__(
        self,
        works: list[Any],
        codes: torch.Tensor,
        scales: torch.Tensor,
        out: torch.Tensor,
        block: int,
        check: str | None,
    ) -> None:
        super().__init__(works)
        self.codes, self.scales, self.out, self.block = codes, scales, out, block
        self.check = check  # raise, naming this, on a non-finite block (every rank sees it)

    def wait(self) -> None:
        super().wait()
        if self.codes is None:
            return
        if self.check is not None:
            _quant.check_finite(self.scales, self.check)
        rows = self.scales.shape[0]
        vals = _quant.dequantize(self.codes.view(rows, -1), self.scales, self.block, self.out.dtype)
        self.out.copy_(vals.reshape(-1))
        self.codes = self.scales = None


class _SumArrived(_Works):
    """A quantized all-to-all in flight: on wait, the sum in rank order of what arrived
    (this rank's own row exact), in `own`'s dtype (float32 or float64), into `out`."""

    def __init__(
        self,
        works: list[Any],
        got: tuple[torch.Tensor, torch.Tensor],
        own: torch.Tensor,
        out: torch.Tensor,
        axis: Axis,
        block: int,
    ) -> None:
        super().__init__(works)
        self.got, self.own, self.out, self.axis, self.block = got, own, out, axis, block

    def wait(self) -> None:
        super().wait()
        if self.got is None:
            return
        vals = _quant.dequantize(*self.got, self.block, self.own.dtype)
        vals[self.axis.rank] = self.own
        self.out.copy_(vals.sum(0))
        self.got = None
