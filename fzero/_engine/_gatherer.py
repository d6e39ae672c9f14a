"""Gatherer: stage 3's parameter source, the all-gather of every rank's shard.

A unit's gather starts ahead of its entry where last step says it comes next
(`prefetch`). With `reshard`, autograd saves a `Handle` to a just-in-time unit's
parameters (`pack`) instead of the tensor, the gathered buffer is freed once the forward
is done with it (`left`, or the loss letting go of it), and the backward gathers it again
(`unpack`) in one order on every rank (`_regather_through`), except the forward's last
entries (`keep_last`) and units no rank's backward uses (`flags`, OR-ed by the call
check). hpZ (`secondary`) gathers again from each rank's 1/k copy inside its group.
docs/design.md explains each: [Note: resharding], [Note: one re-gather order],
[Note: hpZ and qwZ].
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _comm
from ._callcheck import CallCheck
from ._context import Context
from ._entry import Entry, in_backward
from ._source import ParamSource
from ._unit_ledger import Counted


@dataclass(eq=False)
class _Gathered:
    """What the gatherer keeps of one entry: its full buffers, held or followed."""

    entry: Entry
    held: list[torch.Tensor | None]  # per bucket; None while the loss alone holds it
    followed: list[Any] = field(default_factory=list)  # weak references to dropped buffers
    refill: list[Any] = field(default_factory=list)  # (bucket position, full, work) in flight
    secondary: list[torch.Tensor] = field(default_factory=list)  # hpZ: this rank's 1/k slices
    regathered: bool = False  # gathered again (once per micro-batch: held until reduced)


def _forget(
    by_storage: dict[int, tuple[_Gathered, int]], key: int, found: tuple[_Gathered, int]
) -> None:
    """A followed buffer's Python object is gone: forgets its address, unless it now
    belongs to another buffer. A buffer freed by `left` can outlive its memory (gloo's
    worker may still hold the gather) while the allocator hands its address to a later
    gather, whose parameters autograd would then save outright, freed under it."""
    if by_storage.get(key) is found:
        del by_storage[key]


class Handle(NamedTuple):
    """What autograd saves of a resharded unit's parameter: no tensor, only where it is."""

    gathered: _Gathered
    k: int  # position of the bucket within the entry
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool


class Gatherer(ParamSource):
    """Stage 3: a unit enters as the all-gather of every rank's shard (see the module)."""

    def __init__(
        self,
        ctx: Context,
        shards: tuple[torch.Tensor, ...],
        check: CallCheck,
        order: Sequence[str],
        device: torch.device | None = None,
    ) -> None:
        """`shards`: this rank's shard of every bucket. `check`: the micro-batch's call
        check, waited for before a backward collective. `order`: the just-in-time units
        last step called, in order (the same on every rank). `device`: where the units
        compute, if a shard is held elsewhere (on the host: copied over to be gathered)."""
        s = ctx.schedule
        self.mesh, self.layout, self.shards, self.device = ctx.mesh, ctx.layout, shards, device
        self.dtype, self.prefetch, self.reshard = s.gather_dtype, s.prefetch, s.reshard
        self.quant, self.secondary, self.keep_last = s.quant_gather, s.secondary, s.keep_last
        self.ledger, self.pool, self.check = ctx.ledger, ctx.pool, check
        self.order = list(order)
        self.calls = self.entries = 0  # just-in-time entries the forward has resharded, made
        self.records: dict[Entry, _Gathered] = {}
        self.kept: list[_Gathered] = []  # entries that `keep_last` exempts from resharding
        self.needed: set[str] = set()  # units whose parameters this rank's backward may use
        self.agreed: set[str] | None = None  # the same, OR-ed over the ranks by the check
        self.pending: dict[str, list[tuple[torch.Tensor, Any]]] = {}  # started ahead
        self.followed: list[_Gathered] = []  # resharded entries, in forward order
        self.turn: int | None = None  # the next of them to gather again, in the backward
        self.by_storage: dict[int, tuple[_Gathered, int]] = {}  # data_ptr -> followed buffer
        self.counted: WeakIdKeyDictionary = WeakIdKeyDictionary()  # buffer -> ledger entry

    # -- forward -------------------------------------------------------------------------
    def open(self, entry: Entry, jit: bool) -> tuple[torch.Tensor, ...]:
        started = self.pending.pop(entry.unit, None) or self._start(entry.unit)
        for _, work in started:
            if work is not None:
                work.wait()
        fulls = tuple(full for full, _ in started)
        # Held until the unit's gradient is reduced, unless resharded below; a
        # checkpoint's recompute (inside the backward) needs them until the unit's own
        # backward.
        rec = self.records[entry] = _Gathered(entry, list(fulls))
        forward = jit and self.reshard and not in_backward()
        if forward and self._reshards():
            # Followed, not held. After a backward inside the loss, the re-gathers start anew.
            self.turn, self.agreed = None, None
            rec.held = [None] * len(fulls)
            if self.secondary is not None:
                rec.secondary = [self._slice(f) for f in fulls]
            rec.followed = [weakref.ref(f) for f in fulls]
            for k, f in enumerate(fulls):
                if f.numel():
                    key = f.untyped_storage().data_ptr()
                    found = self.by_storage[key] = (rec, k)
                    weakref.finalize(f, _forget, self.by_storage, key, found)
            self.followed.append(rec)
            self.computes(entry)
        elif forward:
            self.kept.append(rec)
        return fulls

    def _reshards(self) -> bool:
        """Whether the forward's next just-in-time entry is resharded: all but the last
        `keep_last` of as many as last step made, and any past those (all on a first step
        or with nothing kept). Every rank decides alike: their re-gathers pair up."""
        self.calls += 1
        if not self.keep_last or not self.order or self.calls > len(self.order):
            return True
        return len(self.order) - self.calls >= self.keep_last

    def flags(self) -> list[bool]:
        """Per unit of the layout, whether this rank's backward may use its parameters
        (none without resharding)."""
        return [u in self.needed for u in self.layout.units] if self.reshard else []

    def again(self, entry: Entry) -> tuple[torch.Tensor, ...]:
        """`entry`'s full parameters once more, inside the backward (for a recompute):
        held, or gathered again in the one order of `_regather_through`."""
        rec = self.records[entry]
        return tuple(self._full(rec, k) for k in range(len(entry.buckets)))

    def aliases(self, entries: Sequence[Entry]) -> list[tuple[int, torch.Tensor]]:
        out: list[tuple[int, torch.Tensor]] = []
        for rec in filter(None, map(self.records.get, entries)):
            fulls = [r() for r in rec.followed] if rec.followed else rec.held
            out += [(i, f) for i, f in zip(rec.entry.buckets, fulls) if f is not None]
        return out

    def _start(self, unit: str) -> list[tuple[torch.Tensor, Any]]:
        self.check.before_collective()  # a gather inside the backward comes after the check
        return [self._gather(i, unit) for i in self.layout.unit_buckets(unit)]

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's 1/k of a gathered buffer, kept for the backward (hpZ)."""
        ax = self.secondary
        assert ax is not None
        n = full.numel() // ax.size
        return full.narrow(0, ax.rank * n, n).clone()

    def _gather(
        self, i: int, unit: str, rec: _Gathered | None = None, k: int = 0
    ) -> tuple[torch.Tensor, Any]:
        if rec is not None and self.secondary is not None:
            # hpZ: from the slices kept at the forward, inside the group; exact values
            # (no quantization or dtype again: they are what the forward computed with).
            part = rec.secondary[k]
            out = self.pool.take(part.numel() * self.secondary.size, part.dtype, part.device)
            full, work = _comm.all_gather_async(part, self.secondary, out=out)
        else:
            # Into a buffer of the compute dtype (the layout's): a shard held at higher
            # precision (an fp32 master) is gathered as its cast (`_comm.all_gather_async`).
            shard, dtype = self.shards[i].detach(), self.layout.buckets[i].dtype
            if self.device is not None and shard.device != self.device:
                # A host shard (`Offload(params=True)`): over to the device for its gather,
                # asynchronously from pinned memory; the copy lives until the gather ends.
                shard = shard.to(self.device, non_blocking=shard.is_pinned())
            out = self.pool.take(shard.numel() * self.mesh.shard.size, dtype, shard.device)
            full, work = _comm.all_gather_async(
                shard,
                self.mesh,
                out=out,
                dtype=self.dtype,
                quant=self.quant,
                what=f"rank {self.mesh.rank}: the parameters of unit {unit!r}",
            )
        if self.ledger is not None:
            counted = self.counted[full] = Counted(self.ledger, unit, full)
            weakref.finalize(full, counted.close)
        return full, work

    def start(self, upfront: Sequence[str]) -> None:
        """At the start of the forward: starts gathering the units entered before it
        (`upfront`), all together, then (with `prefetch`) the first units of last step's
        order up to the size of its largest unit ([Note: the forward's first gathers])."""
        for unit in upfront:
            self._ahead(unit)
        if not self.prefetch or not self.order:
            return
        budget = max(self.layout.unit_numel(u) for u in self.order)
        for unit in dict.fromkeys(self.order):
            if budget <= 0:
                break
            self._ahead(unit)
            budget -= self.layout.unit_numel(unit)

    def entered(self, unit: str) -> None:
        """Starts gathering the unit after this entry in last step's order (after `unit`'s
        first entry there where this forward left that order), unless already started."""
        self.entries += 1
        k = self.entries
        if not (k <= len(self.order) and self.order[k - 1] == unit):
            k = self.order.index(unit) + 1 if unit in self.order else len(self.order)
        if self.prefetch and k < len(self.order) and self.order[k] != unit:
            self._ahead(self.order[k])

    def _ahead(self, unit: str) -> None:
        """Starts gathering `unit` before the forward enters it, unless already started."""
        if unit not in self.pending:
            self.pending[unit] = self._start(unit)

    def computes(self, entry: Entry) -> None:
        """A resharded entry whose forward runs under saved-tensor hooks not the step's
        (a checkpoint's: begun before the entry, or pushed by its layer's own pre-hook)
        saves nothing through `pack`: its backward may recompute with it."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        mine = top is not None and (top(False) or [None])[0] == self.pack
        rec = self.records.get(entry)
        if rec is not None and rec.followed and not mine:
            self.needed.add(entry.unit)

    def left(self, entry: Entry) -> None:
        """The forward is done with `entry` (its submodule's forward hook ran): frees its
        gathered parameters now, not when their last reference goes (gloo's worker thread
        holds a finished collective's tensors until it gets round to releasing them)."""
        for full in self.freed(entry):
            self._free(full)
        self.records[entry].followed = []

    def freed(self, entry: Entry) -> list[torch.Tensor]:
        return [f for f in (r() for r in self.records[entry].followed) if f is not None]

    def _free(self, full: torch.Tensor) -> None:
        """Frees `full`'s memory now (its views stay valid objects, with no data), or, a
        pooled buffer, leaves it to come back to the pool once nothing refers to it."""
        storage = full.untyped_storage()
        # Forget it before the allocator can hand its address to another tensor.
        self.by_storage.pop(storage.data_ptr(), None)
        if not self.pool.pools(full):
            storage.resize_(0)
        counted = self.counted.get(full)
        if counted is not None:
            counted.close()

    # -- saved tensors: handles instead of resharded parameters -------------------------
    def saving(self) -> AbstractContextManager[Any]:
        """While the forward runs, autograd saves resharded parameters as handles."""
        if self.reshard:
            return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        return contextlib.nullcontext()

    def pack(self, t: torch.Tensor) -> Any:
        found = self.by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if found is None:
            return t
        rec, k = found
        self.needed.add(rec.entry.unit)
        return Handle(rec, k, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, Handle):
            return saved
        full = self._full(saved.gathered, saved.k)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def hold(self, t: Any) -> Any:
        """A handle if `t` is a resharded unit's parameter (`pack`)."""
        return self.pack(t) if self.reshard and isinstance(t, torch.Tensor) else t

    def fetch(self, held: Any) -> Any:
        """`t` again (gathered again if it was freed)."""
        if not isinstance(held, Handle):
            return held
        t = self.unpack(held)
        return t.detach().requires_grad_() if held.requires_grad else t

    # -- backward ------------------------------------------------------------------------
    def _full(self, rec: _Gathered, k: int) -> torch.Tensor:
        """Bucket `k` of an entry's full parameters for the backward (`_regather_through`)."""
        held = rec.held[k]
        if held is None:
            i = self.followed.index(rec)
            self._regather_through(i)
            self._wait(rec)
            if self.prefetch:  # the unit whose backward comes next
                self._regather_next(i)
            held = rec.held[k]
        if held is None:
            raise RuntimeError(
                f"rank {self.mesh.rank}: the backward asked for the parameters of unit "
                f"{rec.entry.unit!r}, which no rank's forward saved: saved-tensor hooks of "
                "your own inside the loss (install them around the step), or a layer "
                "calling .backward() in its backward (Reformer, RevNets: checkpoint instead)"
            )
        return held

    def _agreed(self) -> set[str]:
        """The units some rank's backward may use the parameters of (see the module)."""
        if self.agreed is None:
            flags = self.check.before_collective()
            self.agreed = (
                self.needed
                if flags is None
                else {u for u, f in zip(self.layout.units, flags, strict=True) if f}
            )
        return self.agreed

    def _regather_next(self, i: int) -> None:
        """Starts gathering again the newest resharded entry below `followed[i]` that a
        backward may use (and skips the ones between, which none does)."""
        agreed = self._agreed()
        for j in range(i - 1, -1, -1):
            if self.followed[j].entry.unit in agreed:
                self._regather_through(j)
                return

    def _regather_through(self, i: int) -> None:
        """Starts gathering resharded entries again, newest first, down to `followed[i]`:
        each entry of a unit some rank's backward may use (`_agreed`) exactly once per
        backward, in this one order on every rank ([Note: one re-gather order]).
        """
        if self.turn is None:
            self.turn = len(self.followed) - 1
        while self.turn >= max(i, 0):
            rec = self.followed[self.turn]
            self.turn -= 1
            if rec.entry.unit not in self._agreed() or rec.regathered:
                continue  # no backward uses it (after the check), or one in the loss did
            rec.regathered = True
            rec.refill = [
                (k, *self._gather(j, rec.entry.unit, rec, k))
                for k, j in enumerate(rec.entry.buckets)
            ]

    def _wait(self, rec: _Gathered) -> None:
        for k, full, work in rec.refill:
            if work is not None:
                work.wait()
            rec.held[k] = full
        rec.refill = []
        rec.secondary = []

    def reduced(self, entry: Entry) -> None:
        """Frees an entry's parameters once its gradient is reduced: every op that used
        them has run its backward by then (the unit's node runs after all its consumers).
        A re-gather still in flight for it is left to `settle`: waiting for it here could
        wait for a peer that is itself waiting for this rank's next reduction."""
        rec = self.records[entry]
        for full in rec.held:
            if full is not None:
                self._free(full)
        rec.held = [None] * len(rec.held)
        if self.prefetch and self.followed and any(r is rec for r in self.kept):
            # The backward is past a kept entry: the newest resharded one is next.
            self._regather_next(len(self.followed))

    def end_backward(self) -> None:
        """Before the end of the backward waits for any reduction: starts the re-gathers
        this rank's backward did not ask for, which a peer's backward may be waiting in."""
        if self.followed:
            self._regather_through(0)

    def end_forward(self, entries: Sequence[Entry]) -> None:
        """A forward without a backward (`sharded_forward`) is over: frees what it
        gathered, and finishes the gathers started ahead for a unit it never called."""
        for entry in entries:
            self.left(entry)
            self.reduced(entry)
        self.followed = []
        self.settle()

    def settle(self) -> None:
        """After the backward: finishes and frees the re-gathers, and drops gathers that
        were started ahead for a unit the step never called."""
        self.end_backward()
        for rec in self.followed:
            self._wait(rec)
            self.reduced(rec.entry)
        for started in self.pending.values():
            for _, work in started:
                if work is not None:
                    work.wait()
        self.pending.clear()
