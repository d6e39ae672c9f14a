"""A unit's parameters entering the loss: the one differentiable primitive every stage is.

`enter(engine, call, shards)` is one autograd node per entry of a unit (a unit called
twice enters twice). Its forward gives the unit's full parameters, as the stage enters
them (`Stage.enter`): this rank's replica (identity) or the all-gather of every rank's
shard. Its backward is the transpose (`Stage.reduce`): the unit's gradient, all-reduced
or reduce-scattered (mean over ranks). *When* either happens (now, prefetched, held in
buckets, overlapped with the rest of the backward) is the engine's business:

- `_engine.Engine` runs a step's units, scheduled by a `_schedule.Schedule`;
- `_gather.Now` runs the standalone primitives (`gather_params`), synchronously.

A node created just in time (in a module pre-hook, or when the loss calls
`fzero.gathered`) runs its backward as soon as the unit's backward is complete: autograd
runs a node once all its consumers are done and prefers the newest ready node. Nodes
created before the forward run only at the very end, with every unit's full gradient
alive until then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._core import ShardLayout


@dataclass(eq=False)
class Call:
    """One entry of one unit into the loss, and what its engine keeps about it.

    `held`, `followed` and `refill` are the forward side's (the gathered buffers it holds,
    None while the loss alone holds them, which it then follows weakly; re-gathers in
    flight); `order` and `reduced` the backward side's.
    """

    unit: str
    buckets: tuple[int, ...]
    order: int | None = None  # place in the order every rank reduces in
    reduced: bool = False
    held: list[torch.Tensor | None] = field(default_factory=list)
    followed: list[Any] = field(default_factory=list)  # weak references to dropped buffers
    refill: list[Any] = field(default_factory=list)  # (bucket position, full, work) in flight
    secondary: list[torch.Tensor] = field(default_factory=list)  # hpZ: this rank's 1/k slices
    # An entry inside the backward (a checkpoint's recompute) is the twin of the forward's
    # latest entry of the unit: the same parameters, and no gradient of its own.
    twin: Call | None = None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class Engine(Protocol):
    """What a node asks of whoever runs it."""

    layout: ShardLayout
    leaf_grads: bool  # hand out the unit's leaves and take their gradients (bursts)

    def open(self, call: Call, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The full flat buffers of `call`'s buckets."""
        ...

    def close(self, call: Call, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """Takes the gradients of what `open` gave (None: unused) and returns the shards'
        (None where the engine hands them over some other way)."""
        ...


def _outputs(ctx: Any, engine: Engine, call: Call, fulls: tuple[torch.Tensor, ...]) -> Any:
    lay = engine.layout
    frozen = [lay.buckets[i].frozen for i in call.buckets]
    if not engine.leaf_grads:
        # Frozen buckets' full parameters take part in the forward but need no gradient.
        ctx.mark_non_differentiable(*(f for f, fz in zip(fulls, frozen) if fz))
        return fulls
    # The unit's leaves (views of its full buckets): the backward receives each leaf's
    # gradient, which the engine writes straight into its all-reduce buffer, where
    # autograd would first assemble a bucket-sized gradient from them. An unused leaf
    # gets None, not a zero-filled gradient.
    ctx.set_materialize_grads(False)
    views = lay.cut_unit(call.unit, fulls)
    dead = [v for v, i in zip(views, lay.unit_leaf_buckets(call.unit)) if lay.buckets[i].frozen]
    ctx.mark_non_differentiable(*dead)
    return tuple(views)


class _Enter(torch.autograd.Function):
    """The node in the classic `forward(ctx, ...)` form: torch binds a setup_context-style
    Function's arguments with inspect.signature on every call (~45 µs here), once per
    unit per step. Steps differentiate with torch.autograd, which takes this form."""

    @staticmethod
    def forward(ctx: Any, engine: Engine, call: Call, *shards: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.engine, ctx.call = engine, call
        return _outputs(ctx, engine, call, engine.open(call, shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *ctx.engine.close(ctx.call, grads))


class _EnterFunc(torch.autograd.Function):
    """The same node in setup_context form, which torch.func's transforms require."""

    @staticmethod
    def forward(engine: Engine, call: Call, *shards: torch.Tensor) -> Any:  # type: ignore[override]
        return engine.open(call, shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.engine, ctx.call = inputs[0], inputs[1]
        lay = ctx.engine.layout
        frozen = [f for f, i in zip(output, ctx.call.buckets) if lay.buckets[i].frozen]
        ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *ctx.engine.close(ctx.call, grads))


def enter(engine: Engine, call: Call, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """`call`'s unit entering the loss through `engine`: its full buckets (or, when the
    engine takes leaf gradients, its leaves in `ShardLayout.unit_paths` order)."""
    if torch._C._are_functorch_transforms_active():
        if engine.leaf_grads:
            raise RuntimeError("leaf gradients are not available under torch.func")
        return tuple(_EnterFunc.apply(engine, call, *shards))
    return tuple(_Enter.apply(engine, call, *shards))
