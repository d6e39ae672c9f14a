"""Agreement: checking that every rank's forward called the same units in the same order.

With module hooks a unit is called when its submodule runs, so a rank-dependent branch can
skip one on some ranks. Collectives pair up across ranks by the order they start in: the
backward's reductions (and at stage 3 its gathers) would then pair one unit with another,
silently when the sizes match. Each rank sends 24 bytes (the call count, a hash of the
sequence and whether it had a batch) after its forward; the answer is read before the
backward's first collective, so the exchange runs behind the backward of the last unit
called.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import NamedTuple

from . import _comm
from ._mesh import Mesh


class Agreement(NamedTuple):
    """An exchange of call sequences in flight: `check` waits for it."""

    called: list[str]
    wait: Callable[[], list[list[int]]]

    def check(self, mesh: Mesh) -> None:
        """Raises ValueError on every rank, naming each rank's calls, if they differ."""
        everyone = self.wait()
        if all(e[:2] == everyone[0][:2] for e in everyone):
            return
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


def start_agreement(called: list[str], mesh: Mesh, present: bool = True) -> Agreement:
    """Starts comparing this rank's unit calls (`called`, unit names in call order) with the
    other ranks' (host values on the control axis: checking them never waits for a GPU).
    `present`: whether this rank ran a forward (False: it had no batch and followed the
    units called last step)."""
    # A digest of the names, not Python's hash(): that one is salted per process.
    digest = hashlib.blake2b("\0".join(called).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little", signed=True)
    values = [len(called), h, int(present)]
    return Agreement(called, _comm.all_gather_ints_async(values, mesh))


class CallCheck:
    """One step's check, shared by the engine's halves: started after the forward
    (`start`), waited for before the backward's first collective (calling it)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.pending: Agreement | None = None

    def start(self, called: list[str], present: bool = True) -> None:
        self.pending = start_agreement(called, self.mesh, present)

    def __call__(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.check(self.mesh)
