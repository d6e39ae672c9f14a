"""The engine: one micro-batch's units on one rank (or one forward without gradients,
`sharded_forward`: the same entries, then everything freed, nothing reduced).

Every stage is the same program. The loss receives the parameter tree; each unit's
parameters enter it through the per-unit primitive (`_entry.enter`): before the forward,
or just in time, when a module hook or `fzero.gathered` asks for the unit. The backward
of each entry hands the unit's gradient to the reductions. Where the full parameters
come from is the `ParamSource` the schedule names (`Replica` or `Gatherer`); when things
happen is the `Schedule`'s. See docs/design.md, [Note: the gradient engine] for why the
backward is `torch.autograd.grad` on fresh leaf tensors and not `torch.func.grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .._core import (
    PyTree,
    bad_loss,
    check_loss,
    covers,
    grads_of,
    is_bad_loss,
    sparse_gradient,
    spec_of,
    subtree,
    subtree_of,
    tree_flatten,
    tree_unflatten,
    unaliased,
)
from ._callcheck import CallCheck
from ._context import Context
from ._entry import Entry, enter, in_backward
from ._gathered import ACTIVE, pick
from ._gatherer import Gatherer
from ._hooks import ModuleHooks
from ._param_hooks import run_hooks
from ._reductions import LocalSums, Reductions, Watch
from ._source import ParamSource, Replica
from ._writes import Writes, explained, frozen_written


def stand_in(shape: torch.Size, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A storage-free tensor of `shape` (a zero expanded): an autograd leaf that only
    receives a gradient, the tensor it stands for being read elsewhere."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _leaf(x: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """The autograd leaf a bucket's gradient is for: `x` itself, or for a shard held away
    from the compute `device` (on the host) its stand-in there, so the gradient is the
    device's (the gather reads the shard itself)."""
    if device is None or x.device == device:
        return x.detach()
    return stand_in(x.shape, x.dtype, device)


class Pass(NamedTuple):
    """What one micro-batch's pass gives back: the loss, the reduced gradient per bucket,
    and the just-in-time units it called, in order (what the next step follows)."""

    loss: torch.Tensor | None
    grads: tuple[torch.Tensor, ...]
    order: list[str]


class Engine:
    """One micro-batch's units on one rank: how each enters the loss, how its gradient
    leaves it (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        held: tuple[torch.Tensor, ...],
        check: CallCheck,
        *,
        local: tuple[torch.Tensor, ...] | None = None,
        order: Sequence[str] | None = (),
        sums: LocalSums | None = None,
        final: bool = True,
        watch: Watch | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`held`: per bucket, what this rank holds of it, shaped as its reduced gradient
        (its shard, or the full buffer at stage 0); at stage 3 the shards to gather.
        `check`: the micro-batch's call check. `local`: the replicated full buffers
        (stages 0-2). `order`: the just-in-time units last step called, in order (None:
        there was no last step, which a rank without data could follow). `sums`,
        `final`: local accumulation, and whether this is the step's last micro-batch.
        `watch`: told each bucket's reduced gradient once final (`Reductions`).
        `device`: where the units compute, where a shard in `held` is elsewhere (stage 3
        with `Offload(params=True)`: on the host, copied over for each gather)."""
        self.ctx, self.s, self.layout, self.mesh = ctx, ctx.schedule, ctx.layout, ctx.mesh
        self.last = order
        self.leaf_grads = self.s.bursts
        # The autograd leaves the backward differentiates: frozen buckets enter without
        # requires_grad, so they have no gradient and cost no reduction.
        self.inputs = tuple(
            x.detach() if b.frozen else _leaf(x, device).requires_grad_()
            for x, b in zip(held, self.layout.buckets)
        )
        # Both halves hold the check, and neither holds the engine: a step's engine is
        # freed (with what it holds) as soon as the step is done with it.
        self.check = check
        if self.s.gathers:
            shards = tuple(x.detach() for x in held)  # a host shard's copy is the gather's
            self.source: ParamSource = Gatherer(ctx, shards, check, order or (), device)
        else:
            assert local is not None
            self.source = Replica(local)
        # Gradients reduce where the parameters compute: at stages 1-2 `held` may be an
        # offloaded state's masters, and at stage 3 its parameter shards, on the host,
        # which NCCL cannot reduce.
        devices = [x.device for x in (local if local is not None else self.inputs)]
        self.reductions = Reductions(ctx, devices, check, self.source, sums, final, watch)
        self.entries: list[Entry] = []
        self.writes = Writes(self.layout, replica=not self.s.gathers)
        self.seen: list[str] = []  # just-in-time units entered by the forward, in order
        self.marks: dict[str, tuple[int, torch.Tensor]] = {}  # unit -> a placeholder leaf
        # Leaves a gradient reached, where the step asks (`fzero._step._unused`); None: not
        # recorded (every step after the first with data).
        self.used: set[int] | None = None

    # -- what a unit's node asks of the engine (`_entry.Runner`) -------------------------
    def open(self, entry: Entry, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if entry.twin is not None:  # a recompute: the forward's parameters, no collective
            return self.source.again(entry.twin)
        fulls = self.source.open(entry, entry.unit in self.s.jit)
        self.writes.watch(entry, fulls)
        self.entries.append(entry)
        self.reductions.enlist(entry)
        return fulls

    def close(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        if self.used is not None and entry.twin is None:
            self._mark(entry, grads, self.used)
        return self.reductions.arrive(entry, grads)

    def _mark(self, entry: Entry, grads: tuple[torch.Tensor | None, ...], used: set[int]) -> None:
        """Records in `used` the leaves a gradient reached: each leaf where the node hands
        out leaves, else every leaf of a bucket (whose gradient autograd zero-fills)."""
        lay = self.layout
        if self.leaf_grads:
            pairs = zip(lay.unit_paths(entry.unit), grads)
            used.update(lay.path_index[p] for p, g in pairs if g is not None)
            return
        for i, g in zip(entry.buckets, grads):
            if g is not None:
                used.update(s.index for s in lay.buckets[i].slots)

    def _twin(self, unit: str) -> Entry | None:
        """The forward's latest entry of `unit` whose gradient is not reduced yet.

        A checkpoint recomputes inside the backward of the region it wraps, before the
        backward of the units entered there, so that entry is the one being recomputed:
        reusing its parameters (re-gathered once for the backward if resharded) costs no
        second all-gather and no reduction of its own, and keeps every rank's sequence of
        collectives that of its forward, whether or not it recomputes."""
        for entry in reversed(self.entries):
            if entry.unit == unit and not self.reductions.is_reduced(entry):
                return entry
        return None

    # -- entering units ----------------------------------------------------------------------
    def enter(self, unit: str) -> dict[str, torch.Tensor]:
        """`unit` enters the loss now: views of its full leaves, by path."""
        backward = in_backward()
        entry = Entry(unit, self.layout.unit_buckets(unit), self._twin(unit) if backward else None)
        out = enter(self, entry, tuple(self.inputs[i] for i in entry.buckets))
        if unit in self.s.jit and not backward:
            self.seen.append(unit)
            self.source.entered(unit)
        views = (
            dict(zip(self.layout.unit_paths(unit), out, strict=True))
            if self.leaf_grads
            else self.layout.unflatten_unit(unit, out)
        )
        if self.ctx.grad_hooks and not backward:  # a recompute's gradient is not the unit's
            run_hooks(views, self.ctx.grad_hooks)
        return views

    def computes(self, unit: str) -> None:
        """`unit`'s submodule's forward pre-hooks have all run (`ModuleHooks`)."""
        entry = self._latest(unit)
        if entry is not None:
            self.source.computes(entry)

    def leave(self, unit: str, output: Any = None, done: bool = True) -> Any:
        """A member's forward of `unit`'s latest entry is over (`done`: the last one's, then
        its gathered buffers are freed): `output` with copies of what shares memory with
        them (`self.pe[:n]`, a class token expanded: freed memory off the CPU's pool)."""
        entry = self._latest(unit)
        if entry is None:
            return output
        output = unaliased(output, self.source.freed(entry))  # nothing freed: no walk
        if done:
            self.source.left(entry)
        return output

    def _latest(self, unit: str) -> Entry | None:
        """The forward's latest entry of `unit` (None inside the backward, or none)."""
        if in_backward():
            return None
        return next((e for e in reversed(self.entries) if e.unit == unit), None)

    def params(self) -> PyTree:
        """The tree the loss receives: units entered before the forward as views of their
        full parameters, just-in-time units as `Placeholder`s (used anywhere but where
        they enter, they fail loudly instead of training on stale values)."""
        lay = self.layout
        units = [u for u in lay.units if lay.unit_buckets(u)]  # not the empty root
        self.source.start([u for u in units if u not in self.s.jit])
        leaves: list[Any] = [None] * len(lay.paths)
        for unit in units:
            if unit not in self.s.jit:
                for path, view in self.enter(unit).items():
                    leaves[lay.path_index[path]] = view
                continue
            made = self.ctx.placeholders[unit]
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
            return pick(path, [subtree(params, p) for p in paths])
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
        return pick(path, [cut(tree) for cut in cuts])

    # -- one micro-batch -------------------------------------------------------------------
    def value_and_grad(self, loss_fn: Callable[[PyTree, Any], torch.Tensor], batch: Any) -> Pass:
        """This rank's loss on `batch` and its reduced gradient per bucket.

        `batch` None: this rank has no data, but takes part in every collective of the
        others' micro-batch (`_follow`), contributing zero gradients; its loss is None.
        Once the forward is done, the call check starts (`CallCheck.after_forward`), so
        that it runs behind the backward."""
        lay, mesh = self.layout, self.mesh
        trainable = [i for i, b in enumerate(lay.buckets) if not b.frozen]
        loss = error = None
        token = ACTIVE.set(self)
        try:
            # Hooks and `gathered` stay live through the backward: a checkpoint's
            # recompute enters its units again there.
            with ModuleHooks(self, self.s.hooked):
                with self.source.saving():
                    if batch is None:
                        self._follow("step")
                    else:
                        try:
                            loss = check_loss(loss_fn(self.params(), batch), rank=mesh.rank)
                            written = self.writes.found()
                            if written:
                                loss = None
                                raise bad_loss(frozen_written(written, mesh.rank, self.writes))
                        except Exception as exc:
                            # The forward is done but what it returned is refused: this
                            # rank's backward reduces zeros, and every rank raises it when
                            # the check completes ([Note: failing together]). Anything
                            # else left the forward half-done: it is published.
                            if not is_bad_loss(exc):
                                said = explained(exc, mesh.rank, self._written(exc))
                                if said is None:
                                    raise
                                raise said from exc
                            error = exc
                # A rank-dependent branch may have skipped a unit: every rank says what it
                # called before the first reduction.
                called = self._called() if self.s.check_calls else None
                self.check.after_forward(called, batch is not None, self.source.flags(), error)
                if loss is not None and loss.requires_grad:  # gradients arrive via reductions
                    leaves = [self.inputs[i] for i in trainable]
                    try:
                        grads_of(loss, leaves, self.ctx.own, mesh.rank)
                    except RuntimeError as exc:
                        if "sparse" not in str(exc).lower():
                            raise
                        raise sparse_gradient(mesh.rank) from exc
        finally:
            ACTIVE.reset(token)
        self.source.end_backward()
        self.reductions.finish()
        self.reductions.settle(self.entries)
        self.source.settle()
        grads = self.reductions.result(self.inputs)
        return Pass(None if loss is None else loss.detach(), grads, self._order())

    def forward(self, fn: Callable[[PyTree, Any], Any], batch: Any) -> tuple[Any, list[str]]:
        """`fn(params, batch)` without gradients (`fzero.sharded_forward`), and the
        just-in-time units it called: units enter as in a step's forward and each is
        freed as soon as the forward is done with it; nothing is gathered again. `batch`
        None: this rank has no data and enters, for the others' gathers, the units the
        last forward called; it returns None."""
        out = None
        with self.session(present=batch is not None) as params:
            if batch is None:
                self._follow("forward")
            else:
                out = self._unaliased(fn(params, batch))
        return out, self._order()

    @contextlib.contextmanager
    def session(self, present: bool = True) -> Iterator[PyTree]:
        """A forward without gradients around the caller's code (`fzero.bind`): yields the
        parameters; units enter as the code runs (hooks, `gathered`), as often as it
        calls them, and are freed after each use. On a clean exit the calls are checked
        against the other ranks' and the forward ends. A rank without data (`present`
        False) gets None and follows the last forward's units (`_follow`)."""
        token = ACTIVE.set(self)
        self.writes.every = True  # nothing is differentiated: autograd refuses no write
        try:
            with torch.no_grad(), ModuleHooks(self, self.s.hooked):
                yield self.params() if present else None
            written = self.writes.found()
            if written:
                raise frozen_written(written, self.mesh.rank, self.writes)
            if self.s.check_calls:  # the gathers paired by order: say if they could not
                self.check.after_forward(self._called(), present=present)
                self.check.before_collective()
        finally:
            ACTIVE.reset(token)
        self.source.end_forward(self.entries)

    def _called(self) -> list[str]:
        return [e.unit for e in self.entries if e.unit in self.s.jit]

    def _written(self, exc: BaseException) -> str | None:
        """The parameter autograd refused a write to in `exc`, if it is one of ours."""
        return self.writes.named(exc, self.source.aliases(self.entries))

    def _order(self) -> list[str]:
        """What the next step follows: the just-in-time units called, in order."""
        return list(self.seen) if self.s.jit else list(self.last or ())

    def _unaliased(self, out: Any) -> Any:
        """`out` with copies of its tensors that share memory with the parameters (a
        forward returning a weight, or a view of one): gathered ones are freed next, and
        replicas are the state's own buffers, which a donating step updates in place."""
        return unaliased(out, [full for _, full in self.source.aliases(self.entries)])

    def _follow(self, what: str) -> None:
        """The forward of a rank without data: the units every rank enters before the
        forward, then the just-in-time units in the order the step called them last time
        (the call check confirms the others called the same). Nothing is computed; the
        backward reduces zeros for every entry, in the others' order, and re-gathers what
        theirs re-gathers (`ParamSource.end_backward`)."""
        self.params()
        if self.s.jit and self.last is None:
            micro = what == "step"  # a step's micro-batch may be the missing one
            raise ValueError(
                f"rank {self.mesh.rank}: {what}(state, None) on the first call of a "
                f"{what} function with just-in-time units (module= or just_in_time="
                "True)"
                + (", or a None micro-batch before the rank's first batch" * micro)
                + f": a rank without data enters the units the {what} called last time, "
                "and there was no last time. Give every rank a batch on the first call"
                + (" (a missing micro-batch may come after one it has)" * micro)
            )
        for unit in list(self.last or ()) if self.s.jit else ():
            self.enter(unit)
            self.leave(unit)

    # -- `fzero.remat` inside this step ----------------------------------------------------
    def hold(self, t: Any) -> Any:
        """What a recompute keeps of `t` across the forward (`ParamSource.hold`)."""
        return self.source.hold(t)

    def fetch(self, held: Any) -> Any:
        """`t` again, for the recompute (`ParamSource.fetch`)."""
        return self.source.fetch(held)
