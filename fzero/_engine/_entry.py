"""A unit's parameters entering the loss: the one differentiable primitive every stage is.

`enter(runner, entry, shards)` is one autograd node per entry of a unit (a unit called
twice enters twice). Its forward gives the unit's full parameters, as the stage enters
them (`Stage.enter`): this rank's replica (identity) or the all-gather of every rank's
shard. Its backward is the transpose (`Stage.reduce`): the unit's gradient, all-reduced
or reduce-scattered (mean over ranks). *When* either happens (now, prefetched, held in
buckets, overlapped with the rest of the backward) is its `Runner`'s business:

- `_engine.Engine` runs a step's units, scheduled by a `_schedule.Schedule`;
- `_by_hand.Now` runs the standalone primitives (`gather_params`), synchronously.

A node created just in time (in a module pre-hook, or when the loss calls
`fzero.gathered`) runs its backward as soon as the unit's backward is complete; nodes
created before the forward run only at the very end (docs/design.md, [Note: just in
time]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._core import ShardLayout


@dataclass(frozen=True, eq=False)
class Entry:
    """One entry of one unit into the loss (a unit called twice enters twice).

    Immutable, and hashed by identity: each side of the engine keeps its own record of an
    entry (the source what it gathered, the reductions its place in the order) keyed by it.
    An entry made inside the backward (a checkpoint's recompute) is the `twin` of the
    forward's latest entry of the unit not yet reduced: the same parameters, and no
    gradient of its own.
    """

    unit: str
    buckets: tuple[int, ...]
    twin: Entry | None = None


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class Runner(Protocol):
    """What a node asks of whoever runs it: a step's `_engine.Engine`, or `_by_hand.Now`."""

    layout: ShardLayout
    leaf_grads: bool  # hand out the unit's leaves and take their gradients (bursts)

    def open(self, entry: Entry, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The full flat buffers of `entry`'s buckets."""
        ...

    def close(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        """Takes the gradients of what `open` gave (None: unused) and returns the shards'
        (None where the runner hands them over some other way)."""
        ...


def _outputs(ctx: Any, runner: Runner, entry: Entry, fulls: tuple[torch.Tensor, ...]) -> Any:
    lay = runner.layout
    frozen = [lay.buckets[i].frozen for i in entry.buckets]
    if not runner.leaf_grads:
        # Frozen buckets' full parameters take part in the forward but need no gradient.
        ctx.mark_non_differentiable(*(f for f, fz in zip(fulls, frozen) if fz))
        return fulls
    # The unit's leaves (views of its full buckets): the backward receives each leaf's
    # gradient, which the engine writes straight into its reduction buffer, where
    # autograd would first assemble a bucket-sized gradient from them. An unused leaf
    # gets None, not a zero-filled gradient.
    ctx.set_materialize_grads(False)
    views = lay.cut_unit(entry.unit, fulls)
    dead = [v for v, i in zip(views, lay.unit_leaf_buckets(entry.unit)) if lay.buckets[i].frozen]
    ctx.mark_non_differentiable(*dead)
    return tuple(views)


class _Enter(torch.autograd.Function):
    """The node in the classic `forward(ctx, ...)` form, cheaper per call than the
    setup_context form; steps differentiate with torch.autograd, which takes it
    ([Note: the gradient engine])."""

    @staticmethod
    def forward(ctx: Any, runner: Runner, entry: Entry, *shards: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.runner, ctx.entry = runner, entry
        return _outputs(ctx, runner, entry, runner.open(entry, shards))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *ctx.runner.close(ctx.entry, grads))


class _EnterFunc(torch.autograd.Function):
    """The same node in setup_context form, which torch.func's transforms require."""

    @staticmethod
    def forward(runner: Runner, entry: Entry, *shards: torch.Tensor) -> Any:  # type: ignore[override]
        return runner.open(entry, shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.runner, ctx.entry = inputs[0], inputs[1]
        lay = ctx.runner.layout
        frozen = [f for f, i in zip(output, ctx.entry.buckets) if lay.buckets[i].frozen]
        ctx.mark_non_differentiable(*frozen)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *ctx.runner.close(ctx.entry, grads))


def enter(
    runner: Runner, entry: Entry, shards: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """`entry`'s unit entering the loss through `runner`: its full buckets (or, when the
    runner takes leaf gradients, its leaves in `ShardLayout.unit_paths` order)."""
    if torch._C._are_functorch_transforms_active():
        if runner.leaf_grads:
            raise RuntimeError("leaf gradients are not available under torch.func")
        return tuple(_EnterFunc.apply(runner, entry, *shards))
    return tuple(_Enter.apply(runner, entry, *shards))
