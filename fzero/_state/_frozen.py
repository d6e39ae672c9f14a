"""Which leaves are frozen: from a bool tree, path prefixes, or the leaves' requires_grad."""

from __future__ import annotations

from typing import Any

from .._core import PyTree, covers, leaf_paths, tree_flatten


def frozen_leaves(params: PyTree, frozen: Any) -> list[bool]:
    """Per leaf: frozen? From a bool tree, path prefixes, or the leaves' requires_grad."""
    leaves = tree_flatten(params)[0]
    if frozen is None:
        flags = [bool(getattr(x, "requires_grad", False)) for x in leaves]
        return [not f for f in flags] if any(flags) else [False] * len(leaves)
    if isinstance(frozen, (list, tuple)) and all(isinstance(p, str) for p in frozen):
        paths = leaf_paths(params)
        for prefix in frozen:
            if not prefix or not any(covers(prefix, p) for p in paths):
                raise ValueError(f"frozen prefix {prefix!r} matches no parameter path")
        return [any(covers(prefix, p) for prefix in frozen) for p in paths]
    mask, mdef = tree_flatten(frozen)
    if mdef != tree_flatten(params)[1] or not all(isinstance(m, bool) for m in mask):
        raise ValueError(
            "frozen must be a pytree of bools shaped like params, or a list of path prefixes"
        )
    return list(mask)
