"""An optimizer state seen piece by piece: the subtrees that mirror the pieces, and globals.

`optimizer.init(pieces)` on a tuple of pieces (a rank's flat shards, or its owned tensors)
gives a state in which some subtrees hold one entry per piece (Adam's `mu` and `nu`) and
some tensors are global to the update (the step count, a clipping norm). Checkpoints name
the entries by piece to reshard them; offload steps the pieces a unit at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch


class StateShapeError(TypeError):
    """An optimizer state holds something other than tensors in dicts, lists, tuples and
    NamedTuples, so it cannot be cut by piece."""


def walk(
    tree: Any,
    spec: optree.PyTreeSpec,
    on_node: Callable[[str, Any], Any],
    on_global: Callable[[str, torch.Tensor], Any],
    path: str = "",
) -> Any:
    """Rebuilds an optimizer state, mapping per-piece subtrees and global tensors.

    A subtree with the structure `spec` (one entry per piece) goes to `on_node`; a tensor
    elsewhere (a step count) to `on_global`; None stays None. Containers are rebuilt with
    their own types, so NamedTuple states come back as themselves.

    Args:
      tree: the optimizer state.
      spec: the structure of what the optimizer was initialised with (one leaf per piece).
      on_node: `(path, subtree) -> new subtree` for each per-piece subtree.
      on_global: `(path, tensor) -> new tensor` for each global tensor.
      path: the path of `tree` in the whole state ("" at the root).

    Returns:
      The rebuilt state.

    Raises:
      StateShapeError: a node is not a tensor, None or a dict, list, tuple or NamedTuple.
    """
    try:
        # A piece's state is a tensor, a dict of them (from_torch's) or None: a tuple of
        # states (chain's) with as many entries as there are pieces is not per-piece.
        # The root's type and size first: optree's message for a mismatch prints the
        # tree, tensors and all, which costs more than the walk.
        matches = _same_root(tree, spec) and all(
            e is None or isinstance(e, (torch.Tensor, dict)) for e in spec.flatten_up_to(tree)
        )
    except (ValueError, TypeError):
        matches = False
    if matches:
        return on_node(path, tree)
    if isinstance(tree, torch.Tensor):
        return on_global(path, tree)
    if tree is None:
        return None

    def sub(key: Any, child: Any) -> Any:
        return walk(child, spec, on_node, on_global, f"{path}.{key}" if path else str(key))

    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(sub(f, getattr(tree, f)) for f in tree._fields))
    if isinstance(tree, dict):
        return {k: sub(k, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(sub(i, v) for i, v in enumerate(tree))
    raise StateShapeError(
        f"optimizer state at {path or '<root>'!r} is a {type(tree).__name__}: states cut by "
        "piece (checkpoints, offload) hold tensors in dicts, lists, tuples and NamedTuples"
    )


def _same_root(tree: Any, spec: optree.PyTreeSpec) -> bool:
    """Whether `tree`'s root could match `spec`'s: same container type and size."""
    if spec.type is None:  # a leaf matches anything
        return True
    return type(tree) is spec.type and len(tree) == spec.num_children


def pieces_spec(n: int) -> optree.PyTreeSpec:
    """The structure `optimizer.init` sees for `n` pieces: a tuple of them."""
    return optree.tree_structure(tuple(range(n)))


def select(
    state: Any, n: int, idx: Sequence[int], on_global: Callable[[str, torch.Tensor], Any]
) -> Any:
    """The state of pieces `idx` alone (of `n`), as `optimizer.init` would have made it for
    those pieces: every per-piece subtree cut to their entries, globals through `on_global`.
    """
    spec = pieces_spec(n)
    return walk(state, spec, lambda _, t: tuple(spec.flatten_up_to(t)[j] for j in idx), on_global)


def by_piece(state: Any, n: int) -> tuple[dict[str, list[Any]], dict[str, torch.Tensor]]:
    """Each per-piece subtree's entries (by node path) and each global tensor (by path)."""
    spec, nodes, globals_ = pieces_spec(n), {}, {}

    def node(path: str, tree: Any) -> Any:
        nodes[path] = list(spec.flatten_up_to(tree))
        return tree

    def glob(path: str, value: torch.Tensor) -> torch.Tensor:
        globals_[path] = value
        return value

    walk(state, spec, node, glob)
    return nodes, globals_


def assemble(
    like: Any, n: int, nodes: dict[str, list[Any]], globals_: dict[str, torch.Tensor]
) -> Any:
    """A state shaped as `like` (of `n` pieces) holding `nodes`' entries and `globals_`."""
    spec = pieces_spec(n)
    return walk(
        like,
        spec,
        lambda path, _: optree.tree_unflatten(spec, nodes[path]),
        lambda path, _: globals_[path],
    )
