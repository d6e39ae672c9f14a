"""The backward half of a step's units: each call's gradient reduced over ranks.

A unit's node hands its gradient here (`arrive`) as soon as the unit's backward is
complete. The reduction is the stage's (`Stage.reduce`): an all-reduce (stage 0, every
rank keeps the mean) or a reduce-scatter (stages 1-3, a rank keeps its slice of the
mean). How reductions are held and overlapped is the `Schedule`'s:

- `bursts`: leaf gradients are written, divided by the world size, straight into a
  buffer as wide as the calls that will fill it, up to `hold_bytes` (DDP's buckets at
  stages 0-1; at stages 2-3 the largest unit's, which consecutive smaller units share),
  reduced as one collective once full (for reduce-scatters laid out rank by rank,
  `_burst`);
- `hold_bytes`: without bursts (local accumulation, qgZ), complete unit gradients wait
  until that many bytes are ready, then their reductions start together;
- `in_flight`: how many reductions (collectives) may run while the backward goes on;
  `drain` (stages 1-3) finishes the burst in flight when the next unit's gradient arrives.

Reductions pair up across ranks by the order they are started in, so that order must
not depend on which calls a rank's loss reached. Every rank reduces the forward's calls
newest first (`enlist`); a call whose gradient arrives early waits for the ones before it,
and a call that never received one (its output unused on this rank) is reduced as zeros
in its own place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import ShardLayout, paste
from ._bursts import Burst, Bursts
from ._entry import Call, in_backward
from ._pool import Pool
from ._schedule import Schedule, unit_grad_numels
from ._unit_ledger import UnitLedger


class Reductions:
    """The reductions of one step (one micro-batch) on one rank."""

    def __init__(
        self,
        schedule: Schedule,
        layout: ShardLayout,
        mesh: Mesh,
        devices: Sequence[torch.device],
        *,
        ledger: UnitLedger | None,
        acc: dict[int, torch.Tensor] | None,
        final: bool,
        before: Callable[[], None],
        release: Callable[[Call], None],
        pool: Pool,
    ) -> None:
        self.s, self.layout, self.mesh, self.devices = schedule, layout, mesh, devices
        self.ledger = ledger
        # Local accumulation (DDP's no_sync): full gradients summed here per bucket across
        # micro-batches, reduced only on the final one.
        self.acc, self.final = acc, final
        self.before = before  # waits for the call check before the first collective
        self.release = release  # frees a call's gathered parameters once reduced
        self.pool = pool
        rows = 1 if schedule.all_reduce else mesh.shard.size
        self.bursts = Bursts(rows, pool) if schedule.bursts else None
        self.ordered: list[Call] = []  # the forward's calls, in call order
        self.ready: dict[int, tuple[torch.Tensor | None, ...]] = {}  # arrived early
        self.next = -1  # the next call (`order`) to reduce
        self.held: list[tuple[int, torch.Tensor, str]] = []  # (bucket, full gradient, unit)
        self.held_bytes = 0
        # The collectives in flight, oldest first: each a work and its parts, (bucket, out,
        # full gradient's bytes, unit, whether `out` still needs dividing); a burst's parts
        # share one work.
        self.inflight: list[tuple[Any, list[tuple[int, torch.Tensor, int, str, bool]]]] = []
        self.reduced: dict[int, torch.Tensor] = {}  # bucket -> shard gradient (sum of parts)
        self.extra: dict[int, torch.Tensor] = {}  # bucket -> zeros reduced after the backward
        self.columns: dict[str, dict[torch.dtype, int]] = {}  # unit -> `_columns`

    # -- the order every rank reduces in --------------------------------------------------
    def enlist(self, call: Call) -> None:
        """Gives a call made by the forward its place in the reduction order: the reverse
        of the forward's, which is autograd's for a chain of units. Calls made inside the
        backward (a checkpoint's recompute) never carry a gradient, and a unit with
        nothing trainable has nothing to reduce: neither takes a place (see `settle`)."""
        if in_backward() or all(self.layout.buckets[i].frozen for i in call.buckets):
            return
        call.order = self.next = len(self.ordered)
        self.ordered.append(call)

    def arrive(self, call: Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """A call's gradients (per bucket; per leaf with bursts; None: unused), from its
        node's backward; returns what the node gives its shard inputs (None: the shard
        gradients are collected by `result`)."""
        if call.twin is not None:
            self._join(call.twin, grads)
        elif call.order is None:
            self._reduce_call(call, grads)
        else:
            self._ready(call.order, grads)
        return (None,) * len(call.buckets)

    def _join(self, twin: Call, grads: tuple[torch.Tensor | None, ...]) -> None:
        """A recompute's entry never carries a gradient: its twin's node does (the
        checkpoint routes the gradient through the forward's graph)."""
        if any(g is not None for g in grads):
            raise RuntimeError(
                f"rank {self.mesh.rank}: unit {twin.unit!r}: a gradient flowed through an "
                "entry of the unit made inside the backward (a recompute differentiated "
                "again, as reentrant checkpointing does). fzero reduces a unit's gradient "
                "from its forward entry: checkpoint with fzero.remat or use_reentrant=False"
            )

    def _ready(self, order: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        self.ready[order] = grads
        while self.next in self.ready:
            self.next -= 1
            self._reduce_call(self.ordered[self.next + 1], self.ready.pop(self.next + 1))

    def _reduce_call(self, call: Call, grads: tuple[Any, ...] | None) -> None:
        """Reduces one call's gradients (None: its backward never ran here, so zeros)."""
        if self.bursts is not None:
            self._into_bursts(call, grads or (None,) * len(self.layout.unit_paths(call.unit)))
            return
        if grads is None:
            frozen = [self.layout.buckets[i].frozen for i in call.buckets]
            grads = tuple(None if f else self._zeros(i) for i, f in zip(call.buckets, frozen))
        self._take(call, grads)

    def _zeros(self, i: int) -> torch.Tensor:
        b = self.layout.buckets[i]
        return torch.zeros(b.full_numel, dtype=b.dtype, device=self.devices[i])

    # -- leaf gradients into burst buffers -------------------------------------------------
    def _into_bursts(self, call: Call, grads: tuple[torch.Tensor | None, ...]) -> None:
        assert self.bursts is not None
        if self.s.drain:
            while self.inflight:
                self._finish_oldest()
        lay = self.layout
        leaf_bucket = lay.unit_leaf_buckets(call.unit)
        for i in call.buckets:
            b = lay.buckets[i]
            if b.frozen:
                continue
            part = [g for g, j in zip(grads, leaf_bucket) if j == i]
            dtype = self.s.reduce_dtype or b.dtype
            # Only a burst that opens for this bucket walks the calls after it (`width`).
            view, closed = self.bursts.take(
                i,
                b.full_numel,
                dtype,
                self.devices[i],
                call.unit,
                width=lambda dtype=dtype: self._run_columns(call, dtype),
            )
            if closed is not None:
                self._issue_burst(closed)
            paste(b, part, view, self.mesh.size)
            self._log(call.unit, b.full_numel * view.element_size())
        call.reduced = True
        self.release(call)
        for burst in self.bursts.full():
            self._issue_burst(burst)
        while len(self.inflight) > self.s.in_flight:
            self._finish_oldest()

    def _columns(self, call: Call) -> dict[torch.dtype, int]:
        """Per dtype, the burst columns `call`'s trainable gradients take (worked out once
        per unit a step)."""
        assert self.bursts is not None  # asked only for a burst's width
        out = self.columns.get(call.unit)
        if out is None:
            numels = unit_grad_numels(self.layout, call.unit, self.s.reduce_dtype)
            out = self.columns[call.unit] = {d: n // self.bursts.rows for d, n in numels.items()}
        return out

    def _run_columns(self, call: Call, dtype: torch.dtype) -> int:
        """The width of a burst opened for `call`: its `dtype` columns and those of the
        calls reduced after it that will join them, up to `hold_bytes`. The burst is then
        full, and started, as soon as the last of them is in: no call arrives to find it
        too small, and no burst of several rows is closed with columns to spare (that one
        is copied before its reduce-scatter). At stages 2-3 (`unit_bursts`) a call without
        gradients of this dtype ends the run, so that no burst waits beside the others."""
        assert self.bursts is not None
        own = self._columns(call).get(dtype, 0)
        cap = self.s.hold_bytes // dtype.itemsize // self.bursts.rows
        if call.order is None or own >= cap:
            # A call outside the reduction order, or a unit as large as a burst (units of
            # one size), is a burst of its own.
            return own
        total = 0
        for j in range(call.order, -1, -1):
            columns = self._columns(self.ordered[j]).get(dtype, 0)
            if not columns and self.s.unit_bursts:
                break
            if total and total + columns > cap:
                break
            total += columns
        return total

    def _issue_burst(self, burst: Burst) -> None:
        self.before()
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
    def _take(self, call: Call, grads: tuple[torch.Tensor | None, ...]) -> None:
        if self.s.drain:
            while self.inflight:
                self._finish_oldest()
        frozen = [self.layout.buckets[i].frozen for i in call.buckets]
        for i, g, fz in zip(call.buckets, grads, frozen):
            if fz or g is None:
                continue
            nbytes = g.numel() * g.element_size()
            self._log(call.unit, nbytes)
            if self.acc is not None and not self.final:  # hold it: no communication yet
                self.acc[i] = self.acc[i] + g if i in self.acc else g.clone()
                self._log(call.unit, -nbytes)
                continue
            if self.acc is not None and i in self.acc:
                g = g + self.acc.pop(i)  # earlier micro-batches, reduced together now
            self.held.append((i, g, call.unit))
            self.held_bytes += nbytes
        call.reduced = True
        self.release(call)
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
        self.before()
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
            self.reduced[i] = self.reduced[i] + out if i in self.reduced else out
            self._log(unit, -nbytes)

    # -- after the backward ----------------------------------------------------------------
    def finish(self) -> None:
        """Reduces the forward's calls still waiting (zeros for those whose backward never
        ran on this rank), then waits for every reduction still in flight."""
        self.before()  # also when nothing is reduced (everything frozen)
        while self.next >= 0:
            self._reduce_call(self.ordered[self.next], self.ready.pop(self.next, None))
            self.next -= 1
        self._issue()
        for burst in self.bursts.close_all() if self.bursts is not None else ():
            self._issue_burst(burst)
        while self.inflight:
            self._finish_oldest()

    def settle(self, calls: Sequence[Call]) -> None:
        """Reduces zeros for the calls a checkpoint's recompute made (outside the order of
        `enlist`; their backward never runs), newest first, the same on every rank; then
        what local accumulation holds for buckets the final micro-batch did not use."""
        for call in reversed(calls):
            if call.reduced:
                continue
            for i in call.buckets:
                if not self.layout.buckets[i].frozen:
                    self._extra(i, self._reduce_now(self._zeros(i)))
            call.reduced = True
            self.release(call)
        if self.acc is not None and self.final:
            # Every rank holds the same set of buckets: reduced in bucket order, in step.
            for i in sorted(self.acc):
                self._extra(i, self._reduce_now(self.acc.pop(i)))

    def _extra(self, i: int, part: torch.Tensor) -> None:
        self.extra[i] = self.extra[i] + part if i in self.extra else part

    def result(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """This rank's reduced gradient per bucket (an empty placeholder for frozen ones)."""
        out = []
        for i, x in enumerate(inputs):
            if self.layout.buckets[i].frozen:
                out.append(x.new_empty(0))
                continue
            g = None
            for part in (self.reduced.get(i), self.extra.get(i)):
                if part is not None:
                    g = part if g is None else g + part
            out.append(torch.zeros_like(x) if g is None else g)
        return tuple(out)

    def _log(self, unit: str, nbytes: int) -> None:
        if self.ledger is not None:
            self.ledger._add("grads", unit, nbytes)
