"""sharded_forward: a forward without gradients over a sharded state (evaluation, generation).

The forward half of a step: at stage 3 the engine enters each unit as training does (up
front, through module hooks, or through `fzero.gathered`) and frees it as soon as the
forward is done with it, so a rank holds its shards and a few units, never the model.
There is no backward, so nothing is gathered again. Stages 0-2 hold the parameters
replicated: the units enter as the replicas, with no communication at all (through the
engine all the same, so a parameter used outside its unit fails at every stage alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _comm
from .._comm import Mesh
from .._core import PyTree, Stage, gathers_to_compute, stage_of, unaliased
from .._engine import (
    CallCheck,
    Context,
    Engine,
    Pool,
    UnitLedger,
    context,
    full_buckets,
    plan,
    restored,
)
from .._state import ShardedState, params_apart
from ._bursts import jit_units
from ._cache import StepCache
from ._casts import forward_casts
from ._compile_checks import agree_present
from ._compiled import CompiledLoss
from ._config import check_module
from ._entries import entry_inputs
from ._loss import copied
from ._norm_dtypes import norm_dtypes_named
from ._options import EAGER_BURST, GRAPH_BURST, check_step_state
from ._sharded_step import collector_paused
from ._stalls import said_stalled
from ._traced_hooks import check_loss

Forward = Callable[[ShardedState, Any], Any]


def sharded_forward(
    fn: Callable[..., Any],
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
    just_in_time: bool = False,
    prefetch: bool = True,
    ledger: UnitLedger | None = None,
    compile: bool | str = False,
) -> Forward:
    """A forward without gradients: `forward(state, batch) -> fn(params, batch)`.

    For evaluation and generation at any stage without gathering the whole model: at
    stage 3 units enter `fn` as they enter a step's loss and each is freed as soon as the
    forward is done with it, the next one's gather prefetched; stages 0-2 run `fn` on the
    replicas, without communicating. `fn` runs under `torch.no_grad()` and the state is
    read, never changed. At stage 3 every rank calls `forward` as often as the others,
    its units in the same order (checked after each call); a rank without data passes
    `batch=None` and gets None. Returned tensors that share memory with the parameters
    are copies (docs/training.md).

    Args:
      fn: `(params, batch) -> anything` (`(params, buffers, batch)` with buffers), params
        being the full tree, as a step's loss receives it.
      mesh: the mesh the state was sharded over.
      module: the module `fn` calls through `torch.func.functional_call`, whose unit
        submodules are hooked so that each unit enters as its submodule runs.
      just_in_time: every unit but the root enters only when `fn` asks for it with
        `fzero.gathered(params, unit)`.
      prefetch: stage 3: start gathering the unit that came next last call as a unit
        enters.
      ledger: a UnitLedger recording live full-unit bytes (for tests and notebooks).
      compile: trace `fn` with its units' entry by `torch.compile`, as a compiled step's
        forward (True: inductor; a string: that backend), no ledger. At stage 3 the
        gathers run inside the graph: a rank without data runs its last batch again for
        them (and gets None), and needs one of its own first; the units enter up
        front (the whole model gathered for the call), where their submodule runs
        (`module=`'s hooks, traced), or, with `just_in_time=True`, where `fn` asks for
        them (`fzero.gathered`).

    Returns:
      `forward(state, batch) -> fn's result` (None for `batch=None` at stage 3).
    """
    forwarder = Forwarder(mesh, module, just_in_time, prefetch, ledger)
    if not isinstance(compile, (bool, str)) or compile == "":
        raise TypeError(f"compile must be a bool or a torch.compile backend, got {compile!r}")
    backend = ("inductor" if compile is True else compile) or None

    def forward(state: ShardedState, batch: Any) -> Any:
        # Stages 0-2 send nothing in a forward: no call to check (one rank may sample).
        sends = gathers_to_compute(getattr(state, "stage", None))
        with (
            _comm.call(mesh, "sharded_forward", sends=sends),
            norm_dtypes_named(module, state, mesh.rank),
            said_stalled("sharded_forward", mesh.rank),
        ):
            if backend is not None:
                return _compiled_forward(state, batch)
            return _forward(state, batch)

    def _compiled_forward(state: ShardedState, batch: Any) -> Any:
        if ledger is not None:
            raise ValueError(
                f"rank {mesh.rank}: sharded_forward(compile=...) does not yet compile a "
                "forward with ledger=; run it eagerly (compile=False) for that"
            )
        assert backend is not None
        check_step_state(state, state.stage, None, None, mesh, "sharded_forward")
        stage, lay = stage_of(state.stage), state.layout
        if batch is None and not (stage.shards_params and mesh.size > 1):  # nothing to join
            return None
        burst = GRAPH_BURST if stage.shards_params else EAGER_BURST
        compiled = forwarder.cache.compiled(
            lay,
            (state.precision, stage),
            lambda: CompiledLoss(
                fn,
                lay,
                stage,
                mesh,
                backend,
                burst,
                state.precision,
                jit_units(lay) if just_in_time else frozenset(),
                hooked=forwarder.hooked(state),
            ),
        )
        if stage.shards_params:  # a rank without data runs its last batch for the gathers
            agree_present([batch], mesh, compiled.last is not None)
        local = None if stage.shards_params else full_buckets(state.params, lay)
        leaves, fulls = entry_inputs(compiled, state, local, mesh)
        # Buffers: a copy (a forward never changes the state; BatchNorm in training mode
        # writes its statistics into what it is given).
        buffers = None if state.buffers is None else copied(state.buffers)
        casts = forward_casts(forwarder.module, forwarder.hooked(state), state.precision)
        kept = restored(forwarder.cache.shared_slots(forwarder.module, state.buffers))
        with collector_paused(), torch.no_grad(), casts, kept:
            # A wait that ends in a peer's failure is said by `forward`'s `said_stalled`.
            ran = compiled.last if batch is None else batch
            out, _, called, _ = compiled(leaves, fulls, ran, buffers)
        error = None
        try:
            if compiled.hooks is not None:
                check_loss(out, mesh.rank)
        except ValueError as exc:  # every rank raises it with the check, where one runs
            error = exc
        if compiled.jit and stage.shards_params and mesh.size > 1:  # alike on every rank
            # The units `fn` entered, in order, the same on every rank (the gathers pair
            # up by order), or every rank raises: the eager forward's call check.
            check = CallCheck(mesh)
            check.after_forward(list(called), error=error)
            check.finish()
        if error is not None:
            raise error
        if batch is None:  # the last batch's output again: not this call's
            return None
        if local is None:  # gathered in the graph: nothing of the state's to alias
            return out
        return unaliased(out, local)

    def _forward(state: ShardedState, batch: Any) -> Any:
        call: Callable[[PyTree, Any], Any] = fn
        engine = forwarder.engine(state)
        if state.buffers is not None:
            buffers = copied(state.buffers)

            def call(params: PyTree, batch: Any) -> Any:
                return fn(params, buffers, batch)

        casts = forward_casts(forwarder.module, forwarder.hooked(state), state.precision)
        with (
            collector_paused(),
            casts,
            restored(forwarder.cache.shared_slots(forwarder.module, state.buffers)),
        ):
            out, forwarder.cache.order = engine.forward(call, batch)
        return out

    return forward


class Forwarder:
    """What a forward without gradients keeps from one call to the next: the engine's
    context per layout, and the units called last time (which a rank without data
    follows, and prefetching foresees)."""

    def __init__(
        self,
        mesh: Mesh,
        module: nn.Module | None,
        just_in_time: bool,
        prefetch: bool,
        ledger: UnitLedger | None,
    ) -> None:
        self.mesh, self.module, self.ledger = mesh, module, ledger
        self.just_in_time, self.prefetch = just_in_time, prefetch
        self.cache = StepCache()

    def hooked(self, state: ShardedState) -> dict[str, Any]:
        """The units `module=`'s hooks enter (checked against the state first)."""
        check_module(self.module, state, self.mesh.rank)
        return self.cache.hooked_units(state.layout, self.module)

    def engine(self, state: ShardedState) -> Engine:
        """A fresh engine over `state` for one forward (checked against the mesh)."""
        mesh, cache = self.mesh, self.cache
        check_step_state(state, state.stage, None, None, mesh, "sharded_forward")
        stage, lay = stage_of(state.stage), state.layout
        key = (state.precision, stage)
        ctx = cache.context(lay, key, lambda: self._context(stage, state))
        # Replicas: nothing is communicated, so nothing can pair wrongly (`plan` checks no
        # calls). The engine still enters the units, so that a parameter used outside its
        # unit fails here as it does at stage 3 (and in a step at any stage).
        local = None if stage.shards_params else full_buckets(state.params, lay)
        order = cache.order if cache.order is not None or local is None else []
        held = local if local is not None else state.params.buffers
        # A forward keeps no buffers from one call to the next: a fresh pool each call.
        ctx = dataclasses.replace(ctx, pool=Pool())
        device = params_apart(state)
        return Engine(ctx, held, CallCheck(mesh), local=local, order=order, device=device)

    def _context(self, stage: Stage, state: ShardedState) -> Context:
        prec, lay = state.precision, state.layout
        check_module(self.module, state, self.mesh.rank)
        schedule = plan(
            stage,
            lay,
            self.mesh.size,
            self.cache.hooked_units(lay, self.module),
            just_in_time=self.just_in_time,
            prefetch=self.prefetch,
            reshard_after_forward=True,
            overlap_reduce=False,
            reduce_bucket_bytes=0,
            accumulate_locally=False,
            comm_dtypes=(None if prec is None else prec.gather_dtype, None),
            backward=False,
        )
        return context(schedule, lay, self.mesh, Pool(), self.ledger)
