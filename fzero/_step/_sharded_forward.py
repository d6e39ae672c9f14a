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

from torch import nn

from .._comm import Mesh
from .._core import PyTree, stage_of
from .._engine import Engine, UnitLedger, full_buckets, plan
from .._state import ShardedState, check_step_state
from ._gradient import Memory
from ._loss import copied
from ._sharded_step import collector_paused

Forward = Callable[[ShardedState, Any], Any]


def sharded_forward(
    fn: Callable[..., Any],
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
    just_in_time: bool = False,
    prefetch: bool = True,
    ledger: UnitLedger | None = None,
) -> Forward:
    """A forward without gradients: `forward(state, batch) -> fn(params, batch)`.

    For evaluation and generation at any stage without gathering the whole model. At
    stage 3 a unit's parameters enter `fn` as they do a step's loss (`sharded_step`'s
    `module=` and `just_in_time=` mean the same here) and are freed as soon as the
    forward is done with them (after their submodule's forward, or once `fn` lets go of
    what `fzero.gathered` returned), while the next unit's gather is prefetched: a rank
    holds its shards and a few units at a time. Without `module=` or `just_in_time`,
    every unit is gathered before `fn` runs, and freed when it returns. Stages 0-2 run
    `fn` on the replicated parameters, with no communication.

    `fn` runs under `torch.no_grad()`; the state is read, never changed. A state with
    buffers calls `fn(params, buffers, batch)` with copies of them (in-place updates,
    such as a BatchNorm's in train mode, are not kept). At stage 3 every rank must call
    `forward` the same number of times, its units in the same order (checked after each
    call, as in a step); a rank without data passes `batch=None`, enters the units the
    last call entered, and gets None. Tensors `fn` returns that share memory with the
    parameters are copies: at stage 3 that memory is freed as the forward ends, at stages
    0-2 it is the state's, which a donating step updates in place (a module hook frees
    its unit at stage 3 as soon as the submodule returns, before any copy).

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

    Returns:
      `forward(state, batch) -> fn's result` (None for `batch=None` at stage 3).
    """
    memory = Memory()

    def forward(state: ShardedState, batch: Any) -> Any:
        check_step_state(state, state.stage, None, None, mesh)
        call: Callable[[PyTree, Any], Any] = fn
        if state.buffers is not None:
            buffers = copied(state.buffers)

            def call(params: PyTree, batch: Any) -> Any:
                return fn(params, buffers, batch)

        stage, lay, prec = stage_of(state.stage), state.layout, state.precision
        schedule = plan(
            stage,
            lay,
            mesh.size,
            memory.hooked_units(lay, module),
            just_in_time=just_in_time,
            prefetch=prefetch,
            reshard_after_forward=True,
            overlap_reduce=False,
            reduce_bucket_bytes=0,
            accumulate_locally=False,
            comm_dtypes=(None if prec is None else prec.gather_dtype, None),
        )
        # No backward follows to need the forward's last units: free them all as it goes.
        schedule = dataclasses.replace(schedule, keep_last=0)
        local = None
        if not stage.shards_params:
            # Replicas: nothing is communicated, so nothing can pair wrongly to check for.
            # The engine still enters the units, so that a parameter used outside its unit
            # fails here as it does at stage 3 (and in a step at any stage).
            schedule = dataclasses.replace(schedule, check_calls=False)
            local = full_buckets(state.params, lay)
        engine = Engine(
            stage,
            schedule,
            lay,
            mesh,
            local if local is not None else state.params.buffers,
            local,
            ledger=ledger,
            order=memory.order,
            acc=None,
            final=True,
            followable=memory.followable or local is not None,
        )
        with collector_paused():
            out = engine.forward(call, batch)
        memory.followable = True
        return out

    return forward
