"""The forward half of a stage-3 step's units: where a unit's full parameters come from.

(Stages 0-2 have them at hand: `_replicated.Replica`.)

`Gathers` (stage 3): the all-gather of every rank's shard, started ahead for the unit that
came next last step (`prefetch`). Resharding after the forward (`reshard`): while the
loss runs, autograd saves a *handle* to a just-in-time unit's parameters (`pack`: which
call, which bucket, where in it) instead of the tensor, and the step follows the gathered
buffer only weakly. Once the forward is done with it, it is freed: when its submodule's
forward hook runs (`drop`), or, for a unit a pure loss took with `fzero.gathered`, when
the loss lets go of it (reference counting, as in JAX). The backward gathers it again
(`unpack`), in one order on every rank (`regather_through`). Units entered before the
forward (the root, containers, everything without just-in-time entry) stay gathered
until their gradient is reduced, and so do the forward's last calls (`keep_last`): the
backward starts with them, so freeing them would only gather them again at once.

A resharded unit whose parameters no rank's autograd saved (an embedding's backward needs
only the indices; a first layer's input needs no gradient) is not gathered again: each
rank flags the units it saved a handle to (`pack`), or entered where other saved-tensor
hooks than the step's are on top (a checkpointed region, whose recompute may enter them
again), and the call check ORs the flags over the ranks (`_agree`), so that every rank
gathers again the same units.

hpZ (`secondary`): as a resharded unit is gathered, each rank keeps its 1/k slice of the
full buffer, and the backward gathers it again from those slices along the secondary
axis (k ranks inside a group) instead of from the shards across the whole shard axis.
qwZ (`quant`): the shards travel as int8 blocks; the secondary copy is cut from what
the forward computed with, so the backward sees the same values.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _comm
from .._comm import Axis, Mesh
from .._core import ShardLayout
from ._entry import Call, in_backward
from ._pool import Pool
from ._unit_ledger import UnitLedger


def _forget(by_storage: dict[int, tuple[Call, int]], key: int, entry: tuple[Call, int]) -> None:
    """A followed buffer's Python object is gone: forgets its address, unless the address
    now belongs to another buffer. A buffer freed by `drop` can outlive its memory (gloo's
    worker thread may still hold the finished gather), and the allocator hands that
    address to a later gather; forgetting the address then would make autograd save that
    gather's parameters outright, and `drop` free them under it."""
    if by_storage.get(key) is entry:
        del by_storage[key]


class Handle(NamedTuple):
    """What autograd saves of a resharded unit's parameter: no tensor, only where it is."""

    call: Call
    k: int  # position of the bucket within the call
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool


class _Counted:
    """A gathered buffer in the ledger: counted from its gather until it is freed, once."""

    def __init__(self, ledger: UnitLedger, unit: str, full: torch.Tensor) -> None:
        self.ledger: UnitLedger | None = ledger
        self.unit, self.nbytes = unit, full.numel() * full.element_size()
        ledger._add("params", unit, self.nbytes)

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger._add("params", self.unit, -self.nbytes)
            self.ledger = None


class Gathers:
    """Stage 3: a unit enters as the all-gather of every rank's shard (see the module)."""

    def __init__(
        self,
        mesh: Mesh,
        layout: ShardLayout,
        shards: tuple[torch.Tensor, ...],
        *,
        dtype: torch.dtype | None,
        quant: int | None = None,
        secondary: Axis | None = None,
        prefetch: bool,
        reshard: bool,
        keep_last: int = 0,
        order: list[str],
        ledger: UnitLedger | None,
        before: Callable[[], list[bool] | None],
        pool: Pool,
    ) -> None:
        self.mesh, self.layout, self.shards = mesh, layout, shards
        self.dtype, self.prefetch, self.reshard = dtype, prefetch, reshard
        self.quant, self.secondary = quant, secondary
        self.order = order  # just-in-time units in last step's call order (same on every rank)
        self.keep_last = keep_last  # the forward's last calls stay gathered (`Schedule`)
        self.entered = 0  # just-in-time calls the forward has made
        self.kept: list[Call] = []  # calls that `keep_last` exempts from resharding
        self.ledger = ledger
        self.pool = pool  # where gathered buffers come from (host ones are reused)
        self.before = before  # waits for the call check before a backward collective
        self.needed: set[str] = set()  # units whose parameters this rank's backward may use
        self.agreed: set[str] | None = None  # the same, OR-ed over the ranks by the check
        self.pending: dict[str, list[tuple[torch.Tensor, Any]]] = {}  # started ahead
        self.followed: list[Call] = []  # resharded calls, in forward order
        self.turn: int | None = None  # the next of them to gather again, in the backward
        self.by_storage: dict[int, tuple[Call, int]] = {}  # data_ptr -> followed buffer
        self.counted: WeakIdKeyDictionary = WeakIdKeyDictionary()  # buffer -> ledger entry

    # -- forward -------------------------------------------------------------------------
    def open(self, call: Call, jit: bool) -> tuple[torch.Tensor, ...]:
        started = self.pending.pop(call.unit, None) or self._start(call.unit)
        for _, work in started:
            if work is not None:
                work.wait()
        fulls = tuple(full for full, _ in started)
        forward = jit and self.reshard and not in_backward()
        if forward and self._reshards():
            if not self._hooks_on_top():
                self.needed.add(call.unit)
            # Followed, not held: the forward's references decide when it is freed.
            call.held = [None] * len(fulls)
            if self.secondary is not None:
                call.secondary = [self._slice(f) for f in fulls]
            call.followed = [weakref.ref(f) for f in fulls]
            for k, f in enumerate(fulls):
                if f.numel():
                    key = f.untyped_storage().data_ptr()
                    entry = self.by_storage[key] = (call, k)
                    weakref.finalize(f, _forget, self.by_storage, key, entry)
            self.followed.append(call)
        else:
            # Held until the unit's gradient is reduced; a checkpoint's recompute (inside
            # the backward) needs them until the unit's own backward.
            call.held = list(fulls)
            if forward:
                self.kept.append(call)
        return fulls

    def _reshards(self) -> bool:
        """Whether the forward's next just-in-time call is resharded: all but the last
        `keep_last` of as many calls as last step made (the first step: every one). Every
        rank decides alike, so their sequences of re-gathers pair up."""
        self.entered += 1
        return not self.order or len(self.order) - self.entered >= self.keep_last

    def _hooks_on_top(self) -> bool:
        """Whether the saved-tensor hooks autograd uses now are the step's own (`pack`)."""
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        return top is not None and (top(False) or (None,))[0] == self.pack

    def flags(self) -> list[bool]:
        """For the call check to OR over the ranks: per unit of the layout, whether this
        rank's backward may use its parameters (none without resharding)."""
        return [u in self.needed for u in self.layout.units] if self.reshard else []

    def again(self, call: Call) -> tuple[torch.Tensor, ...]:
        """`call`'s full parameters once more, inside the backward (for a recompute): held,
        or gathered again in the one order of `regather_through`."""
        return tuple(self.full(call, k) for k in range(len(call.buckets)))

    def _start(self, unit: str) -> list[tuple[torch.Tensor, Any]]:
        self.before()  # a gather inside the backward (a recompute) comes after the check
        return [self._gather(i, unit) for i in self.layout.unit_buckets(unit)]

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's 1/k of a gathered buffer, kept for the backward (hpZ)."""
        ax = self.secondary
        assert ax is not None
        n = full.numel() // ax.size
        return full.narrow(0, ax.rank * n, n).clone()

    def _gather(
        self, i: int, unit: str, call: Call | None = None, k: int = 0
    ) -> tuple[torch.Tensor, Any]:
        if call is not None and self.secondary is not None:
            # hpZ: from the slices kept at the forward, inside the group; exact values
            # (no quantization or dtype again: they are what the forward computed with).
            part = call.secondary[k]
            out = self.pool.take(part.numel() * self.secondary.size, part.dtype, part.device)
            full, work = _comm.all_gather_async(part, self.secondary, out=out)
        else:
            # Into a buffer of the compute dtype (the layout's): a shard held at higher
            # precision (an fp32 master) is gathered as its cast (`_comm.all_gather_async`).
            shard, dtype = self.shards[i].detach(), self.layout.buckets[i].dtype
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
            counted = self.counted[full] = _Counted(self.ledger, unit, full)
            weakref.finalize(full, counted.close)
        return full, work

    def prefetch_first(self, upfront: list[str]) -> None:
        """At the start of the forward, where the step holds least: starts gathering the
        units entered before it (`upfront`), all together, then (with `prefetch`) the first
        units of last step's order, until they add up to its largest unit. The forward
        waits for the up-front units first, and gloo runs a group's collectives in the
        order they start: behind the prefetch, the root's few parameters waited for
        every first unit's gather. Small units first (embeddings) otherwise leave the
        first large unit's gather exposed, as their forward is too short to hide it."""
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

    def prefetch_after(self, unit: str) -> None:
        """Starts gathering the unit that followed `unit` last step, unless already started."""
        if not self.prefetch or unit not in self.order:
            return
        k = self.order.index(unit) + 1
        if k < len(self.order) and self.order[k] != unit:
            self._ahead(self.order[k])

    def _ahead(self, unit: str) -> None:
        """Starts gathering `unit` before the forward enters it, unless already started."""
        if unit not in self.pending:
            self.pending[unit] = self._start(unit)

    def drop(self, call: Call) -> None:
        """The forward is done with `call` (its submodule's forward hook has run): frees
        its gathered parameters now. Waiting for their last reference to go would leave
        it to thread scheduling: gloo's worker thread holds a finished collective's
        tensors until it gets round to releasing them."""
        for ref in call.followed:
            full = ref()
            if full is not None:
                self._free(full)
        call.followed = []

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
    def pack(self, t: torch.Tensor) -> Any:
        found = self.by_storage.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if found is None:
            return t
        call, k = found
        self.needed.add(call.unit)
        return Handle(call, k, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, Handle):
            return saved
        full = self.full(saved.call, saved.k)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    # -- backward ------------------------------------------------------------------------
    def full(self, call: Call, k: int) -> torch.Tensor:
        """Bucket `k` of `call`'s full parameters for the backward (see `regather_through`)."""
        held = call.held[k]
        if held is None:
            i = self.followed.index(call)
            self.regather_through(i)
            self._wait(call)
            if self.prefetch:  # the unit whose backward comes next
                self._regather_next(i)
            held = call.held[k]
        if held is None:
            raise RuntimeError(
                f"rank {self.mesh.rank}: the backward asked for the parameters of unit "
                f"{call.unit!r}, which no rank's forward saved for it, so it was not "
                "gathered again. Saved-tensor hooks of your own inside the loss hide what "
                "autograd saves from fzero: install them around the step instead"
            )
        return held

    def _agreed(self) -> set[str]:
        """The units some rank's backward may use the parameters of (see the module)."""
        if self.agreed is None:
            flags = self.before()
            self.agreed = (
                self.needed
                if flags is None
                else {u for u, f in zip(self.layout.units, flags, strict=True) if f}
            )
        return self.agreed

    def _regather_next(self, i: int) -> None:
        """Starts gathering again the newest resharded call below `followed[i]` that a
        backward may use (and skips the ones between, which none does)."""
        agreed = self._agreed()
        for j in range(i - 1, -1, -1):
            if self.followed[j].unit in agreed:
                self.regather_through(j)
                return

    def regather_through(self, i: int) -> None:
        """Starts gathering resharded calls again, newest first, down to `followed[i]`.

        Every resharded call of a unit some rank's backward may use (`_agreed`, known
        once the call check is in) is gathered again exactly once per backward, in this
        one order on every rank: whether a rank's backward needs a unit (or needs it early)
        depends on its graph, which may differ between ranks (an output used on some ranks
        only), and collectives pair up by the order they start in. A backward that needs a
        unit only moves the sequence on; what no backward asked for is gathered at the end
        (`settle`). Gathers and reductions are separate sequences: gloo matches them
        separately (broadcasts by the shard group's collective count, reduce-scatters by
        the twin group's or by their own message tags, `Axis.twin`), so how the two
        interleave may differ between ranks. (NCCL orders every operation of a
        communicator: it will need them on two.)
        """
        if self.turn is None:
            self.turn = len(self.followed) - 1
        while self.turn >= max(i, 0):
            call = self.followed[self.turn]
            self.turn -= 1
            if call.unit not in self._agreed():  # no backward uses it (after the check)
                continue
            call.refill = [
                (k, *self._gather(j, call.unit, call, k)) for k, j in enumerate(call.buckets)
            ]

    def _wait(self, call: Call) -> None:
        for k, full, work in call.refill:
            if work is not None:
                work.wait()
            call.held[k] = full
        call.refill = []
        call.secondary = []

    def release(self, call: Call) -> None:
        """Frees a call's parameters once its gradient is reduced: every op that used
        them has run its backward by then (the unit's node runs after all its consumers).
        A re-gather still in flight for it is left to `settle`: waiting for it here could
        wait for a peer that is itself waiting for this rank's next reduction."""
        for full in call.held:
            if full is not None:
                self._free(full)
        call.held = [None] * len(call.held)
        if self.prefetch and self.followed and any(c is call for c in self.kept):
            # The backward is past a kept call: the newest resharded one is next.
            self._regather_next(len(self.followed))

    def regather_rest(self) -> None:
        """Before the end of the backward waits for any reduction: starts the re-gathers
        this rank's backward did not ask for, which a peer's backward may be waiting in."""
        if self.followed:
            self.regather_through(0)

    def end_forward(self, calls: list[Call]) -> None:
        """A forward without a backward (`sharded_forward`) is over: frees what it
        gathered, and finishes the gathers started ahead for a unit it never called."""
        for call in calls:
            self.drop(call)
            self.release(call)
        self.followed = []
        self.settle()

    def settle(self) -> None:
        """After the backward: finishes and frees the re-gathers, and drops gathers that
        were started ahead for a unit the step never called."""
        self.regather_rest()
        for call in self.followed:
            self._wait(call)
            self.release(call)
        for started in self.pending.values():
            for _, work in started:
                if work is not None:
                    work.wait()
        self.pending.clear()
