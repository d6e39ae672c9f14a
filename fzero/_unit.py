"""Per-unit gathering and reduction during one step: the memory-true half of stages 2 and 3.

(`UnitRun` here; the autograd nodes that drive it are in `_nodes`, the check that every
rank called the same units in `_agree`.)

One autograd node per unit *call*, created just in time by a forward pre-hook on the
unit's submodule, carries the unit's shards into the forward and the unit's gradient
back out of it:

- forward: stage 3 all-gathers the unit's shards (or waits for the prefetched gather);
  stage 2 passes the rank's own replicated parameters through unchanged.
- backward: reduce-scatters (mean) the unit's full gradient into the shard's gradient
  (stage 0: writes it into a burst buffer, all-reduced as one; see `_burst`), then frees
  the unit's full parameters. Every rank reduces the forward's calls in one order
  (`UnitRun.enlist`). Autograd runs a node once all its consumers are
  done, so this happens as soon as the unit's backward is complete; nodes created before
  the forward would run only at the very end (autograd prefers the newest ready node),
  keeping every unit's full parameters and gradients alive through the whole backward.

With `reshard_after_forward` (stage 3) a forward post-hook frees the unit's gathered
storage (`untyped_storage().resize_(0)`; the views autograd saved stay valid objects) and
routes the unit's outputs through an identity node whose backward gathers the storage
again just before the unit's own backward needs it. Storage is refilled in place through
a fresh tensor on the same storage, so autograd's version counters are untouched.

The gradient engine is `torch.autograd.grad`, not `torch.func.grad`: module hooks, the
storage tricks above and saved-tensor hooks (activation checkpointing) are all outside
what torch.func's transforms accept. The user's loss may still use torch.func.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import _comm
from ._agree import Agreement, start_agreement
from ._burst import Burst, Bursts
from ._flat import paste
from ._layout import ShardLayout
from ._mesh import Mesh
from ._unit_ledger import UnitLedger


class _Call:
    """One call of one unit: its gathered buffers and whether its backward has run."""

    def __init__(self, unit: str) -> None:
        self.unit = unit
        self.storages: list[Any] = []
        self.nbytes: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.resident = True
        self.refill: list[tuple[torch.Tensor, Any]] | None = None  # prefetched re-gather
        self.reduced = False
        self.order: int | None = None  # place in the order every rank reduces in (`enlist`)
        self.swapped: list[tuple[nn.Module, str, Any]] = []  # module slots the hook overrode

    def attach(self, fulls: tuple[torch.Tensor, ...]) -> None:
        self.storages = [f.untyped_storage() for f in fulls]
        self.nbytes = [s.nbytes() for s in self.storages]
        self.dtypes = [f.dtype for f in fulls]


class UnitRun:
    """The per-unit machinery of one step on one rank."""

    def __init__(
        self,
        mesh: Mesh,
        layout: ShardLayout,
        shards: tuple[torch.Tensor, ...],
        local: tuple[torch.Tensor, ...] | None,
        *,
        reshard: bool,
        prefetch: bool,
        order: list[str],
        ledger: UnitLedger | None,
    ) -> None:
        self.mesh, self.layout, self.shards = mesh, layout, shards
        self.local = local  # stage 2: this rank's full replicated buckets; stage 3: None
        self.reshard = reshard and local is None
        self.prefetch = prefetch and local is None
        self.order = order  # unit call order seen in the previous step (same on every rank)
        self.ledger = ledger
        self.calls: list[_Call] = []
        self.pending: dict[str, list[tuple[torch.Tensor, Any]]] = {}  # prefetched gathers
        self.extra: dict[int, torch.Tensor] = {}  # bucket -> fallback shard gradient
        # Local gradient accumulation (DDP's no_sync): full gradients summed here, per
        # bucket, across micro-batches; reduce-scattered only on the final micro-batch.
        self.acc: dict[int, torch.Tensor] | None = None
        self.final = True
        # Reduce-scatters in flight: (bucket, out, work, full gradient, unit, whether `out`
        # still needs dividing by the mesh size). At most `max_inflight` stay unfinished,
        # so a unit's reduction overlaps the backward of the units before it while full
        # gradients stay bounded (0: synchronous).
        self.max_inflight = 1
        self.replicate = False  # stage 0: all-reduce whole gradients instead
        self.inflight: list[tuple[int, torch.Tensor, Any, torch.Tensor, str, bool]] = []
        self.bursts: Bursts | None = None  # stage 0: unit gradients written into bursts
        # The forward's calls, in call order (`enlist`); their gradients are reduced newest
        # first, a call that arrives early waiting in `ready` for the ones before it.
        self.ordered: list[_Call] = []
        self.ready: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.next = -1  # the next call (`order`) to reduce
        self.reduced: dict[int, torch.Tensor] = {}  # bucket -> finished shard gradient (sum)
        # Stages 0-1 (DDP's bucket_cap_mb): complete unit gradients wait here until at least
        # `hold_bytes` of them are ready, then their reductions start together.
        self.hold_bytes = 0
        self.held: list[tuple[int, torch.Tensor, str]] = []
        self.held_bytes = 0
        # Stage 1: a burst's reductions are finished as soon as the next unit's gradient
        # arrives, so the burst's full gradients go back to the allocator during the
        # backward and the next units' gradients reuse them. With every burst alive until
        # the end of the backward, each step handed ~a model's worth of gradient memory
        # back to glibc, which trimmed it and page-faulted it back in the next backward.
        self.drain = False
        # Communication dtypes (mixed precision); None: the buckets' own dtype.
        self.gather_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        # The forward's unit calls being compared across ranks (`agree`), until checked.
        self.agreement: Agreement | None = None

    # -- forward -------------------------------------------------------------------------
    def materialize(self, unit: str) -> tuple[torch.Tensor, ...]:
        """The unit's full buckets for a new call: local (stage 2) or all-gathered (stage 3)."""
        idx = self.layout.unit_buckets(unit)
        if self.local is not None:
            return tuple(self.local[i].detach() for i in idx)
        started = self.pending.pop(unit, None) or self._start_gather(unit)
        for _, work in started:
            if work is not None:
                work.wait()
        return tuple(out for out, _ in started)

    def _start_gather(self, unit: str) -> list[tuple[torch.Tensor, Any]]:
        self._agreed()  # a gather in the backward (a checkpoint's recompute) comes after it
        out = []
        for i in self.layout.unit_buckets(unit):
            full, work = _comm.all_gather_async(
                self.shards[i].detach(), self.mesh, dtype=self.gather_dtype
            )
            self._log("params", unit, full.numel() * full.element_size())
            out.append((full, work))
        return out

    def prefetch_next(self, unit: str) -> None:
        """Starts gathering the unit that followed `unit` last step, if it is not resident."""
        if not self.prefetch or unit not in self.order:
            return
        k = self.order.index(unit) + 1
        if k < len(self.order):
            nxt = self.order[k]
            if nxt != unit and nxt not in self.pending:
                self.pending[nxt] = self._start_gather(nxt)

    def release(self, call: _Call) -> None:
        """Frees a call's gathered storage (stage 3); views of it stay valid objects."""
        if self.local is None and call.resident:
            for storage, nbytes in zip(call.storages, call.nbytes):
                storage.resize_(0)
                self._log("params", call.unit, -nbytes)
            call.resident = False

    def refill(self, call: _Call, wait: bool = True) -> None:
        """Gathers a freed call's storage again, in place; async when `wait` is False."""
        if call.resident:
            return
        if call.refill is None:
            self._agreed()
            call.refill = []
            for i, storage, nbytes, dtype in zip(
                self.layout.unit_buckets(call.unit), call.storages, call.nbytes, call.dtypes
            ):
                storage.resize_(nbytes)
                into = torch.empty(0, dtype=dtype, device=self.shards[i].device)
                into.set_(storage, 0, (nbytes // into.element_size(),))
                call.refill.append(
                    _comm.all_gather_async(
                        self.shards[i].detach(), self.mesh, out=into, dtype=self.gather_dtype
                    )
                )
                self._log("params", call.unit, nbytes)
        if wait:
            for _, work in call.refill:
                if work is not None:
                    work.wait()
            call.resident, call.refill = True, None

    def agree(self) -> None:
        """Starts checking that every rank's forward called the same units in the same
        order (see `_agree`); the backward's first collective waits for the answer."""
        device = self.shards[0].device if self.shards else None
        self.agreement = start_agreement([c.unit for c in self.calls], self.mesh, device)

    def _agreed(self) -> None:
        if self.agreement is not None:
            agreement, self.agreement = self.agreement, None
            agreement.check(self.mesh)

    # -- backward ------------------------------------------------------------------------
    def enlist(self, call: _Call) -> None:
        """Gives a call made by the forward its place in the order every rank reduces in.

        Reductions pair up across ranks by the order they are started in, so that order
        must not depend on which calls a rank's loss reached: a call that carries no
        gradient on one rank (its output unused there) is reduced, as zeros, in the same
        place as on the ranks where it does. The order is the reverse of the forward's,
        which is autograd's order for a chain of units. Calls made inside the backward (a
        checkpoint's recompute) never carry a gradient, and a unit with nothing trainable
        has nothing to reduce: neither takes a place (`settle` sees to them).
        """
        idx = self.layout.unit_buckets(call.unit)
        if torch._C._current_graph_task_id() != -1 or all(
            self.layout.buckets[i].frozen for i in idx
        ):
            return
        call.order = self.next = len(self.ordered)
        self.ordered.append(call)

    def backward(self, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """One call's share of its node's backward: its gradients (one per bucket; writing
        into bursts, one per leaf in `unit_paths` order, None: unused) are reduced in the
        order of `enlist`."""
        if call.order is None:
            return self._reduce_call(call, grads)
        self.ready[call.order] = grads
        while self.next in self.ready:
            self.next -= 1
            self._reduce_call(self.ordered[self.next + 1], self.ready.pop(self.next + 1))
        return (None,) * len(self.layout.unit_buckets(call.unit))

    def _reduce_call(self, call: _Call, grads: tuple[Any, ...] | None) -> tuple[Any, ...]:
        """Reduces one call's gradients (as `backward` receives them; None: its backward
        never ran on this rank, so zeros)."""
        idx = self.layout.unit_buckets(call.unit)
        if self.bursts is not None:
            unused = (None,) * len(self.layout.unit_paths(call.unit))
            return self._into_bursts(call, grads or unused)
        if grads is None:
            grads = tuple(
                None
                if (b := self.layout.buckets[i]).frozen
                else torch.zeros(b.full_numel, dtype=b.dtype, device=self.shards[i].device)
                for i in idx
            )
        return self.reduce(call, grads)

    def _by_bucket(self, unit: str, grads: Sequence[Any]) -> list[tuple[int, Sequence[Any]]]:
        out, k = [], 0
        for i in self.layout.unit_buckets(unit):
            n = len(self.layout.buckets[i].slots)
            out.append((i, grads[k : k + n]))
            k += n
        return out

    def _into_bursts(self, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """Stage 0: the call's gradients, divided by the mesh size, go straight into the open
        burst of their reduce dtype; a burst is all-reduced (in place) once full."""
        assert self.bursts is not None
        out: list[Any] = []
        for i, part in self._by_bucket(call.unit, grads):
            b = self.layout.buckets[i]
            out.append(None)  # collected by `finish`, after the backward
            if b.frozen:
                continue
            dtype = self.reduce_dtype or b.dtype
            device = self.shards[i].device
            view, closed = self.bursts.take(i, b.full_numel, dtype, device, call.unit)
            if closed is not None:
                self._issue_burst(closed)
            paste(b, part, view, self.mesh.size)
            self._log("grads", call.unit, view.numel() * view.element_size())
        call.reduced = True
        for burst in self.bursts.full():
            self._issue_burst(burst)
        while len(self.inflight) > self.max_inflight:
            self._finish_oldest()
        return tuple(out)

    def _issue_burst(self, burst: Burst) -> None:
        self._agreed()
        # Owned and already in the reduce dtype: reduced in place, so each part's view of
        # the buffer holds that bucket's mean once the work is done.
        flat, work = _comm.all_reduce_async(burst.filled, self.mesh, owned=True)
        ends = [start for _, start, _ in burst.parts[1:]] + [burst.used]
        for (i, start, unit), end in zip(burst.parts, ends):
            view = flat[start:end]
            self.inflight.append((i, view, work, view, unit, False))

    def reduce(self, call: _Call, grads: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        """The unit's shard gradients: the reduce-scatter (mean) of its full gradients.

        Frozen buckets have no gradient and cost no communication (None).
        """
        if self.drain:
            while self.inflight:
                self._finish_oldest()
        idx = self.layout.unit_buckets(call.unit)
        frozen = [self.layout.buckets[i].frozen for i in idx]
        nbytes = sum(g.numel() * g.element_size() for g, f in zip(grads, frozen) if not f)
        self._log("grads", call.unit, nbytes)
        out: list[Any] = []
        for i, g, f in zip(idx, grads, frozen):
            if f:
                out.append(None)
            elif self.acc is not None and not self.final:  # hold it: no communication yet
                self.acc[i] = self.acc[i] + g if i in self.acc else g.clone()
                self._log("grads", call.unit, -g.numel() * g.element_size())
                out.append(None)
            else:
                if self.acc is not None and i in self.acc:
                    g = g + self.acc.pop(i)  # earlier micro-batches, reduced together now
                self.held.append((i, g, call.unit))
                self.held_bytes += g.numel() * g.element_size()
                out.append(None)  # collected by `finish`, after the backward
        call.reduced = True
        self.release(call)
        if self.held_bytes >= self.hold_bytes:
            self._issue()
        while len(self.inflight) > self.max_inflight:
            self._finish_oldest()
        return tuple(out)

    def _issue(self) -> None:
        """Starts the reductions of every held gradient, oldest first."""
        for i, g, unit in self.held:
            shard, work = self._start_reduce(g)
            self.inflight.append((i, shard, work, g, unit, True))
        self.held.clear()
        self.held_bytes = 0

    def _start_reduce(self, g: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self._agreed()
        # Stage 0 keeps every gradient (all-reduce); stages 1-3 keep their slice.
        # `g` is this step's own gradient buffer (from autograd or a fresh sum): owned.
        if self.replicate:
            return _comm.all_reduce_async(g, self.mesh, dtype=self.reduce_dtype, owned=True)
        return _comm.reduce_scatter_async(g, self.mesh, dtype=self.reduce_dtype, owned=True)

    def _reduce_now(self, g: torch.Tensor) -> torch.Tensor:
        out, work = self._start_reduce(g)
        if work is not None:
            work.wait()
        return out.div_(self.mesh.size) if self.mesh.size > 1 else out

    def _finish_oldest(self) -> None:
        i, shard, work, g, unit, divide = self.inflight.pop(0)
        if work is not None:
            work.wait()  # a burst's parts share one work: waiting again returns at once
        if divide and self.mesh.size > 1:  # the mean; one rank's sum is already it
            shard.div_(self.mesh.size)
        self.reduced[i] = self.reduced[i] + shard if i in self.reduced else shard
        self._log("grads", unit, -g.numel() * g.element_size())

    def finish(self) -> None:
        """Reduces the forward's calls still waiting (zeros for those whose backward never
        ran on this rank), then waits for every reduction still in flight."""
        self._agreed()  # also when nothing is reduced (everything frozen)
        while self.next >= 0:
            self._reduce_call(self.ordered[self.next], self.ready.pop(self.next, None))
            self.next -= 1
        self._issue()
        for burst in self.bursts.close_all() if self.bursts is not None else ():
            self._issue_burst(burst)
        while self.inflight:
            self._finish_oldest()

    def settle(self) -> None:
        """Reduce-scatters zeros for the calls a checkpoint's recompute made (outside the
        order of `enlist`; their backward never runs), newest first, the same on every rank.
        """
        for call in reversed(self.calls):
            if call.refill is not None:  # a prefetched re-gather still in flight
                self.refill(call)
            if call.reduced:
                continue
            for i in self.layout.unit_buckets(call.unit):
                b = self.layout.buckets[i]
                if b.frozen:
                    continue
                zero = torch.zeros(b.full_numel, dtype=b.dtype, device=self.shards[i].device)
                part = self._reduce_now(zero)
                self.extra[i] = self.extra[i] + part if i in self.extra else part
            call.reduced = True
            self.release(call)
        if self.acc is not None and self.final:
            # Buckets accumulated earlier but unused in the final micro-batch: every rank
            # holds the same set, so reducing them in bucket order keeps ranks in step.
            for i in sorted(self.acc):
                part = self._reduce_now(self.acc.pop(i))
                self.extra[i] = self.extra[i] + part if i in self.extra else part
        for unit, started in self.pending.items():  # prefetched but never used
            for full, work in started:
                if work is not None:
                    work.wait()
                self._log("params", unit, -full.numel() * full.element_size())
        self.pending.clear()

    def _log(self, kind: str, unit: str, nbytes: int) -> None:
        if self.ledger is not None:
            self.ledger._add(kind, unit, nbytes)
