"""Micro-batches: a step's batch cut into them, and the mean gradient over them.

`o` is the step's options (`_train.Options`: accumulate, mesh, ledger); `Memory` what a
step function carries from one call to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core import (
    LossFn,
    ShardLayout,
    Stage,
    sparse_gradient,
    tree_flatten,
    tree_map,
    value_and_grad,
)
from .._engine import CallCheck, Engine, Pool, Schedule, hookable_units
from .._state import ShardedState


@dataclass
class Memory:
    """What a step function carries from one call to the next."""

    order: list[str] = field(default_factory=list)  # just-in-time units, last step's order
    followable: bool = False  # `order` is a real step's (a rank without data follows it)
    micro: int | None = None  # micro-batches of the last step (accumulating)
    warned: bool = False  # a step with no weight anywhere was reported
    hooked: tuple[Any, dict[str, Any]] = (None, {})  # (layout, its hooked units): walked once
    pool: Pool = field(default_factory=Pool)  # gradient bursts' buffers, kept across calls
    # (layout, precision, the schedule planned for them): planned once, as a step's
    # options are the step function's and only the state's layout and precision vary.
    planned: tuple[Any, Any, Schedule | None] = (None, None, None)
    # (layout, per just-in-time unit its leaves' placeholders): made once, not every step
    made: tuple[Any, dict[str, Any]] = (None, {})

    def hooked_units(self, layout: ShardLayout, module: nn.Module | None) -> dict[str, Any]:
        if self.hooked[0] is not layout:
            self.hooked = (layout, hookable_units(layout, module))
        return self.hooked[1]

    def placeholders(self, layout: ShardLayout) -> dict[str, Any]:
        if self.made[0] is not layout:
            self.made = (layout, {})
        return self.made[1]


def mean_grad(
    loss_fn: LossFn,
    micro: list[Any],
    o: Any,
    memory: Memory,
    stage: Stage,
    schedule: Schedule,
    state: ShardedState,
    grads_like: tuple[torch.Tensor, ...],
    local: tuple[torch.Tensor, ...] | None,
    after_forward: Callable[[CallCheck | None], None],
) -> tuple[torch.Tensor, ...]:
    """This rank's reduced gradient per bucket, the mean over every micro-batch (None: no
    data, zeros); `local`: the replicated full buffers (stages 0-2); `after_forward` runs
    once the last forward is done."""
    lay = state.layout
    acc: dict[int, torch.Tensor] | None = {} if o.accumulate == "local" else None
    total = None
    for j, mb in enumerate(micro):
        last = j == len(micro) - 1
        engine = Engine(
            stage,
            schedule,
            lay,
            o.mesh,
            grads_like,
            local,
            ledger=o.ledger,
            order=memory.order,
            acc=acc,
            final=last,
            followable=memory.followable,
            pool=memory.pool,
            placeholders=memory.placeholders(lay),
        )
        _, grads = engine.value_and_grad(loss_fn, mb, after_forward if last else None)
        memory.followable = True
        if total is None:
            total = grads
            continue
        total = tuple(t + g for t, g in zip(total, grads))
    assert total is not None
    if len(micro) > 1:
        total = tuple(t / len(micro) for t in total)
    return total


def leaf_grad(loss_fn: LossFn, micro: list[Any], o: Any, state: ShardedState) -> Any:
    """Stage 0 on one rank: gradients by leaf, the mean over every micro-batch.

    With nothing to communicate there is nothing to gather or reduce unit by unit, so the
    gradient is taken with respect to the leaves themselves, as an eager loop's `.grad`:
    no per-unit nodes and no flat gradient buffers (assembling them copies every gradient
    once more). The values are those of the unit path on one rank, bitwise: gradients
    pass through the reduce dtype as they would through a reduction ("local"
    accumulation sums them first, "sharded" after), and a mean over micro-batches.
    """
    lay = state.layout
    reduce_dtype = None if state.precision is None else state.precision.reduce_dtype
    trainable = lay.trainable(state.params)

    def rounded(g: Any) -> Any:
        return tree_map(lambda x: x.to(reduce_dtype or x.dtype), g)

    total = None
    for mb in micro:
        grads = None
        if mb is not None:
            _, grads = value_and_grad(loss_fn, state.params, mb, rank=0, frozen=lay.frozen)
            # Refused here too, though one rank could apply them: as on any other mesh.
            for path, g in zip(lay.paths, tree_flatten(grads)[0] if grads is not None else []):
                if g is not None and g.layout != torch.strided:
                    raise sparse_gradient(0, path)
        grads = tree_map(torch.zeros_like, trainable) if grads is None else lay.trainable(grads)
        if o.accumulate != "local":
            grads = rounded(grads)
        total = grads if total is None else tree_map(torch.add, total, grads)
    if o.accumulate == "local":
        total = rounded(total)
    if len(micro) > 1:
        total = tree_map(lambda t: t / len(micro), total)
    return total


def micro_batches(batch: Any, o: Any, memory: Memory) -> list[Any]:
    """The step's micro-batches (None: this rank has no data for that one)."""
    if o.accumulate is None:
        return [batch]
    if batch is None:  # no data at all: as many empty micro-batches as last step
        if memory.micro is None:
            raise ValueError(
                f"with accumulate={o.accumulate!r}, step(state, None) repeats the number of "
                "micro-batches of the last step, and there was none: pass [None] * M"
            )
        return [None] * memory.micro
    if not isinstance(batch, list) or not batch:
        # Not a tuple: (x, y) is what one micro-batch looks like, and taken for two
        # micro-batches x and y it may even run, training on the wrong data.
        hint = (
            " (a tuple reads as one micro-batch's fields, such as (x, y): pass [batch], or "
            "a list of micro-batches)"
            if isinstance(batch, tuple)
            else ""
        )
        raise TypeError(
            f"with accumulate={o.accumulate!r} a step takes a non-empty list of micro-batches, "
            f"got {type(batch).__name__}{hint}"
        )
    memory.micro = len(batch)
    return list(batch)
