"""The fault-injection harness: run a fault on simulated ranks, and say how each rank ended.

Every rank runs the case and catches what it raises, so the test sees every rank's
outcome, not only the first error: its exception's class and message, when it raised,
and whether it raised a peer's error (`fzero.PeerError`). Collectives time out after
`TIMEOUT` seconds; a case passes only if every rank raised well inside that (`BOUND`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import fzero

TIMEOUT = 20.0  # the process group's collective timeout in these tests
BOUND = 3.0  # every rank raises within this of the first: far below TIMEOUT


@dataclass(frozen=True)
class Outcome:
    """How one rank's run ended."""

    rank: int
    error: type | None  # the exception's class (None: it returned)
    message: str
    at: float  # time.time() when it raised (or returned)
    peer: bool  # it raised a peer's failure
    value: Any = None  # what it returned

    def isinstance(self, cls: type) -> bool:
        return self.error is not None and issubclass(self.error, cls)


def _catching(mesh: fzero.Mesh, fn: Callable[..., Any], *args: Any) -> Outcome:
    try:
        value = fn(mesh, *args)
    except Exception as exc:
        return Outcome(
            mesh.rank, type(exc), str(exc), time.time(), isinstance(exc, fzero.PeerError)
        )
    return Outcome(mesh.rank, None, "", time.time(), False, value)


def outcomes(world_size: int, fn: Callable[..., Any], *args: Any, **sim: Any) -> list[Outcome]:
    """`fn(mesh, *args)` on `world_size` simulated ranks; every rank's `Outcome`."""
    simulation = fzero.Simulation(world_size, collective_timeout=TIMEOUT, timeout=90, **sim)
    return simulation.run(_catching, fn, *args)


def raised_together(outs: list[Outcome], cls: type, *needles: str) -> float:
    """Asserts every rank raised `cls` with the same message, containing each of
    `needles`, within `BOUND` seconds of each other; returns that spread (and records it
    where FZERO_FAULT_TIMES names a file)."""
    for o in outs:
        assert o.error is not None, f"rank {o.rank} did not raise"
        assert o.isinstance(cls), f"rank {o.rank} raised {o.error.__name__}: {o.message}"
    messages = {o.message for o in outs}
    assert len(messages) == 1, f"the ranks' messages differ: {messages}"
    for needle in needles:
        assert needle in outs[0].message, f"{needle!r} not in {outs[0].message!r}"
    spread = max(o.at for o in outs) - min(o.at for o in outs)
    assert spread < BOUND, f"the last rank raised {spread:.2f} s after the first"
    record = os.environ.get("FZERO_FAULT_TIMES")
    if record:
        with open(record, "a") as f:
            f.write(
                json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), "spread": spread})
                + "\n"
            )
    return spread


def tiny_params(d: int) -> dict[str, torch.Tensor]:
    """A float64 layer's weight `w` (d x d) and bias `b`, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(d, d, generator=g, dtype=torch.float64),
        "b": torch.randn(d, generator=g, dtype=torch.float64),
    }
