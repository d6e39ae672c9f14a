"""Compiled steps: a step's forward and backward traced by `torch.compile` as one graph.

The eager engine enters each unit through a Python-level node and reduces its gradient
from a hook; here the same transposes are traceable functional collectives, so the loss,
the parameters' entry and the gradients' reduction are one program the compiler sees
whole (docs/design.md, [Note: compiled steps]):

- stage 3: the buckets' shards enter through an all-gather whose backward reduce-scatters
  (`_entries.Gather`, with `Precision`'s casts: gather dtype out, reduce dtype back);
- stages 1-2: the replicated buckets enter as they are, through an identity whose
  backward reduce-scatters their gradients to the rank's shards (`Scatter`: the shards
  are the leaves the gradients are for, in the reduce dtype; the full buffers what the
  forward reads);
- stage 0: the same with an all-reduce (`AllReduce`).

On a 2-D mesh the shard axis carries these and the replicas sum each reduced shard
(`_traced_comm.Axes`). Units enter before the loss, or, with `just_in_time=True`, where the
loss calls `fzero.gathered` (each an `Unentered` leaf until then), so the graph gathers
a unit where the forward first needs it. A trainable just-in-time unit's gather is then
checkpointed at stage 3 unless `reshard_after_forward=False`: the compiler recomputes it
for the backward instead of keeping the full parameters from the forward (JAX's remat
policy; eager frees them after the unit's forward and gathers again; with hpZ the
recompute gathers inside the group of k from the 1/k kept, `_entries.Regather`). With
`module=` the eager engine's hooks are traced too: a hooked unit enters where its
submodule runs (`_traced_hooks`).

Consecutive buckets of one dtype share one collective, up to `reduce_bucket_bytes`
(`bursts`; 4 MiB by default at stages 1-3: smaller bursts reduce beside the backward,
and at stage 3 let the units compute sooner after their gathers; tiny units still share).
How each burst's bytes travel (as they are, as gloo's all-to-all, or as ZeRO++'s int8
blocks): `_traced_comm`. Each rank's gradient is divided by the ranks in the reduce
dtype before the collective sums it, as the eager engine's is (an fp16 sum could
overflow where the mean does not); the values agree with eager to rounding, not
bitwise (quantized, to the int8 blocks' error: the graph cuts its blocks per burst,
the eager engine per collective it issues). The update, the loss weights' exchange and
the gather after the update are the eager step's (`_body`), fzero's optimizers fused
(`fzero.optim._fused`). Accumulating, the graph runs once per micro-batch, each reducing
its own (eager "sharded"); "local" runs a graph without collectives and reduces the sum
after the last (`_local`). The gradient per micro-batch: `_compiled_grad`; what
compiles, and what is refused: `_compile_checks`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Mapping
from typing import Any

import optree
import torch

from .._comm import Mesh, QuantizedComm, graph_ran
from .._core import NAMESPACE, LossFn, ShardLayout, Stage, spec_of
from .._engine import Members, Unentered
from .._state import Precision
from ._bursts import bursts, cuts, jit_bursts
from ._dynamo import (
    arrive_alike,
    batch_shapes,
    compile_loss,
    graph_break,
    graphs_compiled,
    in_pieces,
    own_code,
    quiet,
    raised_in_trace,
    unentered_use,
    warn_recompiled,
)
from ._entries import (
    AllReduce,
    Scatter,
    bare_gather,
    comm_dtypes,
    entered_gather,
    joined_receivers,
)
from ._loss import kept_batch
from ._options import GRAPH_BURST
from ._traced_comm import entry_axes, hpz_axes, sent_finite
from ._traced_hooks import TracedHooks, ghost_beside_tensors, ghosts, unhooked_use


class CompiledLoss:
    """A step function's loss, compiled with its units' entry, for one layout and stage:
    `(leaves, fulls, batch) -> loss` (the loss's own return: a scalar or a pair).

    Args:
      loss_fn: the user's `(params, batch)` loss.
      layout: the state's layout.
      stage: the step's stage.
      mesh: the mesh (its shard axis carries the collectives).
      backend: `torch.compile`'s backend ("inductor", or e.g. "aot_eager").
      burst_bytes: the buckets entered by one collective, at most (`reduce_bucket_bytes`).
      precision: the state's `Precision`, if any (the dtypes the collectives run in).
      jit: the units entered where the loss asks for them (`fzero.gathered`), inside
        the graph; the others enter before the loss.
      reshard: at stage 3, a just-in-time unit's gather is recomputed for its backward
        rather than its full parameters kept from the forward (the compiler's remat);
        not with `local`, which gathers the whole model once. An int k is hpZ's: the
        gather runs over the ranks at this rank's place in every group of k, then inside
        its group, and the backward recomputes the second alone (`Regather`).
      local: local accumulation (`_local`): the leaves are the full buffers, entered as
        they are; the graph has no collective.
      hooked: the units `module=`'s hooks enter (`hookable_units`), each where it runs.
      quant: ZeRO++'s int8 traffic (`sharded_step(quantize=...)`), if any: stage 3's
        gathers (qwZ) and the reductions of stages 1-3 (qgZ), `_traced_comm`.
    """

    # Set once, in `__init__`, for the one layout this loss is compiled for: the trace's
    # guards on them are dropped (`compile_loss`), those on `loss_fn` and `hooks` kept.
    FIXED = (
        "layout", "stage", "rank", "ghosts", "travel", "reduce", "axes", "burst_bytes",
        "local", "reshard", "hpz", "cuts", "runs", "jit_runs", "jit", "index", "hooked",
    )  # fmt: skip

    def __init__(
        self,
        loss_fn: LossFn,
        layout: ShardLayout,
        stage: Stage,
        mesh: Mesh,
        backend: str,
        burst_bytes: int,
        precision: Precision | None = None,
        jit: frozenset[str] = frozenset(),
        reshard: bool | int = True,
        local: bool = False,
        hooked: Mapping[str, Members] | None = None,
        quant: QuantizedComm | None = None,
    ) -> None:
        self.loss_fn, self.layout, self.stage, self.rank = loss_fn, layout, stage, mesh.rank
        hooked = hooked or {}
        jit = jit | frozenset(hooked)  # entered inside the graph: by a hook, or `gathered`
        self.hooks = TracedHooks(hooked) if hooked else None
        self.hooked = frozenset(hooked)
        self.ghosts = ghosts(layout, hooked)
        self.travel, self.reduce = comm_dtypes(precision, layout)
        self.axes, self.burst_bytes = entry_axes(mesh, stage, quant), burst_bytes
        self.local, self.size = local, mesh.size
        self.trainable = not all(b.frozen for b in layout.buckets)
        self.reshard = bool(reshard) and stage.shards_params and not local
        # hpZ's peers are a process group of their own: made where a unit reshards.
        self.hpz = hpz_axes(mesh, reshard, self.axes) if self.reshard and jit else None
        later = {i for u in jit for i in layout.unit_buckets(u)}
        upfront = [i for i in range(len(layout.buckets)) if i not in later]
        self.runs = bursts(layout, burst_bytes, self.reduce, upfront)
        # Just-in-time units in bursts (`jit_bursts`): per burst its runs; per unit its
        # burst, its leaves (slot index, path) and its spec. Worked out here, since
        # dynamo cannot trace the layout's cached properties on their first use.
        ordered = sorted(jit, key=layout.units.index)
        self.jit_runs: list[list[list[int]]] = []
        self.jit: dict[str, tuple[int, tuple[tuple[int, str], ...], Any]] = {}
        # At most a gather burst's worth (4 MiB) however large the step's bursts: units
        # enter where the loss asks for their memory's sake, and a larger burst of them
        # holds that many units' full gradients until the last is done (a stage-2 step of
        # 4 MB units held 1.06 B with 25 MiB bursts, measured; tiny units still share one).
        jit_cap = min(burst_bytes, GRAPH_BURST)
        for members in jit_bursts(layout, ordered, jit_cap, self.reduce):
            among = [i for u in members for i in layout.unit_buckets(u)]
            self.jit_runs.append(bursts(layout, burst_bytes, self.reduce, among))
            for u in members:
                slots = tuple(
                    (s.index, s.path)
                    for i in layout.unit_buckets(u)
                    for s in layout.buckets[i].slots
                )
                self.jit[u] = (len(self.jit_runs) - 1, slots, spec_of(layout.unit_members(u)))
        # The tree as a tree of leaf indices, rebuilt in the graph by `tree_map` (dynamo
        # traces optree's Python side, not a PyTreeSpec made outside).
        self.index = optree.tree_unflatten(layout.treedef, list(range(len(layout.paths))))
        self.cuts = [cuts(b) for b in layout.buckets]
        self.backend, self.pieces, self.why = backend, False, ""
        # Stage 3's forward gathers after every rank's trace (`_arrive`); stages 0-2 have none.
        self.meets = mesh if stage.shards_params and not local and mesh.size > 1 else None
        self.arrived, self.recomputes = True, False  # this call's barrier is behind it
        self.compiled = self._compile(fullgraph=True)
        self.shapes: list[tuple[int, ...]] | None = None  # the last call's batch's
        self.last: Any = None  # the batch a rank without data runs again (`kept_batch`)

    def __call__(
        self, leaves: list[torch.Tensor], fulls: list[Any], batch: Any, buffers: Any = None
    ) -> Any:
        """The compiled `(loss_fn's output, anchor, units entered, qwZ's finite flags)`;
        a RuntimeWarning where a later call compiled again."""
        before = graphs_compiled()
        self.arrived = self.meets is None
        self.recomputes = self.reshard and bool(self.jit) and torch.is_grad_enabled()
        # For a rank without data next time, by a step's, or a gathering forward's.
        kept = kept_batch(batch) if torch.is_grad_enabled() or self.meets is not None else None
        out = self._call(leaves, fulls, batch, buffers)
        if self._communicates():  # an open comm_ledger cannot see them: it says so
            graph_ran()
        shapes = batch_shapes(batch)
        if self.shapes is not None and graphs_compiled() > before:
            warn_recompiled(self.rank, self.shapes, shapes, self.pieces)
        self.shapes, self.last = shapes, kept
        return out

    def _arrive(self) -> None:
        """This call's barrier (a polled all-gather on the control axis), once, before
        its first gather: called as a graph holding a collective starts to run
        (`compile_loss`'s `before_run`), or by an entry run eagerly. A rank whose trace
        raised runs no graph; without it, its peers would wait in their graph's unpolled
        first gather until the timeout (docs/design.md, [Note: failing together])."""
        if not self.arrived:  # False only where there is a barrier (`__call__`)
            self.arrived = True
            arrive_alike(self.meets, self.pieces, self.why, self.recomputes)

    def _communicates(self) -> bool:
        """Whether this call's graph runs collectives (stage 3's gathers, or reductions)."""
        if self.local or self.size == 1:
            return False
        return self.stage.shards_params or (self.trainable and torch.is_grad_enabled())

    def _call(self, leaves: list[torch.Tensor], fulls: list[Any], batch: Any, buffers: Any) -> Any:
        hooks = self.hooks.installed() if self.hooks is not None else contextlib.nullcontext()
        try:
            with hooks, quiet(self.pieces):
                return self.compiled(leaves, fulls, batch, buffers)
        except torch._dynamo.exc.TorchRuntimeError as exc:
            if self.hooks is None or not ghost_beside_tensors(exc):
                raise
            raise ValueError(unhooked_use(self.rank)) from exc
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
            # UserError: valid eagerly, untraceable whole (an MoE's data-dependent loop).
            raised = raised_in_trace(exc)
            if raised is not None:  # the loss's (or fzero.gathered's) own error, as itself
                raise raised from exc
            if "Unentered" not in str(exc):
                if self.pieces:
                    raise
                self._in_pieces(f"breaks torch.compile's graph ({graph_break(exc)})")
                return self._call(leaves, fulls, batch, buffers)
            # Dynamo's own words name the line but not what the value was.
            raise ValueError(unentered_use(self.rank)) from exc
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # a trace that ran nothing
            if self.pieces:
                raise
            self._in_pieces("reached torch._dynamo.config.recompile_limit")
            return self._call(leaves, fulls, batch, buffers)
        finally:
            if self.hooks is not None:  # set in the trace, cleared there unless it raised
                self.hooks.enter_unit = None

    def _in_pieces(self, why: str) -> None:
        """The loss breaks dynamo's graph, or its recompiles reached dynamo's limit: compiled
        again without `fullgraph`, in pieces with eager Python between them, said once."""
        warnings.warn(in_pieces(self.rank, why), RuntimeWarning, stacklevel=4)
        self.pieces, self.why = True, why
        self.compiled = self._compile(fullgraph=False)

    def _compile(self, fullgraph: bool) -> Any:
        # In pieces the user's frames get the filter too, their `self` theirs: none then.
        return compile_loss(
            own_code(self._loss),
            self.backend,
            fullgraph,
            self.FIXED if fullgraph else (),
            None if self.meets is None else self._arrive,
        )

    def _loss(
        self, leaves: list[torch.Tensor], fulls: list[Any], batch: Any, buffers: Any
    ) -> tuple[Any, torch.Tensor, tuple[str, ...], Any]:
        """The loss (`loss_fn(params, buffers, batch)` where `buffers` is not None: the
        state's buffers, a copy its in-place updates go to); an anchor: zero,
        differentiable in every trainable entry, whose backward runs the graph's
        collectives where the loss has no gradient (a pair of weight 0 whose total is a
        constant), so that this rank still joins them; the just-in-time units the
        loss entered, in order (a constant of the trace, which the ranks compare before
        any backward); and per qwZ gather, its units and whether its blocks arrived
        finite (`sent_finite`)."""
        lay = self.layout
        views: list[Any] = [None] * len(lay.paths)
        # Per trainable entry, a scalar of its outputs for the anchor, taken as it enters
        # (the outputs themselves kept to the loss's end would keep every unit's full
        # parameters alive through the forward).
        entries: list[torch.Tensor] = []
        sent: list[tuple[tuple[str, ...], torch.Tensor]] = []  # qwZ: per gather, finite?
        called: list[str] = []
        entered: dict[int, dict[str, torch.Tensor]] = {}  # per burst, its leaves' views
        enters: dict[str, Any] = {}  # per just-in-time unit, what enters it
        for run in self.runs:
            for i, flat in zip(run, self._enter(run, leaves, fulls, entries, sent)):
                cut = self._cut(i, flat)
                for s in lay.buckets[i].slots:
                    views[s.index] = cut[s.index]
        for unit, (_, slots, spec) in self.jit.items():
            enter = functools.partial(
                self._enter_unit, unit, leaves, fulls, entries, sent, called, entered
            )
            enters[unit] = enter
            if unit not in self.hooked:  # a hooked unit's leaves are ghosts (below)
                for index, path in slots:
                    views[index] = Unentered(path, spec, len(slots), self.rank, enter)
        for index, shape, dtype in self.ghosts:  # swapped for its views by the unit's hook
            views[index] = torch.empty(shape, dtype=dtype, device="meta")
        params = optree.tree_map(lambda k: views[k], self.index, namespace=NAMESPACE)
        if self.hooks is not None:
            self.hooks.enter_unit = lambda unit: enters[unit]()
        if buffers is None:
            out = self.loss_fn(params, batch)
        else:
            out = self.loss_fn(params, buffers, batch)
        if self.hooks is not None:
            self.hooks.enter_unit = None
        anchor = torch.zeros(())
        for e in entries:
            anchor = anchor + e
        return out, anchor * 0, tuple(called), tuple(sent)

    def _enter_unit(
        self,
        unit: str,
        leaves: list[torch.Tensor],
        fulls: list[Any],
        entries: list[torch.Tensor],
        sent: list[tuple[tuple[str, ...], torch.Tensor]],
        called: list[str],
        entered: dict[int, dict[str, torch.Tensor]],
    ) -> dict[str, torch.Tensor]:
        """A just-in-time unit entered where the loss asks (`Unentered.enter`): its
        leaves' views by path. The first unit of its burst asked for enters the whole
        burst; the others take their views from it (`entered`, per trace)."""
        lay = self.layout
        called.append(unit)
        burst, slots, _ = self.jit[unit]
        views = entered.get(burst)
        if views is None:
            views = entered[burst] = {}
            for run in self.jit_runs[burst]:
                out = self._enter(run, leaves, fulls, entries, sent, self.reshard)
                for i, flat in zip(run, out):
                    # A checkpointed gather (resharding) keeps the slices: the partitioner
                    # recomputes views for the backward, and a split's pieces it saves.
                    resharded = self.reshard and torch.is_grad_enabled()
                    cut = self._cut(i, flat, sliced=resharded)
                    for s in lay.buckets[i].slots:
                        views[s.path] = cut[s.index]
        return {path: views[path] for _, path in slots}

    def _cut(self, i: int, flat: torch.Tensor, sliced: bool = False) -> dict[int, torch.Tensor]:
        """Bucket i's leaves, by tree index, as views of its full buffer `flat`, cut by one
        `split` (`cuts`), whose backward is one `cat`: a slice a leaf has autograd scatter
        each gradient into a zero-filled bucket-sized buffer and sum those (the GPT's stage
        0: ~10 ms a step, profiled). `sliced`: slices (a resharded gather's, below)."""
        if sliced:
            # AOTAutograd's partitioner recomputes a checkpointed gather's views for the
            # backward, but saves a split's pieces: the full parameters, kept (measured
            # by the profiled re-gathers of tests/step/test_hybrid.py).
            lay = self.layout.buckets[i]
            return {s.index: flat[s.offset : s.offset + s.numel].view(s.shape) for s in lay.slots}
        sizes, where = self.cuts[i]
        pieces = flat.split(sizes) if sizes else ()
        return {index: pieces[k].view(shape) for index, k, shape in where}

    def _enter(
        self,
        run: list[int],
        leaves: list[torch.Tensor],
        fulls: list[Any],
        entries: list[torch.Tensor],
        sent: list[tuple[tuple[str, ...], torch.Tensor]],
        recompute: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """One run of buckets entered as one collective: each bucket's full buffer."""
        if not torch.compiler.is_compiling():  # run eagerly: this call's barrier first
            self._arrive()
        b, shards = self.layout.buckets[run[0]], [leaves[i] for i in run]
        # Without a gradient to take (a frozen run; a forward under no_grad), the
        # entry's forward alone: dynamo inlines an autograd.Function's forward then,
        # and would hand it arguments the new-style signature does not take.
        bare = b.frozen or not torch.is_grad_enabled()
        a = self.axes
        if self.local:  # the full buffers themselves, differentiated where they are
            out = tuple(shards)
            if bare:
                return out
        elif self.stage.shards_params:  # the all-gather of every rank's shards
            travel, reduce = self.travel[run[0]], self.reduce[run[0]]
            if bare:
                out = bare_gather(a, self.hpz, travel, b.dtype, shards, recompute)
                sent_finite(sent, a, self.layout, run, out)
                return out
            out = entered_gather(a, self.hpz, travel, b.dtype, reduce, shards, recompute)
            sent_finite(sent, a, self.layout, run, out)
        elif bare:
            return tuple(fulls[i] for i in run)
        elif self.stage.shards_optimizer:
            out = Scatter.apply(a, [fulls[i] for i in run], joined_receivers(shards))
        else:
            out = AllReduce.apply(a, [fulls[i] for i in run], joined_receivers(shards))
        # One output's first element: enough to run the entry's backward (autograd hands
        # it zeros for the others), and the slice's backward writes a buffer of that
        # output's size, so one, not one per output.
        entries.append(out[0].reshape(-1)[:1].sum())
        return out
