"""fzero.gathered: a unit's full parameters, inside any loss function, just when it needs them."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from .._core import PyTree, leaf_paths, subtree, subtree_of, tree_flatten, tree_map
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
    compiling = torch.compiler.is_compiling()
    # Compiling, the engine is not read (dynamo cannot trace a ContextVar): a compiled
    # step's tree holds `Unentered` leaves instead, entered here, inside the graph.
    engine = None if compiling else ACTIVE.get()
    if engine is None:
        parts = _entered(params, path, compiling)
        if parts is not None:
            return parts
        engine = ACTIVE.get()  # an eager step's placeholders: its engine, behind a graph break
        if engine is None:
            return pick(path, [subtree(params, p) for p in _paths(path)])
        if compiling:  # a loss the user compiled: the engine's collectives stay out of it
            return torch.compiler.disable(engine.gathered)(params, path)
    return engine.gathered(params, path)


def _paths(path: str | tuple[str, ...]) -> tuple[str, ...]:
    return (path,) if isinstance(path, str) else tuple(path)


def pick(path: str | tuple[str, ...], parts: list[Any]) -> Any:
    """`gathered`'s answer: the one part for a path, a tuple of them for a tuple."""
    return parts[0] if isinstance(path, str) else tuple(parts)


def _entered(params: PyTree, path: str | tuple[str, ...], compiling: bool) -> Any:
    """The parts of `params` under `path`, each `Unentered` leaf's unit entered (once per
    unit and call): into the graph while torch.compile traces a compiled step, or
    eagerly where a compiled step runs without dynamo
    (`torch.compiler.set_stance("force_eager")`).
    None where the tree holds an eager step's placeholders (that step's engine enters
    them; compiling, that is a block the user compiled inside an eager step)."""
    fast = [_walked(params, p) for p in _paths(path)] if compiling else None
    if fast is not None and all(part is not None for part in fast):
        # Plain containers (`_plain`): their leaves are read without optree, whose
        # flatten and map dynamo traces through its Python stand-in at every call.
        parts, leaves_of, swap = fast, _leaves, _swapped
    else:
        leaves_of, swap = _tree_leaves, tree_map
        leaves, treedef = tree_flatten(params)
        if any(isinstance(x, Placeholder) for x in leaves):
            return None
        names = tuple(leaf_paths(params))
        # Compiling, `subtree_of` unwrapped: dynamo traces what lru_cache wraps, and warns.
        cut = subtree_of.__wrapped__ if compiling else subtree_of
        parts = [cut(treedef, names, p)(leaves) for p in _paths(path)]
    found: dict[Any, list[Unentered]] = {}
    for part in parts:
        for x in leaves_of(part):
            if isinstance(x, Unentered):
                found.setdefault(x.unit, []).append(x)
            elif isinstance(x, Placeholder):  # the walk found an eager step's
                return None
    if not found:
        return pick(path, parts)
    views: dict[str, Any] = {}
    for unit, xs in found.items():
        # Counted, not matched by prefix: `params` may be a part of the step's tree.
        if len({x.path for x in xs}) < xs[0].count:
            raise ValueError(
                f"rank {xs[0].rank}: fzero.gathered: {path!r} is only part of the "
                f"just-in-time unit {unit!r}; ask for the whole unit "
                f"(fzero.gathered(params, {unit!r})) or split units= finer, since every call "
                "enters (gathers) the units it names"
            )
        views.update(xs[0].enter())
    return pick(
        path,
        [swap(lambda x: views[x.path] if isinstance(x, Unentered) else x, p) for p in parts],
    )


def _walked(tree: PyTree, prefix: str) -> Any:
    """`subtree(tree, prefix)` found by walking plain dicts, lists and tuples key by key,
    or None where that is not plainly the same answer (the caller then cuts the whole
    flattened tree). Compiling, a loss that asks for many units had dynamo trace a
    flatten of the whole tree and its leaf paths at every call (100 calls over 400
    leaves: most of a 1400 s compile, `benchmarks/RESULTS-compiled.md`); walking costs
    the path's depth, or one pass over a dict's keys. No `Placeholder` is looked for:
    compiling, the step's tree holds none (an eager step's tree, inside a user's
    compiled block, has them where the walk finds them: `_entered` sees them and hands
    the call to the eager engine)."""
    node, rest = tree, prefix
    while rest:
        if type(node) is dict:
            # Names alone: another key may be no constant the trace can hand `_route`.
            # (`map` and `set` dynamo runs itself, not a bytecode at a time.)
            route = _route(tuple(node), rest, node is tree) if _names(node) else None
            if route is None:
                return None
            through, below = route
            if through is not None:
                node, rest = node[through], rest[len(through) + 1 :]
                continue
            under = {k[len(rest) + 1 :]: node[k] for k in below}
            if not under or not all(
                isinstance(v, (torch.Tensor, Unentered)) for v in under.values()
            ):
                return None
            return under
        if type(node) in (list, tuple):
            head, _, tail = rest.partition(".")
            if not head.isdigit() or int(head) >= len(node):
                return None
            node, rest = node[int(head)], tail
            continue
        return None
    if isinstance(node, Placeholder) or not _plain(node):
        return None
    return node


def _names(node: dict) -> bool:
    """Whether every key of `node` is a string."""
    return set(map(type, node)) <= {str}


@torch.compiler.assume_constant_result
def _route(keys: tuple[str, ...], rest: str, top: bool) -> tuple[Any, tuple[str, ...]] | None:
    """A dict's step of `_walked` from its `keys`: `(the one key the path goes through, ())`,
    as `subtree_of` matches entries (the whole `rest`, or a dotted prefix of it); at the
    `top` of the tree, `(None, the keys under the prefix)` (leaves keyed by dotted names,
    `named_parameters`); None where the walk cannot tell. A constant of the trace, worked
    out by Python rather than traced key by key: a loss asking for 100 units of a
    400-leaf dict had dynamo step 1.5 M bytecodes here, most of a 110 s compile."""
    through = [k for k in keys if rest == k or rest.startswith(k + ".")]
    if len(through) == 1:
        return through[0], ()
    if through or not top:
        return None
    return None, tuple(k for k in keys if k.startswith(rest + "."))


def _plain(node: Any) -> bool:
    """Whether `node` is a tensor, an `Unentered` leaf, or plain dicts keyed by strings,
    lists and tuples of them (what the walk may hand back as it is)."""
    if isinstance(node, (torch.Tensor, Unentered)):
        return True
    if type(node) is dict:
        return _names(node) and all(_plain(v) for v in node.values())
    if type(node) in (list, tuple):
        return all(_plain(v) for v in node)
    return False


def _tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of any tree, as optree flattens it in fzero's namespace."""
    return tree_flatten(tree)[0]


def _leaves(node: Any) -> list[Any]:
    """The leaves of a `_plain` node in optree's order (a dict's by sorted key)."""
    if type(node) is dict:
        return [x for k in sorted(node) for x in _leaves(node[k])]
    if type(node) in (list, tuple):
        return [x for v in node for x in _leaves(v)]
    return [node]


def _swapped(fn: Any, node: Any) -> Any:
    """`tree_map(fn, node)` over a `_plain` node (a dict keeps its key order)."""
    if type(node) is dict:
        return {k: _swapped(fn, v) for k, v in node.items()}
    if type(node) in (list, tuple):
        return type(node)([_swapped(fn, v) for v in node])
    return fn(node)
