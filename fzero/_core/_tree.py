"""Pytree helpers: dotted leaf paths, flatten/unflatten, byte counts and closeness checks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

# fzero's own pytree nodes (Shards, ShardedState) are registered in this namespace, so
# every tree operation inside fzero passes it; a user's plain optree call sees them as leaves.
NAMESPACE = "fzero"

PyTree = Any


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens `tree` (None is a node with no leaves, as in JAX)."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treedef: optree.PyTreeSpec, leaves: list[Any]) -> PyTree:
    """Inverse of `tree_flatten`."""
    return optree.tree_unflatten(treedef, leaves)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """`optree.tree_map` in fzero's namespace."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def unaliased(tree: PyTree, *owners: PyTree) -> PyTree:
    """`tree` with copies of its tensors that share memory with a tensor of `owners` (a
    weight returned as it is, or a view of one): memory the owner reuses or updates in
    place after the tree is handed back. Tensors that share none are returned as they are,
    and a tree with none of them as it is. Containers fzero's trees leave whole are looked
    into as torch's pytree sees them (Hugging Face's `ModelOutput` is registered there).
    """
    owned = {
        x.untyped_storage().data_ptr()
        for owner in owners
        for x in tree_flatten(owner)[0]
        if isinstance(x, torch.Tensor)
    }
    if not owned:  # nothing to share memory with: the tree is not walked
        return tree

    def shares(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in owned

    def copied(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.clone() if shares(x) else x
        if any(map(shares, torch_pytree.tree_leaves(x))):
            return torch_pytree.tree_map_only(torch.Tensor, copied, x)
        return x

    leaves = tree_flatten(tree)[0]
    if not any(shares(t) for x in leaves for t in torch_pytree.tree_leaves(x)):
        return tree
    return tree_map(copied, tree)


def _entry_name(entry: Any) -> str:
    return str(entry)


def device_of(tree: PyTree) -> torch.device | None:
    """The device of `tree`'s first tensor leaf (None: it has none)."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return None


def leaf_paths(tree: PyTree) -> list[str]:
    """Dotted path of every leaf, in flatten order.

    A dict from `model.named_parameters()` keeps its keys ("layers.0.weight"); nested
    containers join their keys and indices with dots ("blocks.0.w").
    """
    paths, _, _ = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [".".join(_entry_name(e) for e in path) or "<root>" for path in paths]


def subtree(tree: PyTree, prefix: str) -> PyTree:
    """The part of `tree` under the dotted path `prefix`.

    Where `prefix` names a node of the tree (`"layers.0"` in `{"layers": [{"w": ...}]}`),
    that node; where the tree keys its leaves by dotted names (`{"layers.0.w": ...}`, as
    `named_parameters` does), a dict of the leaves under `prefix`, keyed by the rest of
    their path (`{"w": ...}`).

    Raises:
      ValueError: if no leaf lies under `prefix`.
    """
    leaves, treedef = tree_flatten(tree)
    return subtree_of(treedef, tuple(leaf_paths(tree)), prefix)(leaves)


@functools.lru_cache(maxsize=4096)
def subtree_of(
    treedef: optree.PyTreeSpec, paths: tuple[str, ...], prefix: str
) -> Callable[[list[Any]], PyTree]:
    """How to cut `subtree(tree, prefix)` out of the leaves of a tree with this structure
    and these leaf paths; worked out once per structure and prefix (a loss asks for the
    same units every step)."""
    spec, start, rest = treedef, 0, prefix
    while rest:
        for key, child in zip(spec.entries(), spec.children()):
            name = _entry_name(key)
            if rest == name or rest.startswith(name + "."):
                spec, rest = child, rest[len(name) + 1 :]
                break
            start += child.num_leaves
        else:
            break
    if not rest:
        node, end = spec, start + spec.num_leaves
        return lambda leaves: tree_unflatten(node, leaves[start:end])
    keyed = [(p[len(prefix) + 1 :], i) for i, p in enumerate(paths) if p.startswith(prefix + ".")]
    if not keyed:
        raise ValueError(f"no leaf of the tree lies under {prefix!r}")
    return lambda leaves: {k: leaves[i] for k, i in keyed}


def tree_nbytes(tree: PyTree) -> int:
    """Bytes of the tensor storages reachable from `tree`, each storage counted once.

    Views into one flat buffer (how fzero stores parameters) share a storage, so counting
    per leaf would count the buffer once per view.
    """
    seen: set[tuple[int, str]] = set()
    total = 0
    for leaf in tree_flatten(tree)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        storage = leaf.untyped_storage()
        key = (storage.data_ptr(), str(leaf.device))
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def assert_trees_close(
    actual: PyTree,
    expected: PyTree,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    what: str = "tree",
) -> None:
    """Asserts two pytrees of tensors have the same structure, shapes, dtypes and values.

    Args:
      actual: the tree under test.
      expected: the reference tree.
      rtol: relative tolerance, as in `torch.testing.assert_close`.
      atol: absolute tolerance.
      what: a name for the trees in the failure message (e.g. "stage 3 params").

    Raises:
      AssertionError: naming the first differing leaf and the largest absolute difference.
    """
    a_paths = leaf_paths(actual)
    a_leaves, a_def = tree_flatten(actual)
    e_leaves, e_def = tree_flatten(expected)
    if a_def != e_def:
        raise AssertionError(f"{what}: structure differs:\n  actual   {a_def}\n  expected {e_def}")
    for path, a, e in zip(a_paths, a_leaves, e_leaves):
        if not isinstance(e, torch.Tensor):
            if a != e:
                raise AssertionError(f"{what}: leaf {path!r}: {a!r} != {e!r}")
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            raise AssertionError(
                f"{what}: leaf {path!r}: got {tuple(a.shape)} {a.dtype}, "
                f"expected {tuple(e.shape)} {e.dtype}"
            )
        if not torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a.double() - e.double()).abs()
            raise AssertionError(
                f"{what}: leaf {path!r} differs: max |delta| = {diff.max().item():.3e} "
                f"(rtol={rtol}, atol={atol}); max |expected| = {e.abs().max().item():.3e}"
            )


def max_abs_diff(a: PyTree, b: PyTree) -> float:
    """Largest absolute elementwise difference between two trees of the same structure."""
    worst = 0.0
    for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0]):
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst
