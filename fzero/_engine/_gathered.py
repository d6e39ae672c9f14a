"""fzero.gathered: a unit's full parameters, inside any loss function, just when it needs them."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from .._core import PyTree, subtree

# The engine of the step whose loss is running on this thread (None outside a step).
ACTIVE: ContextVar[Any] = ContextVar("fzero_active_engine", default=None)


def gathered(params: PyTree, path: str | tuple[str, ...]) -> Any:
    """The full parameters under `path`, entering the loss here.

    Inside a step, the units under `path` enter the loss here, the JAX way: at stage 3
    their shards are all-gathered now (or the prefetched gather is waited for) and their
    gradient is reduce-scattered as soon as their backward is complete; at stages 0-2 the
    replica enters through an identity whose backward reduces. With
    `sharded_step(..., just_in_time=True)` every unit but the root is a placeholder in
    `params` until asked for here. Every call enters anew (two calls, two gathers and two
    reductions): keep what it returns while you use it. Outside a step, or on a tree that
    is not the step's, it returns the part of `params` under `path`: the same loss runs
    anywhere (docs/training.md).

    Args:
      params: the tree the step passed to the loss.
      path: a dotted path prefix ("layers.0"): a unit, a node holding whole units, or
        anything within a unit entered before the forward; or a tuple of such paths
        (a grouped unit's prefixes), entered together. Part of a just-in-time unit is a
        ValueError: ask for the whole unit.

    Returns:
      The part of the tree under `path` (for a tree keyed by dotted names, such as
      `named_parameters`, a dict of the leaves under it keyed by the rest of their path);
      for a tuple of paths, a tuple of those parts.
    """
    engine = ACTIVE.get()
    if engine is None:
        if isinstance(path, str):
            return subtree(params, path)
        return tuple(subtree(params, p) for p in path)
    return engine.gathered(params, path)
