"""The per-unit autograd nodes of a step: they drive `UnitRun` (see `_unit` for the design)."""

from __future__ import annotations

from typing import Any

import torch

from ._unit import UnitRun, _Call

# The per-unit nodes use the classic `forward(ctx, ...)` form, not setup_context: they run
# under torch.autograd.grad only (see _hooks), and torch binds a setup_context Function's
# arguments with inspect.signature on every call, about 1 ms per unit per step.


class _UnitGather(torch.autograd.Function):
    """Shards in, full buckets out; backward reduces their gradient (`UnitRun.backward`).

    Writing into bursts (stage 0), the node hands out the unit's leaves instead (views of
    its full buckets): its backward then receives each leaf's gradient and writes it,
    divided by the mesh size, straight into the burst, where autograd would first
    assemble a bucket-sized gradient from them. Elsewhere autograd's assembly stays: in
    place of it, a copy per leaf made stage 1 ~3 % slower on the Linear stack.
    """

    @staticmethod
    def forward(ctx: Any, run: UnitRun, call: _Call, *shards: torch.Tensor) -> Any:  # type: ignore[override]
        fulls = run.materialize(call.unit)
        call.attach(fulls)
        run.calls.append(call)
        run.enlist(call)
        ctx.run, ctx.call = run, call
        lay = run.layout
        idx = lay.unit_buckets(call.unit)
        if run.bursts is None:
            # Frozen buckets' full parameters take part in the forward but need no gradient.
            ctx.mark_non_differentiable(*(f for f, i in zip(fulls, idx) if lay.buckets[i].frozen))
            return fulls
        # An unused leaf gets None, not a zero-filled gradient: `paste` zeroes its place.
        ctx.set_materialize_grads(False)
        views = lay.cut_unit(call.unit, fulls)
        pairs = run._by_bucket(call.unit, views)
        frozen = [v for i, vs in pairs if lay.buckets[i].frozen for v in vs]
        ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        return (None, None, *ctx.run.backward(ctx.call, grads))


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on a unit's outputs; its backward re-gathers the unit's freed parameters."""

    @staticmethod
    def forward(ctx: Any, run: UnitRun, call: _Call, *outputs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.run, ctx.call = run, call
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        run, call = ctx.run, ctx.call
        run.refill(call)
        if run.prefetch:  # start re-gathering the unit whose backward comes next
            k = run.calls.index(call)
            if k > 0 and not run.calls[k - 1].reduced:
                run.refill(run.calls[k - 1], wait=False)
        return (None, None, *grads)


def gather_unit(run: UnitRun, unit: str) -> tuple[dict[str, torch.Tensor], _Call]:
    """Creates the unit's node now; returns views of its full leaves by path, and the call."""
    call = _Call(unit)
    idx = run.layout.unit_buckets(unit)
    out = _UnitGather.apply(run, call, *(run.shards[i] for i in idx))
    if run.bursts is None:  # full buckets, cut by autograd
        return run.layout.unflatten_unit(unit, tuple(out)), call
    return dict(zip(run.layout.unit_paths(unit), out, strict=True)), call
