"""The call check: every step, ranks agree on the units their forwards called.

With module hooks a unit is called when its submodule runs, so a
rank-dependent branch can skip one on some ranks. Collectives pair up across ranks by
the order they start in: the backward's reductions (and at stage 3 its gathers) would
then pair one unit with another, silently when the sizes match. Each rank sends 24 bytes
(the call count, a hash of the sequence and whether it had a batch) after its forward;
the answer is read before the backward's first collective, so the exchange runs behind
the backward of the last unit called.

The same exchange carries one flag per unit, which every rank gets OR-ed over the ranks:
at stage 3, which resharded units some rank's backward may use the parameters of, so that
every rank gathers again the same ones (`_gathers`). It also carries other small host
values a step agrees on after the forward (`CallCheck.carry`: the losses' weights): a small
collective costs every rank a round of thread wake-ups, on a busy host far more than its
bytes. Measured on the GPT benchmark at 4 ranks on 2 cores, stepped in turn with DDP, 6
launches each, the weights' own all-reduce against riding here: stage 0 1.06 -> 1.00 x
DDP (median), stage 2 1.09 -> 1.06.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .. import _comm
from .._comm import Mesh


class Agreement(NamedTuple):
    """An exchange of call sequences in flight: `check` waits for it."""

    called: list[str]
    wait: Callable[[], list[list[int]]]
    flags: int  # how many flags follow the three values
    carried: int = 0  # how many words of a rider's follow the flags' words

    def check(self, mesh: Mesh) -> tuple[list[bool], list[list[int]]]:
        """Raises ValueError on every rank, naming each rank's calls, if they differ;
        returns the flags, each OR-ed over the ranks, and every rank's carried words."""
        everyone = self.wait()
        cut = len(everyone[0]) - self.carried
        riders = [e[cut:] for e in everyone]
        if all(e[:2] == everyone[0][:2] for e in everyone):
            words = [0] * (cut - 3)
            for e in everyone:
                words = [a | b for a, b in zip(words, e[3:cut])]
            flags = [bool(words[k // _BITS] >> (k % _BITS) & 1) for k in range(self.flags)]
            return flags, riders
        calls = _comm.all_gather_object(self.called, mesh)
        said = "; ".join(
            f"rank {r}: {', '.join(map(repr, c)) or 'none'}" for r, c in enumerate(calls)
        )
        absent = [r for r, e in enumerate(everyone) if not e[2]]
        if absent:
            raise ValueError(
                f"rank {mesh.rank}: rank(s) {absent} had no batch this step and repeated "
                f"the units the step called last time, but the others called different "
                f"ones ({said}). A rank without data can only follow a forward whose unit "
                "calls do not change from step to step; give it a batch (with weight 0) "
                "instead"
            )
        raise ValueError(
            f"rank {mesh.rank}: the forward called different units on different ranks "
            f"({said}). Every rank must call the same units in the same order: fzero reduces "
            "unit gradients (and stage 3 gathers unit parameters) in call order, so a unit "
            "skipped on some ranks would be paired with another unit's collective. Run the "
            "unit on every rank (multiplying its output by 0 where it should not count), or "
            "leave it out of units= so its parameters join the root unit"
        )


_BITS = 62  # flags per int64 word, clear of the sign bit


def start_agreement(
    called: list[str],
    mesh: Mesh,
    present: bool = True,
    flags: Sequence[bool] = (),
    carry: Sequence[int] = (),
) -> Agreement:
    """Starts comparing this rank's unit calls (`called`, unit names in call order) with the
    other ranks' (host values on the control axis: checking them never waits for a GPU).
    `present`: whether this rank ran a forward (False: it had no batch and followed the
    units called last step). `flags`: as many on every rank (one per unit of the layout),
    OR-ed over the ranks by the check. `carry`: int64 words (as many on every rank) that
    travel along, handed back per rank by the check."""
    # A digest of the names, not Python's hash(): that one is salted per process.
    digest = hashlib.blake2b("\0".join(called).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little", signed=True)
    words = [0] * -(-len(flags) // _BITS)
    for k, f in enumerate(flags):
        words[k // _BITS] |= int(f) << (k % _BITS)
    values = [len(called), h, int(present), *words, *carry]
    return Agreement(called, _comm.all_gather_ints_async(values, mesh), len(flags), len(carry))


class CallCheck:
    """One step's check, shared by the engine's halves: started after the forward
    (`start`), waited for before the backward's first collective (calling it)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.pending: Agreement | None = None
        self.flags: list[bool] | None = None  # OR-ed over the ranks, once checked
        self.rider: list[int] = []  # words for the next `start` to carry
        self.carried: list[list[int]] | None = None  # every rank's, once checked

    def carry(self, words: Sequence[int]) -> Callable[[], list[list[int]]]:
        """Has the next `start` send `words` (int64, as many on every rank) along with the
        check; returns what waits for every rank's words, in rank order (raising as the
        check does if the ranks' calls differ)."""
        self.rider, self.carried = list(words), None

        def wait() -> list[list[int]]:
            self()
            assert self.carried is not None, "CallCheck.carry: no check was started"
            return self.carried

        return wait

    def start(self, called: list[str], present: bool = True, flags: Sequence[bool] = ()) -> None:
        self.pending = start_agreement(called, self.mesh, present, flags, self.rider)
        self.rider = []

    def __call__(self) -> list[bool] | None:
        """Waits for the check (raising if the ranks' calls differ); returns the flags
        OR-ed over the ranks, or None if no check was started."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.flags, self.carried = pending.check(self.mesh)
        return self.flags
