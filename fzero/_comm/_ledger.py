"""CommLedger: every collective fzero issues on this rank, with its op, dtype and volume."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class CommRecord(NamedTuple):
    """One collective: `elements` is its logical volume in the ZeRO paper's accounting."""

    op: str  # "all_gather", "reduce_scatter", "all_reduce", "all_to_all" or "broadcast"
    dtype: torch.dtype
    elements: int
    axis: str = "world"  # the mesh axis it ran along (see `fzero.ProcessGroupMesh`)
    control: bool = False  # a step's few bytes of agreement between ranks, not its data

    @property
    def nbytes(self) -> int:
        return self.elements * self.dtype.itemsize


@dataclass
class CommLedger:
    """The collectives recorded while the ledger was open (see `comm_ledger`).

    `unrecorded` counts the runs of compiled graphs with collectives in them inside the
    block (`sharded_step` or `sharded_forward` with `compile=...`): those collectives
    (the units' gathers, the gradients' reductions) run in the graph, past fzero's
    collective layer, and are not in `records`; `complete` says whether there were none.
    """

    records: list[CommRecord] = field(default_factory=list)
    unrecorded: int = 0

    @property
    def complete(self) -> bool:
        """Whether `records` holds every collective fzero ran in the block (no compiled
        graph ran in it)."""
        return self.unrecorded == 0

    @property
    def elements(self) -> int:
        """Total logical elements moved."""
        return sum(r.elements for r in self.records)

    @property
    def nbytes(self) -> int:
        """Total logical bytes moved."""
        return sum(r.nbytes for r in self.records)

    @property
    def data(self) -> list[CommRecord]:
        """The records that move parameters, gradients or buffers (no `control` ones)."""
        return [r for r in self.records if not r.control]

    def by_op(self, data_only: bool = False) -> dict[str, int]:
        """Logical bytes per `"op:dtype"`, e.g. `{"all_gather:float32": 4096}`; `data_only`
        leaves the `control` records out."""
        out: dict[str, int] = {}
        for r in self.data if data_only else self.records:
            key = f"{r.op}:{str(r.dtype).removeprefix('torch.')}"
            out[key] = out.get(key, 0) + r.nbytes
        return out

    def by_axis(self, data_only: bool = True) -> dict[str, int]:
        """Logical bytes per mesh axis, e.g. `{"shard": 4096, "replica": 1024}`.

        On a 2-D mesh (`shard_size=S`) "shard" bytes stay inside a group of S ranks and
        "replica" (and "world") bytes cross groups; with hpZ (`reshard_after_forward=k`)
        the backward's "secondary" gathers stay inside a group of k. `data_only` leaves
        the `control` records out.
        """
        out: dict[str, int] = {}
        for r in self.data if data_only else self.records:
            out[r.axis] = out.get(r.axis, 0) + r.nbytes
        return out

    def clear(self) -> None:
        self.records.clear()
        self.unrecorded = 0


# Ledgers open on this process. A list, not a context variable: autograd may run a
# backward (and so a unit's reduce-scatter) on another thread than the one that opened it.
_OPEN: list[CommLedger] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def comm_ledger() -> Iterator[CommLedger]:
    """Records every collective fzero issues on this rank while the block runs.

    Volumes follow the ZeRO paper (arXiv 1910.02054, section 7): an all-gather or a
    reduce-scatter moves its full (padded) buffer once, an all-reduce twice (a
    reduce-scatter then an all-gather), a broadcast once. So stages 0-2 move 2Ψ elements
    per step and stage 3 3Ψ with `reshard_after_forward=True` (fzero a little less: the
    root unit, the forward's last units and the units no backward uses are not gathered
    again). These are logical volumes:
    a rank really sends (n-1)/n of a reduce-scatter's or all-gather's.
    Nothing is recorded at world size 1, where nothing is sent. Besides the data, a step
    records `control` collectives of a few bytes: one int64 all-gather of a few words per
    rank (each rank's sums of its losses' weights and whether it had data;
    with just-in-time units also the check that every rank's forward called the same
    units) and, on a GPU, the losses' total as one float64 all-reduce; a compiled stage-3
    loss one more a call, its barrier before the first gather. A compiled step's
    or forward's graph runs its own collectives, which are not recorded: the ledger
    counts its runs (`unrecorded`, `complete`) and warns as the block closes.

    Yields:
      A CommLedger; read `.records`, `.elements`, `.nbytes` or `.by_op()` during or after
      the block.
    """
    ledger = CommLedger()
    with _LOCK:
        _OPEN.append(ledger)
    try:
        yield ledger
    finally:
        with _LOCK:
            _OPEN.remove(ledger)
    if ledger.unrecorded:
        # Not an error (the eager records are right), but the totals are not the step's.
        warnings.warn(
            f"fzero: comm_ledger: {ledger.unrecorded} run(s) of a compiled step's or "
            "forward's graph in the block; the collectives inside it (units' gathers, "
            "gradients' reductions) are not recorded, only the eager ones around it "
            "(ledger.complete is False)",
            RuntimeWarning,
            stacklevel=3,
        )


def graph_ran() -> None:
    """Counts a compiled graph's run, whose collectives are not recorded, in every open
    ledger (called by a compiled step or forward whose graph has collectives)."""
    if not _OPEN:
        return
    with _LOCK:
        for ledger in _OPEN:
            ledger.unrecorded += 1


def record(
    op: str, dtype: torch.dtype, elements: int, axis: str = "world", control: bool = False
) -> None:
    """Adds one collective to every open ledger (called by `_comm` only)."""
    if not _OPEN or not elements:
        return
    rec = CommRecord(op, dtype, int(elements), axis, control)
    with _LOCK:
        for ledger in _OPEN:
            ledger.records.append(rec)
