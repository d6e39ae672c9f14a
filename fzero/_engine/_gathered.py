"""fzero.gathered: a unit's full parameters, inside any loss function, just when it needs them."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from .._core import PyTree, subtree

# The engine of the step whose loss is running on this thread (None outside a step).
ACTIVE: ContextVar[Any] = ContextVar("fzero_active_engine", default=None)


def gathered(params: PyTree, path: str | tuple[str, ...]) -> Any:
    """The full parameters under `path`, entering the loss here.

    Inside a step, this is where the parameters of the units under `path` enter the
    loss, the JAX way: at stage 3 their shards are all-gathered now (or the gather
    prefetched for them is waited for), and the reduce-scatter of their gradient runs as
    soon as their backward is complete; at stages 0-2 the rank's replica enters through
    an identity whose backward reduces the gradient. With
    `sharded_step(..., just_in_time=True)` every unit but the root is only a placeholder
    in `params` until the loss asks for it here, so a stage-3 step holds a few units'
    full parameters at a time, not the model; with `reshard_after_forward` they are freed
    once the loss lets go of what this returns, and gathered again for the backward.
    Every call enters what it names anew (two calls, two gathers and two reductions):
    keep what it returns for as long as you use it.

    A unit grouping several prefixes (`units=[("layers.0", "layers.1")]`) enters as one:
    ask for it with the same tuple, `gathered(params, ("layers.0", "layers.1"))`, which
    returns the part of the tree under each.

    Outside a step, or on a tree that is not the step's (say, the full parameters of a
    single-process reference), it simply returns the part of `params` under `path`: the
    same loss runs anywhere.

    Args:
      params: the tree the step passed to the loss.
      path: a dotted path prefix of the tree ("layers.0"): a unit, a node holding whole
        units, or anything within a unit entered before the forward (the root); or a
        tuple of such paths, entered together. A path holding only part of a
        just-in-time unit (strictly inside it, or one prefix of a group) is a
        ValueError: ask for the whole unit.

    Returns:
      The part of the tree under `path`: the node it names (`params["layers"][0]` for
      "layers.0"), or, for a tree keyed by dotted names such as `named_parameters`, a
      dict of the leaves under it keyed by the rest of their path (`{"weight": ...}`).
      For a tuple of paths, a tuple of those parts.
    """
    engine = ACTIVE.get()
    if engine is None:
        if isinstance(path, str):
            return subtree(params, path)
        return tuple(subtree(params, p) for p in path)
    return engine.gathered(params, path)
