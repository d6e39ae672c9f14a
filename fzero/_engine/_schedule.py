"""Schedule: when a step's units enter the loss and how their gradients leave it.

The stage says *what* is communicated (`_stages`); the schedule says *when*, chosen once
per layout from the stage, the step's options and the state (`plan`). Nothing in the
engine branches on the stage or the options: it reads the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._comm import Axis, QuantizedComm
from .._core import ShardLayout, Stage


@dataclass(frozen=True)
class Schedule:
    """One step's scheduling policy.

    Attributes:
      gathers: units enter as the all-gather of every rank's shard (stage 3), not as the
        rank's replica (stages 0-2).
      by_leaf: nothing is communicated (stage 0 on one rank): the step differentiates by
        leaf, as an eager loop does, and no unit enters through the engine.
      hooked: units entered by a forward pre-hook on their submodule (`module=`), each
        with its parameters' (path, owning module, attribute name).
      jit: units entered just in time, when the loss reaches them (`hooked`, or every
        unit but the root with `just_in_time`); the others are entered before the forward.
      prefetch: start gathering the unit that came next last step as a unit enters (and
        at the forward's start its first units, up to the largest unit's size), and in the
        backward the unit whose backward comes next (stage 3).
      reshard: a just-in-time unit's gathered parameters live only while the forward
        holds them, and the backward gathers them again (stage 3).
      keep_last: with `reshard`, how many just-in-time calls at the end of the forward (as
        many as last step made) stay gathered into the backward instead: its first gathers
        would fetch exactly these again at once (the last, and with `prefetch` the one
        before it), so keeping them saves their bytes at no cost in peak memory (FSDP2
        exempts its root alike; DeepSpeed calls it reuse distance).
      secondary: hpZ: the axis the backward gathers a resharded unit along, from the
        slices of it each rank kept (None: the shards, along the shard axis).
      all_reduce: gradients are all-reduced (stage 0), not reduce-scattered.
      bursts: leaf gradients are written straight into reduction buffers of
        `hold_bytes` that the step function keeps (`_pool`), so buckets of several units
        cost one collective, as in DDP (stage 0: end to end, all-reduced; stages 1-3:
        rank by rank, reduce-scattered; `_bursts`).
      hold_bytes: how many bytes of gradients a burst holds before its reduction starts
        (stages 2-3: the largest unit's); without bursts, complete gradients are held
        until this many bytes are ready, then their reductions start together.
      unit_bursts: stages 2-3 (their memory bound): a burst packs consecutive units up to
        `hold_bytes`, and a unit without gradients of its dtype ends it.
      keep_rows: the rows reduce-scatters return (this rank's gradient) are the step
        function's to keep between steps (`_pool`), not allocated afresh: stage 1,
        whose bound holds full gradients anyway. Stages 2-3 keep no gradient between
        steps: held, the rows would add the gradient shard to the forward's peak.
      in_flight: how many reductions may run while the backward goes on.
      drain: finish the reductions in flight when the next gradient arrives.
      check_calls: compare the units every rank called before the first reduction.
      gather_dtype: what parameters travel in (None: their own dtype).
      reduce_dtype: what gradients are reduced in (None: their own dtype).
      quant_gather: qwZ: parameter gathers travel as int8 blocks of this many elements.
      quant_reduce: qgZ: gradient reduce-scatters do.
    """

    gathers: bool
    hooked: Mapping[str, Any]
    jit: frozenset[str]
    prefetch: bool
    reshard: bool
    all_reduce: bool
    bursts: bool
    hold_bytes: int
    in_flight: int
    drain: bool
    check_calls: bool
    gather_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    secondary: Axis | None = None
    unit_bursts: bool = False
    keep_rows: bool = False
    keep_last: int = 0
    quant_gather: int | None = None
    quant_reduce: int | None = None
    by_leaf: bool = False


def plan(
    stage: Stage,
    layout: ShardLayout,
    world_size: int,
    hooked: Mapping[str, Any],
    *,
    just_in_time: bool,
    prefetch: bool,
    reshard_after_forward: bool,
    overlap_reduce: bool,
    secondary: Axis | None = None,
    quantize: QuantizedComm | None = None,
    reduce_bucket_bytes: int,
    accumulate_locally: bool,
    comm_dtypes: tuple[torch.dtype | None, torch.dtype | None],
    backward: bool = True,
) -> Schedule:
    """The schedule of one step of `stage` under the step's options (`backward` False: of
    a forward without gradients, `sharded_forward`).

    Stage 0 holds every full gradient anyway (it keeps them reduced in place) and stage 1
    reduces a bucket of them at a time: both start a bucket's reductions without waiting
    for one another, as DDP does. Stages 2-3 keep one reduction in flight, so at most two
    units of full gradients are alive. A forward without a backward frees every unit as
    it goes (no backward takes the last ones on), and checks the ranks' calls only where
    they pair gathers (a replica's forward communicates nothing).
    """
    jit = set(hooked)
    if just_in_time:
        jit |= {u for u in layout.units if u and layout.unit_buckets(u)}
    gathers = stage.enter == "all_gather"
    buckets = stage.grads == "buckets"
    all_reduce = stage.reduce == "all_reduce"
    in_flight = (len(layout.buckets) if buckets else 1) if overlap_reduce else 0
    q = quantize
    reshard = reshard_after_forward and gathers and bool(jit)
    quant_reduce = q.block if q is not None and q.grads and not all_reduce else None
    bursts = not accumulate_locally and quant_reduce is None
    if buckets:
        hold = reduce_bucket_bytes
    elif bursts:
        hold = max((_unit_bytes(layout, u, comm_dtypes[1]) for u in layout.units), default=0)
    else:
        hold = 0
    return Schedule(
        gathers=gathers,
        hooked=hooked,
        jit=frozenset(jit),
        prefetch=prefetch and gathers,
        reshard=reshard,
        all_reduce=all_reduce,
        # Local accumulation sums whole unit gradients across micro-batches, and qgZ
        # quantizes unit by unit: both reduce held gradients instead.
        bursts=bursts,
        hold_bytes=hold,
        unit_bursts=bursts and not buckets,
        in_flight=in_flight,
        drain=not all_reduce,
        check_calls=bool(jit) and world_size > 1 and (backward or gathers),
        gather_dtype=comm_dtypes[0],
        reduce_dtype=comm_dtypes[1],
        secondary=secondary if reshard else None,
        keep_rows=buckets and not all_reduce,
        keep_last=(2 if prefetch else 1) if reshard and backward else 0,
        quant_gather=q.block if q is not None and q.weights and gathers else None,
        quant_reduce=quant_reduce,
        by_leaf=backward and differentiates_by_leaf(stage, world_size),
    )


def differentiates_by_leaf(stage: Stage, world_size: int) -> bool:
    """Whether a step of `stage` on `world_size` ranks has nothing to communicate (an
    all-reduce over one rank), and so differentiates by leaf, entering no unit."""
    return stage.reduce == "all_reduce" and world_size == 1


def unit_grad_numels(
    layout: ShardLayout, unit: str, reduce_dtype: torch.dtype | None
) -> dict[torch.dtype, int]:
    """Elements of `unit`'s trainable full gradient per dtype it is reduced in."""
    out: dict[torch.dtype, int] = {}
    for i in layout.unit_buckets(unit):
        b = layout.buckets[i]
        if not b.frozen:
            dtype = reduce_dtype or b.dtype
            out[dtype] = out.get(dtype, 0) + b.full_numel
    return out


def _unit_bytes(layout: ShardLayout, unit: str, reduce_dtype: torch.dtype | None) -> int:
    """Bytes of `unit`'s trainable full gradient, as reduced."""
    return sum(n * d.itemsize for d, n in unit_grad_numels(layout, unit, reduce_dtype).items())
