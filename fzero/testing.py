"""Test your own model under fzero: hypothesis strategies and a stage-equivalence check."""

# hypothesis is a test dependency, not a runtime one: it is imported inside the strategy
# functions, so `import fzero` (which imports this module) never needs it, and
# `assert_stages_equivalent` works without it.

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._core import PyTree, UnitSpec, covers, leaf_paths, tree_flatten, tree_unflatten
from ._tools import assert_stages_equivalent as assert_stages_equivalent

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "assert_stages_equivalent",
    "param_trees",
    "split_batch",
    "stages",
    "unit_splits",
    "world_sizes",
]


def _strategies() -> Any:
    try:
        from hypothesis import strategies as st
    except ImportError as exc:  # pragma: no cover - hypothesis is in fzero's test extra
        raise ImportError(
            "fzero.testing's strategies need hypothesis: pip install 'fzero[test]'"
        ) from exc
    return st


def world_sizes(min_value: int = 1, max_value: int = 4) -> SearchStrategy[int]:
    """World sizes for `fzero.simulate`, shrinking towards `min_value`.

    Args:
      min_value: the smallest world size.
      max_value: the largest; every simulated rank is a process, so keep it small on
        machines with few cores.

    Returns:
      A strategy of ints in `[min_value, max_value]`.
    """
    if not 1 <= min_value <= max_value:
        raise ValueError(f"need 1 <= min_value <= max_value, got {min_value}, {max_value}")
    return _strategies().integers(min_value, max_value)


def stages(values: Sequence[int] = (0, 1, 2, 3)) -> SearchStrategy[int]:
    """ZeRO stages, shrinking towards the first of `values` (stage 0 by default).

    Args:
      values: the stages to draw from.

    Returns:
      A strategy of ints.
    """
    if not values or any(s not in (0, 1, 2, 3) for s in values):
        raise ValueError(f"stages must be a non-empty subset of 0-3, got {values!r}")
    return _strategies().sampled_from(tuple(values))


def param_trees(
    *,
    dtypes: Sequence[torch.dtype] = (torch.float64,),
    max_leaves: int = 6,
    max_depth: int = 3,
    max_dim: int = 7,
    allow_empty: bool = False,
    scale: float = 0.5,
) -> SearchStrategy[dict[str, Any]]:
    """Parameter pytrees with awkward shapes: nested dicts and lists of tensors.

    The root is a dict (like `dict(model.named_parameters())`); below it, dicts and lists
    nest up to `max_depth` levels. Leaves are 0-d tensors, 1-element tensors and tensors
    of up to three dimensions whose sizes (1 to `max_dim`) mostly divide no world size, so
    flat buffers need padding and shards split tensors. Values are normal with standard
    deviation `scale`. Dict keys are short identifiers without dots, so dotted leaf
    paths ("blocks.0.w") and `units=` prefixes stay unambiguous.

    Args:
      dtypes: floating dtypes the leaves are drawn from (float64 only by default: tight
        comparisons; add torch.float32 for mixed-dtype trees, which fzero packs into one
        flat buffer per dtype).
      max_leaves: the most leaves in a tree (at least one).
      max_depth: the deepest nesting of containers below the root dict.
      max_dim: the largest size of a dimension.
      allow_empty: also draw tensors with a zero-size dimension.
      scale: the values' standard deviation.

    Returns:
      A strategy of dicts of nested dicts, lists and tensors.
    """
    st = _strategies()
    if max_leaves < 1 or max_depth < 0 or max_dim < 1:
        raise ValueError("need max_leaves >= 1, max_depth >= 0 and max_dim >= 1")
    if not dtypes or any(not d.is_floating_point for d in dtypes):
        raise ValueError(f"dtypes must be non-empty floating dtypes, got {dtypes!r}")
    names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=4)
    sizes = st.integers(0 if allow_empty else 1, max_dim)
    shapes = st.one_of(
        st.just(()), st.just((1,)), st.lists(sizes, min_size=1, max_size=3).map(tuple)
    )

    @st.composite
    def trees(draw: Any) -> dict[str, Any]:
        budget = [draw(st.integers(1, max_leaves))]  # leaves still to place

        def node(depth: int) -> Any:
            kinds = ["leaf"] if depth > max_depth or budget[0] == 1 else ["leaf", "dict", "list"]
            kind = draw(st.sampled_from(kinds))
            if kind == "leaf":
                budget[0] -= 1
                return draw(shapes), draw(st.sampled_from(tuple(dtypes)))
            return container(kind, depth + 1)

        def container(kind: str, depth: int) -> Any:
            # Every container holds at least one leaf: fzero rejects trees without leaves.
            n = draw(st.integers(1, min(3, budget[0])))
            children = []
            for _ in range(n):
                if budget[0] == 0:
                    break
                children.append(node(depth))
            if kind == "list":
                return children
            keys = draw(
                st.lists(names, min_size=len(children), max_size=len(children), unique=True)
            )
            return dict(zip(keys, children))

        spec = container("dict", 1)
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))

        def fill(leaf: tuple[tuple[int, ...], torch.dtype]) -> torch.Tensor:
            shape, dtype = leaf
            return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)

        return _map_specs(fill, spec)

    return trees()


def _map_specs(fn: Callable[[Any], Any], spec: Any) -> Any:
    # The spec tree's leaves are (shape, dtype) tuples, which a pytree map would descend into.
    if isinstance(spec, dict):
        return {k: _map_specs(fn, v) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_map_specs(fn, v) for v in spec]
    return fn(spec)


def unit_splits(
    params: PyTree, *, max_size: int | None = None, groups: bool = False
) -> SearchStrategy[list[UnitSpec]]:
    """Valid `units=` arguments for `params`: lists of distinct dotted path prefixes.

    A candidate is any prefix of a leaf's dotted path on whole components ("blocks",
    "blocks.0", "blocks.0.w"), so draws include nested units (the longest prefix wins),
    single leaves as units, and the empty list (everything in the root unit). Use it with
    `flatmap` to pair a drawn tree with its splits:
    `param_trees().flatmap(lambda p: st.tuples(st.just(p), unit_splits(p)))`.

    Args:
      params: the parameter tree the units are for.
      max_size: the most units in a split (default: no limit).
      groups: also draw groups, several prefixes as one unit (`("blocks.0", "head")`),
        in any order; a group never holds a prefix inside another of its own.

    Returns:
      A strategy of lists of prefixes (and, with `groups`, tuples of them), each prefix
      matching at least one leaf and appearing once.
    """
    st = _strategies()
    candidates: list[str] = []
    for path in leaf_paths(params):
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix not in candidates:
                candidates.append(prefix)
    drawn = st.lists(st.sampled_from(candidates), unique=True, max_size=max_size)
    if not groups:
        return drawn

    def join(prefixes: list[str], joins: list[bool]) -> list[UnitSpec]:
        out: list[list[str]] = []
        for p, j in zip(prefixes, joins, strict=True):
            nested = out and any(covers(p, q) or covers(q, p) for q in out[-1])
            if j and out and not nested:
                out[-1].append(p)
            else:
                out.append([p])
        return [g[0] if len(g) == 1 else tuple(g) for g in out]

    return drawn.flatmap(
        lambda ps: st.lists(st.booleans(), min_size=len(ps), max_size=len(ps)).map(
            lambda js: join(ps, js)
        )
    )


def split_batch(batch: PyTree, world_size: int) -> list[PyTree]:
    """Splits a global batch into `world_size` equal micro-batches along dimension 0.

    Args:
      batch: a tensor or a pytree of tensors (e.g. `(x, y)`) sharing dimension 0.
      world_size: the number of ranks; must divide dimension 0, since equal micro-batch
        sizes are what make the mean of per-rank mean losses the global mean loss.

    Returns:
      The micro-batches, in rank order; each has `batch`'s structure.
    """
    leaves, treedef = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves}
    if len(sizes) != 1 or next(iter(sizes)) % world_size:
        raise ValueError(
            f"every leaf of the batch needs one dimension-0 size divisible by {world_size}, "
            f"got sizes {sorted(sizes)}"
        )
    per_leaf = [leaf.chunk(world_size) for leaf in leaves]
    return [tree_unflatten(treedef, [c[r] for c in per_leaf]) for r in range(world_size)]
