"""Weights: what each rank's losses count for in the mean, agreed over ranks once a step.

A loss is either a scalar (the mean over its micro-batch; it counts once) or a pair
`(total, weight)`, e.g. the sum of token losses and the number of real tokens. The
step's gradient is the gradient of `sum(total) / sum(weight)` over every rank and
micro-batch: exactly one process minimising the global token mean. The engine reduces
unit gradients as a mean over ranks (and the step averages micro-batches), so with `N`
ranks and `M` micro-batches the gradient it produces is `sum(grad total) / (N * M)`,
and the step multiplies it by `N * M / sum(weight)` (exactly 1, and skipped, for scalar
losses on ranks that all had data: today's numbers, bitwise).

One small exchange per step agrees on the sums, started as soon as the last forward is
done so it runs behind the backward (with the call check's, where there is one). A
micro-batch that is None (a rank without data) counts with weight 0 and its rank is
marked absent, so that buffers follow only the ranks that ran a forward.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .. import _comm
from .._comm import Mesh
from .._core import LossFn, PyTree, check_loss
from .._engine import CallCheck


class Weighed:
    """`loss_fn` as a scalar loss for differentiation, keeping each call's (total, weight).

    A pair's total is what is differentiated; a scalar counts with weight 1."""

    def __init__(self, loss_fn: LossFn, rank: int) -> None:
        self.loss_fn, self.rank = loss_fn, rank
        self.totals: list[torch.Tensor] = []  # detached, as returned
        self.weights: list[float] = []
        self.pairs = self.scalars = 0

    def __call__(self, params: PyTree, batch: Any) -> torch.Tensor:
        out = self.loss_fn(params, batch)
        if isinstance(out, tuple):
            if len(out) != 2:
                raise TypeError(
                    f"rank {self.rank}: loss_fn returned a tuple of {len(out)}; it must return "
                    "a scalar loss or a pair (total, weight)"
                )
            total = check_loss(out[0], "loss_fn's total", self.rank)
            weight = _weight_value(out[1], self.rank)
            self.pairs += 1
        else:
            total, weight = check_loss(out, rank=self.rank), 1.0
            self.scalars += 1
        self.totals.append(total.detach())
        self.weights.append(weight)
        return total

    def local_loss(self) -> torch.Tensor | None:
        """This rank's mean loss over its micro-batches (None if it had none)."""
        return torch.stack(self.totals).mean() if self.totals else None


def _weight_value(weight: Any, rank: int) -> float:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex():
            raise ValueError(
                f"rank {rank}: loss_fn's weight must be a real number or one-element "
                f"tensor, got shape {tuple(weight.shape)} dtype {weight.dtype}"
            )
        weight = weight.detach().item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(
            f"rank {rank}: loss_fn's weight must be a number or tensor, got {type(weight).__name__}"
        )
    w = float(weight)
    if not (math.isfinite(w) and w >= 0):
        raise ValueError(f"rank {rank}: loss_fn's weight must be finite and >= 0, got {w}")
    return w


class Tally(NamedTuple):
    """The step's sums over every rank and micro-batch."""

    total: torch.Tensor  # 0-d float64 on the loss's device: sum of totals (or of losses)
    weight: float  # sum of weights (scalar losses: micro-batches that had data)
    pairs: int  # calls that returned (total, weight)
    scalars: int  # calls that returned a scalar
    present: tuple[bool, ...]  # per rank: whether it had any data this step

    def factor(self, world_size: int, micro: int) -> float | None:
        """What the engine's mean gradient is multiplied by (None: nothing to scale by,
        the weights sum to 0)."""
        if self.weight == 0:
            return None
        return world_size * micro / self.weight

    def loss(self) -> torch.Tensor:
        """The global weighted mean loss (0 when nothing had weight)."""
        return self.total / self.weight if self.weight else torch.zeros_like(self.total)


class Exchange:
    """One step's sums over the ranks: started behind the backward, read before the update.

    Every rank sends its own host values (its weights' sum, its calls of each kind, whether
    it had data, and on the CPU its losses' total), as int64 words on the control axis, so
    reading them never waits for the GPU; every rank then sums them alike, in rank order.
    Where the step checks the ranks' unit calls, the words travel with that check (one
    collective, `CallCheck.carry`), else by themselves. A GPU's total stays on its device
    and is summed by the world's backend (the step returns it unread).
    """

    def __init__(self, mesh: Mesh, device: torch.device | None) -> None:
        self.mesh, self.device = mesh, device
        self.pending: Callable[[], list[list[int]]] | None = None
        self.total: tuple[torch.Tensor, Any] | None = None  # a device total's all-reduce

    def start(self, weighed: Weighed, present: bool, check: CallCheck | None = None) -> None:
        """Sends this rank's sums: with `check`'s exchange of calls, or by themselves."""
        where = weighed.totals[0].device if weighed.totals else self.device
        total = torch.zeros((), dtype=torch.float64, device=where)
        for t in weighed.totals:  # a left fold in call order, as one process sums them
            total = total + t.double()
        words = [_bits(math.fsum(weighed.weights)), weighed.pairs, weighed.scalars, int(present)]
        if total.device.type == "cpu":
            words.append(_bits(total.item()))
        else:
            self.total = _comm.all_reduce_sum_async(total, self.mesh.world)
        if check is not None:
            self.pending = check.carry(words)
        else:
            self.pending = _comm.all_gather_ints_async(words, self.mesh)

    def wait(self) -> Tally:
        assert self.pending is not None, "Exchange.wait before start"
        everyone = self.pending()
        if self.total is None:  # a left fold in rank order, the same on every rank
            total = torch.tensor(
                sum(_float(e[4]) for e in everyone), dtype=torch.float64, device="cpu"
            )
        else:
            total, work = self.total
            if work is not None:
                work.wait()  # on a GPU: the current stream waits, the host does not
        pairs, scalars = sum(e[1] for e in everyone), sum(e[2] for e in everyone)
        weight = math.fsum(_float(e[0]) for e in everyone)
        tally = Tally(total, weight, pairs, scalars, tuple(bool(e[3]) for e in everyone))
        if tally.pairs and tally.scalars:
            raise ValueError(
                f"rank {self.mesh.rank}: loss_fn returned (total, weight) {tally.pairs} times "
                f"and a scalar {tally.scalars} times this step, over all ranks; every call "
                "must return the same kind, or the mean would mix two meanings"
            )
        return tally


def _bits(x: float) -> int:
    """A float64's bits as an int64 (to travel with int64 words, exactly)."""
    return int.from_bytes(struct.pack("<d", x), "little", signed=True)


def _float(word: int) -> float:
    """The float64 whose bits `_bits` made `word`."""
    return float(struct.unpack("<d", word.to_bytes(8, "little", signed=True))[0])
