"""The backward half of a step's units: each entry's gradient reduced over ranks.

A unit's node hands its gradient here (`arrive`) as soon as the unit's backward is
complete. The reduction is the stage's (`Stage.reduce`): an all-reduce (stage 0, every
rank keeps the mean) or a reduce-scatter (stages 1-3, a rank keeps its slice of the
mean). How reductions are held and overlapped is the `Schedule`'s:

- `bursts`: leaf gradients are written, divided by the world size, straight into a
  buffer as wide as the entries that will fill it, up to `hold_bytes` (DDP's buckets at
  stages 0-1; at stages 2-3 the largest unit's, which consecutive smaller units share),
  reduced as one collective once full (for reduce-scatters laid out rank by rank,
  `_bursts`);
- `hold_bytes`: without bursts (local accumulation, qgZ), complete unit gradients wait
  until that many bytes are ready, then their reductions start together;
- `in_flight`: how many reductions (collectives) may run while the backward goes on;
  `drain` (stages 1-3) finishes the burst in flight when the next unit's gradient arrives.

Reductions pair up across ranks by the order they are started in, so that order must
not depend on which entries a rank's loss reached. Every rank reduces the forward's entries
newest first (`enlist`); an entry whose gradient arrives early waits for the ones before it,
and an entry that never received one (its output unused on this rank) is reduced as zeros
in its own place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _comm
from .._core import accumulator, paste
from ._bursts import Burst, Bursts
from ._callcheck import CallCheck
from ._context import Context
from ._entry import Entry, in_backward
from ._schedule import unit_grad_numels
from ._source import ParamSource

# Local accumulation (DDP's `no_sync`): per bucket, the full gradient summed over a
# step's micro-batches so far; reduced only on the last one. One per step.
LocalSums = dict[int, torch.Tensor]

# Told `(bucket, its reduced gradient)` as soon as a bucket's gradient is final: every
# entry of the forward that holds it is reduced (an offloaded state steps it then).
Watch = Callable[[int, torch.Tensor], None]


class Reductions:
    """The reductions of one micro-batch on one rank."""

    def __init__(
        self,
        ctx: Context,
        devices: Sequence[torch.device],
        check: CallCheck,
        source: ParamSource,
        sums: LocalSums | None = None,
        final: bool = True,
        watch: Watch | None = None,
    ) -> None:
        """`devices`: per bucket, where its gradient lives. `check`: the micro-batch's call
        check, waited for before the first collective. `source`: told when an entry's
        gradient is reduced (its parameters may go). `sums`, `final`: local accumulation,
        and whether this is the step's last micro-batch (whose reductions include them).
        `watch`: told each bucket's gradient as soon as it is final (`final` only)."""
        self.s, self.layout, self.mesh, self.devices = ctx.schedule, ctx.layout, ctx.mesh, devices
        self.ledger, self.pool = ctx.ledger, ctx.pool
        self.acc, self.final = sums, final
        self.check, self.source = check, source
        rows = 1 if self.s.all_reduce else self.mesh.shard.size
        self.bursts = Bursts(rows, self.pool) if self.s.bursts else None
        self.order: dict[Entry, int] = {}  # the forward's entries: place in the order
        self.done: set[Entry] = set()  # entries whose gradient is reduced (or joined)
        self.ordered: list[Entry] = []  # the forward's entries, in call order
        self.ready: dict[int, tuple[torch.Tensor | None, ...]] = {}  # arrived early
        self.next = -1  # the next entry (`order`) to reduce
        self.held: list[tuple[int, torch.Tensor, str]] = []  # (bucket, full gradient, unit)
        self.held_bytes = 0
        # The collectives in flight, oldest first: each a work and its parts, (bucket, out,
        # full gradient's bytes, unit, whether `out` still needs dividing); a burst's parts
        # share one work.
        self.inflight: list[tuple[Any, list[tuple[int, torch.Tensor, int, str, bool]]]] = []
        self.results: dict[int, torch.Tensor] = {}  # bucket -> reduced gradient (sum of parts)
        self.extra: dict[int, torch.Tensor] = {}  # bucket -> zeros reduced after the backward
        self.columns: dict[str, dict[torch.dtype, int]] = {}  # unit -> `_columns`
        self.watch = watch if final else None
        self.expect: dict[int, int] | None = None  # bucket -> its parts still to finish
        self.watched: set[int] = set()  # buckets whose final gradient `watch` was told

    # -- the order every rank reduces in --------------------------------------------------
    def enlist(self, entry: Entry) -> None:
        """Gives an entry made by the forward its place in the reduction order: the
        reverse of the forward's, which is autograd's for a chain of units. Entries made
        inside the backward (a checkpoint's recompute) never carry a gradient, and a unit
        with nothing trainable has nothing to reduce: neither takes a place (`settle`)."""
        if in_backward() or all(self.layout.buckets[i].frozen for i in entry.buckets):
            return
        self.order[entry] = self.next = len(self.ordered)
        self.ordered.append(entry)

    def is_reduced(self, entry: Entry) -> bool:
        return entry in self.done

    def arrive(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """An entry's gradients (per bucket; per leaf with bursts; None: unused), from its
        node's backward; returns what the node gives its shard inputs (None: the shard
        gradients are collected by `result`)."""
        if entry.twin is not None:
            self._join(entry.twin, grads)
        elif entry not in self.order:
            self._unwatch(entry.buckets)
            self._reduce_entry(entry, grads)
        else:
            self._ready(self.order[entry], grads)
        return (None,) * len(entry.buckets)

    def _join(self, twin: Entry, grads: tuple[torch.Tensor | None, ...]) -> None:
        """A recompute's entry never carries a gradient: its twin's node does (the
        checkpoint routes the gradient through the forward's graph)."""
        if any(g is not None for g in grads):
            raise RuntimeError(
                f"rank {self.mesh.rank}: unit {twin.unit!r}: a gradient flowed through an "
                "entry made inside the backward (a recompute differentiated again: "
                "reentrant checkpointing, Reformer's reversible layers); a unit's gradient "
                "comes from its forward entry: use fzero.remat or use_reentrant=False"
            )

    def _ready(self, order: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.ready[order] = grads
        while self.next in self.ready:
            self.next -= 1
            self._reduce_entry(self.ordered[self.next + 1], self.ready.pop(self.next + 1))

    def _reduce_entry(self, entry: Entry, grads: tuple[Any, ...] | None) -> None:
        """Reduces one entry's gradients (None: its backward never ran here, so zeros)."""
        if self.bursts is not None:
            self._into_bursts(entry, grads or (None,) * len(self.layout.unit_paths(entry.unit)))
            return
        if grads is None:
            frozen = [self.layout.buckets[i].frozen for i in entry.buckets]
            grads = tuple(None if f else self._zeros(i) for i, f in zip(entry.buckets, frozen))
        self._take(entry, grads)

    def _reduced(self, entry: Entry) -> None:
        self.done.add(entry)
        self.source.reduced(entry)

    def _zeros(self, i: int) -> torch.Tensor:
        b = self.layout.buckets[i]
        return torch.zeros(b.full_numel, dtype=b.dtype, device=self.devices[i])

    # -- leaf gradients into burst buffers -------------------------------------------------
    def _into_bursts(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> None:
        assert self.bursts is not None
        if self.s.drain:
            while self.inflight:
                self._finish_oldest()
        lay = self.layout
        leaf_bucket = lay.unit_leaf_buckets(entry.unit)
        for i in entry.buckets:
            b = lay.buckets[i]
            if b.frozen:
                continue
            part = [g for g, j in zip(grads, leaf_bucket) if j == i]
            dtype = self.s.reduce_dtype or b.dtype
            # Only a burst that opens for this bucket walks the entries after it (`width`).
            view, closed = self.bursts.take(
                i,
                b.full_numel,
                dtype,
                self.devices[i],
                entry.unit,
                width=lambda dtype=dtype: self._run_columns(entry, dtype),
            )
            if closed is not None:
                self._issue_burst(closed)
            paste(b, part, view, self.mesh.size)
            self._log(entry.unit, b.full_numel * view.element_size())
        self._reduced(entry)
        for burst in self.bursts.full():
            self._issue_burst(burst)
        while len(self.inflight) > self.s.in_flight:
            self._finish_oldest()

    def _columns(self, entry: Entry) -> dict[torch.dtype, int]:
        """Per dtype, the burst columns `entry`'s trainable gradients take (worked out once
        per unit a step)."""
        assert self.bursts is not None  # asked only for a burst's width
        out = self.columns.get(entry.unit)
        if out is None:
            numels = unit_grad_numels(self.layout, entry.unit, self.s.reduce_dtype)
            out = self.columns[entry.unit] = {d: n // self.bursts.rows for d, n in numels.items()}
        return out

    def _run_columns(self, entry: Entry, dtype: torch.dtype) -> int:
        """The width of a burst opened for `entry`: its `dtype` columns and those of the
        entries reduced after it that will join them, up to `hold_bytes`. The burst is then
        full, and started, as soon as the last of them is in: no entry arrives to find it
        too small, and no burst of several rows is closed with columns to spare (that one
        is copied before its reduce-scatter). At stages 2-3 (`unit_bursts`) an entry without
        gradients of this dtype ends the run, so that no burst waits beside the others."""
        assert self.bursts is not None
        own = self._columns(entry).get(dtype, 0)
        cap = self.s.hold_bytes // dtype.itemsize // self.bursts.rows
        order = self.order.get(entry)
        if order is None or own >= cap:
            # An entry outside the reduction order, or a unit as large as a burst (units of
            # one size), is a burst of its own.
            return own
        total = 0
        for j in range(order, -1, -1):
            columns = self._columns(self.ordered[j]).get(dtype, 0)
            if not columns and self.s.unit_bursts:
                break
            if total and total + columns > cap:
                break
            total += columns
        return total

    def _issue_burst(self, burst: Burst) -> None:
        self.check.before_collective()
        # Owned, already divided and in the reduce dtype. An all-reduce runs in place, so
        # each part's columns hold that bucket's mean once the work is done; a
        # reduce-scatter returns this rank's row, each part's columns its slice.
        filled = burst.filled
        if self.s.all_reduce:
            out, work = _comm.all_reduce_async(filled, self.mesh, owned=True)
        else:
            # This rank's row of the sums (the step's gradient), kept between steps or
            # not (`Schedule.keep_rows`). On one rank the row is the burst itself, unless
            # the burst is the pool's and must not stay lent past the step (a device
            # burst is the caching allocator's: handed over as it is, not copied).
            row = None
            if self.s.keep_rows and self.mesh.shard.size > 1:
                row = self.pool.take(burst.used, filled.dtype, filled.device)
            elif not self.s.keep_rows and self.mesh.shard.size == 1 and self.pool.pools(filled):
                row = torch.empty(burst.used, dtype=filled.dtype, device=filled.device)
            out, work = _comm.reduce_scatter_async(filled, self.mesh, owned=True, out=row)
        ends = [start for _, start, _ in burst.parts[1:]] + [burst.used]
        size = burst.rows * burst.buffer.element_size()
        # Once a reduce-scatter is done nothing refers to its burst, and the next burst
        # may take the buffer (`Pool`); an all-reduce's result is the burst itself.
        parts = [
            (i, out[start:end], (end - start) * size, unit, False)
            for (i, start, unit), end in zip(burst.parts, ends)
        ]
        self.inflight.append((work, parts))

    # -- unit gradients: held, then reduced ------------------------------------------------
    def _take(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> None:
        if self.s.drain:
            while self.inflight:
                self._finish_oldest()
        frozen = [self.layout.buckets[i].frozen for i in entry.buckets]
        for i, g, fz in zip(entry.buckets, grads, frozen):
            if fz or g is None:
                continue
            nbytes = g.numel() * g.element_size()
            self._log(entry.unit, nbytes)
            if self.acc is not None and not self.final:  # hold it: no communication yet
                acc = self.acc.get(i)  # in the reduce dtype, if wider (`accumulator`)
                self.acc[i] = accumulator(g, self.s.reduce_dtype) if acc is None else acc + g
                self._log(entry.unit, -nbytes)
                continue
            if self.acc is not None and i in self.acc:
                g = g + self.acc.pop(i)  # earlier micro-batches (the reduce dtype's, if wider)
                self._log(entry.unit, g.numel() * g.element_size() - nbytes)
                nbytes = g.numel() * g.element_size()
            self.held.append((i, g, entry.unit))
            self.held_bytes += nbytes
        self._reduced(entry)
        if self.held_bytes >= self.s.hold_bytes:
            self._issue()
        while len(self.inflight) > self.s.in_flight:
            self._finish_oldest()

    def _issue(self) -> None:
        """Starts the reductions of every held gradient, oldest first."""
        for i, g, unit in self.held:
            out, work = self._start(g)
            self.inflight.append((work, [(i, out, g.numel() * g.element_size(), unit, True)]))
        self.held.clear()
        self.held_bytes = 0

    def _start(self, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.check.before_collective()
        # `g` is this step's own gradient buffer (from autograd or a fresh sum): owned.
        if self.s.all_reduce:
            return _comm.all_reduce_async(g, self.mesh, dtype=self.s.reduce_dtype, owned=True)
        return _comm.reduce_scatter_async(
            g,
            self.mesh,
            dtype=self.s.reduce_dtype,
            owned=True,
            quant=self.s.quant_reduce,
        )

    def _reduce_now(self, g: torch.Tensor) -> torch.Tensor:
        out, work = self._start(g)
        if work is not None:
            work.wait()
        return out.div_(self.mesh.size) if self.mesh.size > 1 else out

    def _finish_oldest(self) -> None:
        work, parts = self.inflight.pop(0)
        if work is not None:
            work.wait()
        for i, out, nbytes, unit, divide in parts:
            if divide and self.mesh.size > 1:  # the mean; one rank's sum is already it
                out.div_(self.mesh.size)
            self.results[i] = self.results[i] + out if i in self.results else out
            self._log(unit, -nbytes)
            if self.watch is not None:
                self._count(i)

    # -- final gradients, told as they are ----------------------------------------------
    def _count(self, i: int) -> None:
        """One of bucket i's parts is reduced: if it was the last the forward's entries
        owe it, its gradient is final. Counted from the forward's entries (complete once
        the backward runs); an entry outside them (made inside the backward, without a
        twin) stops the watch (`_unwatch`)."""
        if self.expect is None:
            self.expect = {}
            for entry in self.ordered:
                for b in entry.buckets:
                    if not self.layout.buckets[b].frozen:
                        self.expect[b] = self.expect.get(b, 0) + 1
        self.expect[i] -= 1
        if self.expect[i] == 0 and self.watch is not None:
            self.watched.add(i)
            self.watch(i, self.results[i])

    def _unwatch(self, buckets: Sequence[int]) -> None:
        """A gradient outside the forward's entries arrives for `buckets`: nothing more is
        told final this step, and one already told cannot take it."""
        self.watch = None
        late = sorted(i for i in buckets if i in self.watched)
        if late:
            raise RuntimeError(
                f"rank {self.mesh.rank}: bucket(s) {late} received a gradient after their "
                "reduction was complete and their offloaded update had started: a unit "
                "entered inside the backward, outside a checkpoint's recompute of its forward "
                "entry. Enter the unit in the forward, or step without offload"
            )

    # -- after the backward ----------------------------------------------------------------
    def finish(self) -> None:
        """Reduces the forward's entries still waiting (zeros for those whose backward never
        ran on this rank), then waits for every reduction still in flight."""
        self.check.before_collective()  # also when nothing is reduced (everything frozen)
        while self.next >= 0:
            self._reduce_entry(self.ordered[self.next], self.ready.pop(self.next, None))
            self.next -= 1
        self._issue()
        for burst in self.bursts.close_all() if self.bursts is not None else ():
            self._issue_burst(burst)
        while self.inflight:
            self._finish_oldest()

    def settle(self, entries: Sequence[Entry]) -> None:
        """Reduces zeros for the entries a checkpoint's recompute made (outside the order of
        `enlist`; their backward never runs), newest first, the same on every rank; then
        what local accumulation holds for buckets the final micro-batch did not use."""
        for entry in reversed(entries):
            if entry in self.done:
                continue
            for i in entry.buckets:
                if not self.layout.buckets[i].frozen:
                    self._extra(i, self._reduce_now(self._zeros(i)))
            self._reduced(entry)
        if self.acc is not None and self.final:
            # Every rank holds the same set of buckets: reduced in bucket order, in step.
            for i in sorted(self.acc):
                self._extra(i, self._reduce_now(self.acc.pop(i)))

    def _extra(self, i: int, part: torch.Tensor) -> None:
        self._unwatch((i,))
        self.extra[i] = self.extra[i] + part if i in self.extra else part

    def result(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """This rank's reduced gradient per bucket (an empty placeholder for frozen ones)."""
        out = []
        for i, x in enumerate(inputs):
            if self.layout.buckets[i].frozen:
                out.append(x.new_empty(0))
                continue
            g = None
            for part in (self.results.get(i), self.extra.get(i)):
                if part is not None:
                    g = part if g is None else g + part
            if g is None:
                g = torch.zeros(x.shape, dtype=x.dtype, device=self.devices[i])
            out.append(g)
        return tuple(out)

    def _log(self, unit: str, nbytes: int) -> None:
        if self.ledger is not None:
            self.ledger._add("grads", unit, nbytes)
