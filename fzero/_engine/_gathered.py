"""fzero.gathered: a unit's full parameters, inside any loss function, just when it needs them."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from .._core import (
    PyTree,
    covers,
    leaf_paths,
    spec_of,
    subtree,
    subtree_of,
    tree_flatten,
    tree_map,
)
from ._placeholder import Placeholder, Unentered

# The engine of the step whose loss is running on this thread (None outside a step).
ACTIVE: ContextVar[Any] = ContextVar("fzero_active_engine", default=None)


def gathered(params: PyTree, path: str | tuple[str, ...]) -> Any:
    """The full parameters under `path`, entering the loss here.

    Inside a step, the units under `path` enter the loss here, the JAX way: at stage 3
    their shards are all-gathered now (or the prefetched gather is waited for) and their
    gradient is reduce-scattered as soon as their backward is complete; at stages 0-2 the
    replica enters through an identity whose backward reduces. With
    `sharded_step(..., just_in_time=True)` every unit but the root is a placeholder in
    `params` until asked for here (in a compiled step, the unit's entry joins the traced
    graph here: the graph gathers it where the loss first needs it). Every call enters
    anew (two calls, two gathers and two reductions): keep what it returns while you use
    it. Outside a step, or on a tree that
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
    if torch.compiler.is_compiling():
        parts = _traced(params, path)
        if parts is not None:
            return parts
    engine = ACTIVE.get()
    if engine is None:
        if isinstance(path, str):
            return subtree(params, path)
        return tuple(subtree(params, p) for p in path)
    return engine.gathered(params, path)


def _traced(params: PyTree, path: str | tuple[str, ...]) -> Any:
    """`gathered` while torch.compile traces: the parts under `path`, each `Unentered`
    leaf's unit entered into the graph (once per unit and call); None where the tree
    holds an eager step's placeholders (a block compiled by the user inside an eager
    step: that step's engine enters them, behind a graph break)."""
    paths = (path,) if isinstance(path, str) else tuple(path)
    leaves, treedef = tree_flatten(params)
    if any(isinstance(x, Placeholder) for x in leaves):
        return None
    names = tuple(leaf_paths(params))
    # `subtree_of` unwrapped: dynamo traces what lru_cache wraps, and warns that it does.
    parts = [subtree_of.__wrapped__(treedef, names, p)(leaves) for p in paths]
    views: dict[str, Any] = {}
    for part in parts:
        for x in tree_flatten(part)[0]:
            if not isinstance(x, Unentered) or x.path in views:
                continue
            if not all(any(covers(p, m) for p in paths) for m in x.members):
                raise ValueError(
                    f"rank {x.rank}: fzero.gathered: {path!r} is only part of the "
                    f"just-in-time unit {x.unit!r}; ask for the whole unit "
                    f"(fzero.gathered(params, {spec_of(x.members)!r})) or split units= finer, "
                    "since every call enters (gathers) the units it names"
                )
            views.update(x.enter())
    if views:
        parts = [
            tree_map(lambda x: views[x.path] if isinstance(x, Unentered) else x, part)
            for part in parts
        ]
    return parts[0] if isinstance(path, str) else tuple(parts)
