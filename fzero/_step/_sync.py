"""StepSync: one step's agreement among ranks, after each forward, in one collective.

A step agrees on two things after its forward: the units each rank called (the call
check of every micro-batch, `_engine.CallCheck`, read before its backward's first
collective), and the losses' weights (`Tally`, read before the update). The weights
ride the last micro-batch's check, so a step pays for one small collective, not two
(docs/design.md, [Note: one exchange after the forward]).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from .. import _comm
from .._comm import Mesh
from .._engine import CallCheck
from ._loss_weights import Weighed


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


class StepSync:
    """One step's agreement: a call check per micro-batch (`check`), the last of which
    carries the losses' weights, read back as a `Tally` once the backward is done.

    Every rank sends its own host values (its weights' sum, its calls of each kind, whether
    it had data, and on the CPU its losses' total) as int64 words on the control axis, so
    reading them never waits for the GPU; every rank then sums them alike, in rank order.
    A GPU's total stays on its device and is summed by the world's backend (the step
    returns it unread).
    """

    def __init__(
        self,
        mesh: Mesh,
        weighed: Weighed,
        present: bool,
        device: torch.device | None,
        micro: int = 1,
        accumulating: bool = False,
    ) -> None:
        """`weighed`: the step's loss, keeping what each call returned. `present`: whether
        this rank has any data this step. `device`: where the losses' total lives if the
        rank has none (the parameters'). `micro`: the step's micro-batch count;
        `accumulating`: the step was given a list of micro-batches."""
        self.mesh, self.micro, self.accumulating = mesh, micro, accumulating
        self.words = _Words(mesh, weighed, present, device)
        self.last: CallCheck | None = None  # the check that carries the words
        self.refused: list[BaseException] = []  # refused losses no exchange has carried yet

    def check(self, j: int, every: bool = False) -> CallCheck:
        """Micro-batch `j`'s call check. The first exchanges and, accumulating, gates the
        backward (the ranks agree on the micro-batch count before any reduces: with local
        accumulation a rank with one micro-batch reduces in it, the others do not); the
        last carries the weights (the others as many zero words); the middle ones exchange
        only where the engine compares calls or `every` says so, and a refused loss there
        travels with the next check that exchanges."""
        last = j == self.micro - 1
        carry = self.words if last else _no_words
        check = CallCheck(
            self.mesh,
            carry,
            micro=self.micro,
            exchange=j == 0 or last or every,
            gate=j == 0 and self.accumulating,
            refused=self.refused,
        )
        if last:
            self.last = check
        return check

    def early_factor(self) -> float | None:
        """The step's gradient factor (`Tally.factor`) from the last check's words, while
        the backward runs: None unless they arrived and agree (the step then decides
        after its backward, as always)."""
        everyone = None if self.last is None else self.last.peek()
        if not everyone or (sum(e[1] for e in everyone) and sum(e[2] for e in everyone)):
            return None
        weight = math.fsum(_float(e[0]) for e in everyone)
        return None if weight == 0 else self.mesh.size * self.micro / weight

    def tally(self) -> Tally:
        """The sums over every rank (raising on every rank if the losses mixed kinds)."""
        assert self.last is not None, "StepSync.tally before the last micro-batch's check"
        everyone = self.last.carried()
        if self.words.total is None:  # a left fold in rank order, the same on every rank
            total = torch.tensor(
                sum(_float(e[4]) for e in everyone), dtype=torch.float64, device="cpu"
            )
        else:  # summed on the device once every rank agreed: no stray collective
            total, work = _comm.all_reduce_sum_async(self.words.total, self.mesh.world)
            if work is not None:
                work.wait()  # on a GPU: the current stream waits, the host does not
        pairs, scalars = sum(e[1] for e in everyone), sum(e[2] for e in everyone)
        weight = math.fsum(_float(e[0]) for e in everyone)
        tally = Tally(total, weight, pairs, scalars, tuple(bool(e[3]) for e in everyone))
        if tally.pairs and tally.scalars:
            raise _comm.agreed(
                ValueError(
                    f"loss_fn returned (total, weight) {tally.pairs} times "
                    f"and a scalar {tally.scalars} times this step, over all ranks; every call "
                    "must return the same kind, or the mean would mix two meanings"
                )
            )
        return tally


class _Words:
    """This rank's sums as the words its last check carries (apart from `StepSync`, which
    holds the check: the check holding it back would make a cycle)."""

    def __init__(
        self, mesh: Mesh, weighed: Weighed, present: bool, device: torch.device | None
    ) -> None:
        self.mesh, self.weighed, self.present, self.device = mesh, weighed, present, device
        self.total: torch.Tensor | None = None  # a device total, summed by `tally`

    def __call__(self) -> list[int]:
        """The words, once the last forward is done."""
        weighed = self.weighed
        where = weighed.totals[0].device if weighed.totals else self.device
        total = torch.zeros((), dtype=torch.float64, device=where)
        for t in weighed.totals:  # a left fold in call order, as one process sums them
            total = total + t.double()
        words = [
            _bits(math.fsum(weighed.weights)),
            weighed.pairs,
            weighed.scalars,
            int(self.present),
        ]
        if total.device.type == "cpu":
            words.append(_bits(total.item()))
        else:  # summed on the device, by `tally`; the word keeps every rank's count alike
            self.total = total
            words.append(0)
        return words


_WORDS = 5  # what `_Words` sends: weights' sum, pairs, scalars, present, a CPU total


def _no_words() -> list[int]:
    """What a check before the last carries: as many words, all 0."""
    return [0] * _WORDS


def _bits(x: float) -> int:
    """A float64's bits as an int64 (to travel with int64 words, exactly)."""
    return int.from_bytes(struct.pack("<d", x), "little", signed=True)


def _float(word: int) -> float:
    """The float64 whose bits `_bits` made `word`."""
    return float(struct.unpack("<d", word.to_bytes(8, "little", signed=True))[0])
