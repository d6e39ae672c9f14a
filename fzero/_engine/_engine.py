"""The engine: one step's units on one rank, for one micro-batch (or one forward without
gradients, `sharded_forward`: the same entries, then everything freed, nothing reduced).

Every stage is the same program. The loss receives the parameter tree; each unit's
parameters enter it through the per-unit primitive (`_entry.enter`): before the forward,
or just in time, when a module hook or `fzero.gathered` asks for the unit. The backward
of each entry hands the unit's gradient to the reductions. What differs by stage is read
from the `Stage` (where the full parameters come from: `Replica` or `Gathers`; which
reduction) and when things happen from the `Schedule`.

The gradient engine is `torch.autograd.grad` on fresh leaf tensors, not
`torch.func.grad`: nodes created mid-forward by hooks, saved-tensor hooks (resharding,
activation checkpointing) and collectives issued from inside the backward are outside
what torch.func's transforms accept. The user's loss may still use torch.func.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .._comm import Mesh
from .._core import (
    PyTree,
    ShardLayout,
    Stage,
    check_loss,
    covers,
    sparse_gradient,
    spec_of,
    subtree,
    subtree_of,
    tree_flatten,
    tree_unflatten,
)
from ._callcheck import CallCheck
from ._entry import Call, enter, in_backward
from ._gathered import ACTIVE
from ._gatherer import Gathers, Handle
from ._hooks import ModuleHooks
from ._placeholder import Placeholder
from ._pool import Pool
from ._reductions import Reductions
from ._schedule import Schedule
from ._source import Replica
from ._unit_ledger import UnitLedger


class Engine:
    """One micro-batch's units on one rank: how each enters the loss, how its gradient
    leaves it (see the module docstring)."""

    def __init__(
        self,
        stage: Stage,
        schedule: Schedule,
        layout: ShardLayout,
        mesh: Mesh,
        grads_like: tuple[torch.Tensor, ...],
        local: tuple[torch.Tensor, ...] | None,
        *,
        ledger: UnitLedger | None,
        order: list[str],
        acc: dict[int, torch.Tensor] | None,
        final: bool,
        followable: bool = True,
        pool: Pool | None = None,
        placeholders: dict[str, list[tuple[int, Placeholder]]] | None = None,
    ) -> None:
        """`grads_like`: per bucket, what this rank's reduced gradient looks like (its
        shard, or the full buffer at stage 0); at stage 3 the shards to gather. `local`:
        the replicated full buffers (stages 0-2). `order`: the just-in-time units called
        last step, updated in place for the next (prefetching). `followable`: `order` is a
        real last step's, which a rank without data may follow. `pool`: where gradient
        bursts and gathered parameters take their host buffers (the step function's,
        kept across calls). `placeholders`: per just-in-time unit, its leaves' index and
        `Placeholder`, made once for the layout (filled in here where missing)."""
        self.s, self.layout, self.mesh, self.order = schedule, layout, mesh, order
        self.followable = followable
        self.leaf_grads = schedule.bursts
        # The autograd leaves the backward differentiates: frozen buckets enter without
        # requires_grad, so they have no gradient and cost no reduction.
        self.inputs = tuple(
            x.detach() if b.frozen else x.detach().requires_grad_()
            for x, b in zip(grads_like, layout.buckets)
        )
        # Shared by both halves, which hold no reference back to the engine: a step's
        # engine is freed (with what it holds) as soon as the step is done with it.
        self.check = CallCheck(mesh)
        pool = Pool() if pool is None else pool
        if stage.enter == "all_gather":
            self.source: Gathers | Replica = Gathers(
                mesh,
                layout,
                self.inputs,
                dtype=schedule.gather_dtype,
                quant=schedule.quant_gather,
                secondary=schedule.secondary,
                prefetch=schedule.prefetch,
                reshard=schedule.reshard,
                keep_last=schedule.keep_last,
                order=order,
                ledger=ledger,
                before=self.check,
                pool=pool,
            )
        else:
            assert local is not None
            self.source = Replica(local)
        self.reductions = Reductions(
            schedule,
            layout,
            mesh,
            [x.device for x in grads_like],
            ledger=ledger,
            acc=acc,
            final=final,
            before=self.check,
            release=self.source.release,
            pool=pool,
        )
        self.calls: list[Call] = []
        self.seen: list[str] = []  # just-in-time units entered by the forward, in order
        self.marks: dict[str, tuple[int, torch.Tensor]] = {}  # unit -> a placeholder leaf
        self.placeholders = {} if placeholders is None else placeholders

    # -- what a unit's node asks of the engine (`_entry.Engine`) ---------------------------
    def open(self, call: Call, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if in_backward():
            twin = self._twin(call.unit)
            if twin is not None:  # a recompute: the forward's parameters, no collective
                call.twin = twin
                return self.source.again(twin)
        fulls = self.source.open(call, call.unit in self.s.jit)
        self.calls.append(call)
        self.reductions.enlist(call)
        return fulls

    def close(self, call: Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        return self.reductions.arrive(call, grads)

    def _twin(self, unit: str) -> Call | None:
        """The forward's latest entry of `unit` whose gradient is not reduced yet.

        A checkpoint recomputes inside the backward of the region it wraps, before the
        backward of the units entered there, so that entry is the one being recomputed:
        reusing its parameters (re-gathered once for the backward if resharded) costs no
        second all-gather and no reduction of its own, and keeps every rank's sequence of
        collectives that of its forward, whether or not it recomputes."""
        for call in reversed(self.calls):
            if call.unit == unit and not call.reduced:
                return call
        return None

    # -- entering units ----------------------------------------------------------------------
    def enter(self, unit: str) -> dict[str, torch.Tensor]:
        """`unit` enters the loss now: views of its full leaves, by path."""
        call = Call(unit, self.layout.unit_buckets(unit))
        out = enter(self, call, tuple(self.inputs[i] for i in call.buckets))
        if unit in self.s.jit and not in_backward():
            self.seen.append(unit)
            self.source.prefetch_after(unit)
        if self.leaf_grads:
            return dict(zip(self.layout.unit_paths(unit), out, strict=True))
        return self.layout.unflatten_unit(unit, out)

    def leave(self, unit: str) -> None:
        """The forward of `unit`'s latest entry is over (its module hook ran)."""
        if not in_backward():
            for call in reversed(self.calls):
                if call.unit == unit:
                    self.source.drop(call)
                    break

    def params(self) -> PyTree:
        """The tree the loss receives: units entered before the forward as views of their
        full parameters, just-in-time units as `Placeholder`s (used anywhere but where
        they enter, they fail loudly instead of training on stale values)."""
        lay = self.layout
        units = [u for u in lay.units if lay.unit_buckets(u)]  # not the empty root
        self.source.prefetch_first([u for u in units if u not in self.s.jit])
        leaves: list[Any] = [None] * len(lay.paths)
        rank = self.mesh.rank
        for unit in units:
            if unit not in self.s.jit:
                for path, view in self.enter(unit).items():
                    leaves[lay.path_index[path]] = view
                continue
            made = self.placeholders.get(unit)
            if made is None:  # they hold no data: the same ones serve every step
                spec = spec_of(lay.unit_members(unit))
                made = self.placeholders[unit] = [
                    (s.index, Placeholder(s.shape, b.dtype, path=s.path, unit=spec, rank=rank))
                    for b in (lay.buckets[i] for i in lay.unit_buckets(unit))
                    for s in b.slots
                ]
            for index, placeholder in made:
                leaves[index] = placeholder
            if made:
                self.marks.setdefault(unit, made[0])
        return tree_unflatten(lay.treedef, leaves)

    def gathered(self, params: PyTree, path: str | tuple[str, ...]) -> Any:
        """`fzero.gathered` inside this step's loss: the units under `path` (or under
        each of a tuple of paths) enter now."""
        lay = self.layout
        leaves, treedef = tree_flatten(params)
        paths = (path,) if isinstance(path, str) else tuple(path)
        if treedef != lay.treedef:  # not the tree this step passed: nothing to enter
            return _pick(path, [subtree(params, p) for p in paths])
        cuts = [subtree_of(lay.treedef, lay.paths, p) for p in paths]
        entered = None
        for unit in dict.fromkeys(u for p in paths for u in lay.units_at(p)):
            mark = self.marks.get(unit)
            if mark is None or leaves[mark[0]] is not mark[1]:
                continue  # entered before the forward, or already in this tree
            if not all(any(covers(p, m) for p in paths) for m in lay.unit_members(unit)):
                spec = spec_of(lay.unit_members(unit))
                raise ValueError(
                    f"rank {self.mesh.rank}: fzero.gathered: {path!r} is only part of "
                    f"the just-in-time unit {unit!r}; ask for the whole unit "
                    f"(fzero.gathered(params, {spec!r})) or split units= finer, since every "
                    "call enters (gathers) the units it names"
                )
            entered = list(leaves) if entered is None else entered
            for p, view in self.enter(unit).items():
                entered[lay.path_index[p]] = view
        tree = leaves if entered is None else entered
        return _pick(path, [cut(tree) for cut in cuts])

    # -- one micro-batch -------------------------------------------------------------------
    def value_and_grad(
        self,
        loss_fn: Callable[[PyTree, Any], torch.Tensor],
        batch: Any,
        after_forward: Callable[[CallCheck | None], None] | None = None,
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """This rank's loss on `batch` and its reduced gradient per bucket.

        `batch` None: this rank has no data, but takes part in every collective of the
        others' micro-batch (`_follow`), contributing zero gradients; its loss is None.
        `after_forward` runs once the forward is done, before the backward (a step starts
        its own small exchange there, so that it runs behind the backward), given the call
        check that is about to start, if any, to send its words along (`CallCheck.carry`)."""
        lay, mesh = self.layout, self.mesh
        trainable = [i for i, b in enumerate(lay.buckets) if not b.frozen]
        loss = None
        token = ACTIVE.set(self)
        try:
            # Hooks and `gathered` stay live through the backward: a checkpoint's
            # recompute enters its units again there.
            with ModuleHooks(self, self.s.hooked):
                with self._saved_tensors():
                    if batch is None:
                        self._follow("step")
                    else:
                        loss = check_loss(loss_fn(self.params(), batch), rank=mesh.rank)
                if after_forward is not None:  # its words travel with the check's
                    after_forward(self.check if self.s.check_calls else None)
                if self.s.check_calls:  # a rank-dependent branch may have skipped a unit
                    called = [c.unit for c in self.calls if c.unit in self.s.jit]
                    self.check.start(called, batch is not None, self.source.flags())
                if loss is not None and loss.requires_grad:  # gradients arrive via reductions
                    leaves = [self.inputs[i] for i in trainable]
                    try:
                        torch.autograd.grad(loss, leaves, allow_unused=True)
                    except RuntimeError as exc:
                        if "sparse" not in str(exc).lower():
                            raise
                        raise sparse_gradient(mesh.rank) from exc
        finally:
            ACTIVE.reset(token)
        self.source.regather_rest()
        self.reductions.finish()
        self.reductions.settle(self.calls)
        self.source.settle()
        if self.s.jit:
            self.order[:] = self.seen
        return (None if loss is None else loss.detach()), self.reductions.result(self.inputs)

    def forward(self, fn: Callable[[PyTree, Any], Any], batch: Any) -> Any:
        """`fn(params, batch)` without gradients (`fzero.sharded_forward`): units enter
        as in a step's forward and each is freed as soon as the forward is done with it;
        nothing is gathered again. `batch` None: this rank has no data and enters, for
        the others' gathers, the units the last forward called; it returns None."""
        out = None
        token = ACTIVE.set(self)
        try:
            with torch.no_grad(), ModuleHooks(self, self.s.hooked):
                if batch is None:
                    self._follow("forward")
                else:
                    out = fn(self.params(), batch)
            if self.s.check_calls:  # the gathers paired by order: say if they could not
                called = [c.unit for c in self.calls if c.unit in self.s.jit]
                self.check.start(called, present=batch is not None)
                self.check()
        finally:
            ACTIVE.reset(token)
        out = self._unaliased(out)
        self.source.end_forward(self.calls)
        if self.s.jit:
            self.order[:] = self.seen
        return out

    def _unaliased(self, out: Any) -> Any:
        """`out` with copies of its tensors that share memory with the parameters (a
        forward returning a weight, or a view of one): gathered ones are freed next, and
        replicas are the state's own buffers, which a donating step updates in place."""
        refs: list[torch.Tensor | None] = []
        if isinstance(self.source, Replica):
            refs += self.source.local
        for call in self.calls:
            refs += [*(h for h in call.held if h is not None), *(r() for r in call.followed)]
        gathered = {t.untyped_storage().data_ptr() for t in refs if t is not None}
        if not gathered:
            return out

        def own(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in gathered:
                return x.clone()
            return x

        leaves, treedef = tree_flatten(out)
        return tree_unflatten(treedef, [own(x) for x in leaves])

    def _follow(self, what: str) -> None:
        """The forward of a rank without data: the units every rank enters before the
        forward, then the just-in-time units in the order the step called them last time
        (the call check confirms the others called the same). Nothing is computed; the
        backward reduces zeros for every call, in the others' order, and re-gathers what
        theirs re-gathers (`regather_rest`)."""
        self.params()
        if self.s.jit and not self.followable:
            raise ValueError(
                f"rank {self.mesh.rank}: {what}(state, None) on the first call of a "
                f"{what} function with just-in-time units (module= or just_in_time="
                f"True): a rank without data enters the units the {what} called last "
                "time, and there was no last time. Give every rank a batch on the first call"
            )
        for unit in list(self.order) if self.s.jit else ():
            self.enter(unit)
            self.leave(unit)

    def _saved_tensors(self) -> Any:
        """While the forward runs, autograd saves handles to resharded units' parameters
        (see `_gathers`), not the tensors."""
        if isinstance(self.source, Gathers) and self.s.reshard:
            return torch.autograd.graph.saved_tensors_hooks(self.source.pack, self.source.unpack)
        return contextlib.nullcontext()

    # -- `fzero.remat` inside this step ----------------------------------------------------
    def hold(self, t: Any) -> Any:
        """What a recompute keeps of `t` across the forward: a handle if resharding."""
        if isinstance(self.source, Gathers) and self.s.reshard and isinstance(t, torch.Tensor):
            return self.source.pack(t)
        return t

    def fetch(self, held: Any) -> Any:
        """`t` again, for the recompute (gathered again if it was freed)."""
        if not isinstance(held, Handle):
            return held
        assert isinstance(self.source, Gathers)
        t = self.source.unpack(held)
        return t.detach().requires_grad_() if held.requires_grad else t


def _pick(path: str | tuple[str, ...], parts: list[Any]) -> Any:
    """`gathered`'s answer: the one part for a path, a tuple of them for a tuple."""
    return parts[0] if isinstance(path, str) else tuple(parts)
