"""The call check: after each forward, ranks agree on the units they called.

With module hooks a unit is called when its submodule runs, so a rank-dependent branch
can skip one on some ranks, and the backward's collectives, which pair up by the order
they start in, would pair one unit with another. Each rank sends its calls after its
forward and reads everyone's before its backward's first collective; the same exchange
ORs a flag per unit over the ranks and carries the step's loss weights
(docs/design.md, [Note: one exchange after the forward]).
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
    carried: int = 0  # how many carried words follow the flags' words

    def check(self, mesh: Mesh) -> tuple[list[bool], list[list[int]]]:
        """Raises ValueError on every rank, naming each rank's calls, if they differ;
        returns the flags, each OR-ed over the ranks, and every rank's carried words."""
        everyone = self.wait()
        cut = len(everyone[0]) - self.carried
        carried = [e[cut:] for e in everyone]
        if all(e[:2] == everyone[0][:2] for e in everyone):
            words = [0] * (cut - 3)
            for e in everyone:
                words = [a | b for a, b in zip(words, e[3:cut])]
            flags = [bool(words[k // _BITS] >> (k % _BITS) & 1) for k in range(self.flags)]
            return flags, carried
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
    """One micro-batch's exchange among ranks after its forward, in one collective: the
    units each rank called (checked before the backward's first collective) and the words
    the step sends along (the losses' weights, on a step's last micro-batch).

    `after_forward` starts it once the forward is done (the engine's, or a step's that
    differentiates by leaf); `before_collective` waits for it before any collective that
    must come after the check (it returns at once while none is pending); the step reads
    `carried` once its backward is done.
    """

    def __init__(self, mesh: Mesh, carry: Callable[[], Sequence[int]] | None = None) -> None:
        """`carry`: called once, after the forward, for this rank's int64 words to send
        along (as many on every rank); None sends none."""
        self.mesh, self.carry = mesh, carry
        self.pending: Agreement | None = None
        self.flags: list[bool] | None = None  # OR-ed over the ranks, once checked
        self.words: list[list[int]] | None = None  # every rank's carried words, once checked
        self.alone: Callable[[], list[list[int]]] | None = None  # carried words sent alone

    def after_forward(
        self, called: list[str] | None, present: bool = True, flags: Sequence[bool] = ()
    ) -> None:
        """Starts the exchange: this rank's unit calls (`called`, in call order; None when
        the step checks none, and the carried words travel alone), whether it had a batch
        (False: it followed last step's calls), per unit of the layout a flag to OR over
        the ranks, and the carried words."""
        words = [] if self.carry is None else list(self.carry())
        if called is not None:
            self.pending = start_agreement(called, self.mesh, present, flags, words)
        elif self.carry is not None:
            self.alone = _comm.all_gather_ints_async(words, self.mesh)

    def before_collective(self) -> list[bool] | None:
        """Waits for the check (raising on every rank if the ranks' calls differ); returns
        the flags OR-ed over the ranks, or None if no check was started."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.flags, self.words = pending.check(self.mesh)
        return self.flags

    def carried(self) -> list[list[int]]:
        """Every rank's carried words, in rank order (raising as the check does if the
        ranks' calls differ)."""
        if self.alone is not None:
            return self.alone()
        self.before_collective()
        assert self.words is not None, "CallCheck.carried: no words were sent"
        return self.words
