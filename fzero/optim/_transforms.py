"""Gradient transformations (clipping) and `chain`, which ends them in an optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .._core import device_of
from ._base import Grads, Optimizer, OptState, Params
from ._context import current, global_sum, grads_owned, owns_grads, sum_of_squares


class GradientTransformation(NamedTuple):
    """`init(params) -> state`; `update(grads, state, params) -> (new_grads, new_state)`."""

    init: Callable[[Params], OptState]
    update: Callable[[Grads, OptState, Params], tuple[Grads, OptState]]


class ClipState(NamedTuple):
    """State of :func:`clip_by_global_norm`.

    Attributes:
      norm: the global gradient norm of the last update, before clipping (0-d float64):
        over every parameter of every rank, never a rank's own share.
    """

    norm: torch.Tensor


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales gradients so their global L2 norm is at most `max_norm`.

    As `torch.nn.utils.clip_grad_norm_(parameters, max_norm)`: the coefficient is
    `max_norm / (norm + 1e-6)`, clamped to 1. Under `fzero.sharded_update` the norm is
    the TRUE global one: each rank's sum of squares over its shard, summed over ranks (one
    all-reduce of a scalar); a replicated (stage 0) update needs no communication. Out of
    place, but for a step's own gradient buffers (`grads_owned`), scaled where they are.

    Args:
      max_norm: the largest global norm let through.

    Returns:
      A GradientTransformation whose state (ClipState) reports the norm.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")

    def init(params: Params) -> ClipState:
        return ClipState(torch.zeros((), dtype=torch.float64, device=device_of(params)))

    @torch.no_grad()
    def update(grads: Grads, state: ClipState, params: Params) -> tuple[Grads, ClipState]:
        leaves = optree.tree_leaves(grads)
        ctx = current()
        if ctx is not None and ctx.whole is not None:  # one unit of the update (offload)
            norm = ctx.whole.norm_sq(leaves).sqrt()
        else:
            # Summed where the gradients are (a GPU's, all-reduced by NCCL): nothing is
            # read back to the host, so clipping costs no sync.
            norm = global_sum(sum_of_squares(leaves, device_of(grads))).sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        cast: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

        def like(g: torch.Tensor) -> torch.Tensor:
            key = (g.device, g.dtype)
            if key not in cast:
                cast[key] = coef.to(g.device, g.dtype)
            return cast[key]

        if owns_grads():  # a step's own buffers: scaled where they are, the same values
            for g in leaves:
                g.mul_(like(g))
            return grads, ClipState(norm)
        return optree.tree_map(lambda g: g * like(g), grads), ClipState(norm)

    return GradientTransformation(init, update)


def chain(*parts: Any) -> Optimizer:
    """Gradient transformations applied in order, then an optimizer (the last argument).

    `chain(clip_by_global_norm(1.0), adamw(lr=3e-4))` clips the gradient, then steps.

    Args:
      *parts: GradientTransformations, then one Optimizer.

    Returns:
      An Optimizer whose state is a tuple: each transformation's state, then the
      optimizer's.
    """
    if not parts or not isinstance(parts[-1], Optimizer):
        raise TypeError("chain(...) must end in an Optimizer, e.g. fzero.optim.adamw()")
    *transforms, optimizer = parts
    for t in transforms:
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: {t!r} is not a GradientTransformation")

    def init(params: Params) -> tuple[Any, ...]:
        return (*(t.init(params) for t in transforms), optimizer.init(params))

    def run(step: Any) -> Callable[[Grads, tuple[Any, ...], Params], tuple[Params, Any]]:
        def update(grads: Grads, state: tuple[Any, ...], params: Params) -> tuple[Params, Any]:
            new_states = []
            owned = owns_grads()
            for t, s in zip(transforms, state[:-1], strict=True):
                before = optree.tree_leaves(grads)
                with grads_owned(owned):
                    grads, s = t.update(grads, s, params)
                new_states.append(s)
                # Leaves a transformation made (its own state, say) are not the caller's
                # scratch: the rest of the chain must not scale them in place.
                after = optree.tree_leaves(grads)
                owned = (
                    owned
                    and len(after) == len(before)
                    and all(a is b for a, b in zip(after, before))
                )
            with grads_owned(owned):
                params, last = step(grads, state[-1], params)
            return params, (*new_states, last)

        return update

    inplace = run(optimizer.update_) if optimizer.update_ is not None else None
    return Optimizer(init, run(optimizer.update), inplace, optimizer.whole_tensors, optimizer.fused)
