"""Unit policies: which parameter-path prefixes are gathered and reduced as one buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ._tree import PyTree, leaf_paths, tree_flatten

Prefix = tuple[str, ...]  # a dotted prefix, split into its components


def by_size(params: PyTree, min_params: int) -> list[str | tuple[str, ...]]:
    """Units of at least `min_params` parameters, innermost first (FairScale `auto_wrap`,
    DeepSpeed's buckets).

    Walks the dotted-path hierarchy bottom up. Under each prefix, consecutive children
    too small to be units on their own (a flat `nn.Sequential` of small layers, say) are
    joined, in order, into units of at least `min_params` (tuples: one unit of several
    submodules); a child that is or holds a unit already ends such a run. Then the
    prefix itself becomes a unit when the parameters under it that no inner unit took
    number at least `min_params`. A run that would take every child of a prefix is left
    to the prefix, which then is a unit of its own (or the root). Whatever remains, a
    run's short tail included, is the root unit.

    Siblings follow the order the tree was built in: a dict's own key order
    (`named_parameters`' registration order, usually the forward's), not the sorted
    order optree flattens it in.

    Args:
      params: the parameter tree (e.g. `dict(model.named_parameters())`).
      min_params: the smallest unit, in parameters.

    Returns:
      A list of prefixes and tuples of prefixes, for `units=` of `shard_state` and
      `sharded_step`.
    """
    if min_params < 1:
        raise ValueError(f"min_params must be >= 1, got {min_params}")
    free: dict[Prefix, int] = {}  # per proper prefix, the parameters no unit took yet
    kids: dict[Prefix, list[Prefix]] = {(): []}  # child prefixes, in the tree's order
    for path, numel in _in_order(params):
        parts = tuple(path.split("."))
        for k in range(1, len(parts)):  # every proper prefix; a lone leaf is not a unit
            if parts[:k] not in free:
                free[parts[:k]] = 0
                kids[parts[:k]] = []
                kids[parts[: k - 1]].append(parts[:k])
            free[parts[:k]] += numel
    size, seen = dict(free), {p: i for i, p in enumerate(free)}
    units: list[tuple[Prefix, ...]] = []

    def take(members: tuple[Prefix, ...], parent: Prefix) -> None:
        units.append(members)
        n = sum(free[m] for m in members)
        for m in members:
            free[m] = 0
        for k in range(1, len(parent) + 1):
            free[parent[:k]] -= n

    # Deepest prefixes first, so an inner unit claims its parameters before its parents.
    for prefix in sorted(kids, key=len, reverse=True):
        # A child with a unit inside (or that is one) ends a run: what is left of it is
        # scattered between its units, and goes to the prefix (or the root) instead.
        untouched = [(c, free[c] if free[c] == size[c] else 0) for c in kids[prefix]]
        for run in _runs(untouched, min_params):
            if len(run) < len(kids[prefix]):  # every child: the prefix's unit, or the root's
                take(run, prefix)
        if prefix and free[prefix] >= min_params:
            take((prefix,), prefix[:-1])
    units.sort(key=lambda members: seen[members[0]])
    return [".".join(u[0]) if len(u) == 1 else tuple(".".join(m) for m in u) for u in units]


def _runs(children: list[tuple[Prefix, int]], min_params: int) -> list[tuple[Prefix, ...]]:
    """Consecutive children, joined in order until they hold `min_params`; a child
    marked 0 ends a run, and so does the end of the list (the short tail is no run)."""
    runs: list[tuple[Prefix, ...]] = []
    run: list[Prefix] = []
    total = 0
    for child, n in children:
        if n == 0:
            run, total = [], 0
            continue
        run.append(child)
        total += n
        if total >= min_params:
            runs.append(tuple(run))
            run, total = [], 0
    return runs


def _in_order(params: PyTree) -> list[tuple[str, int]]:
    """(dotted path, numel) of every leaf, dicts in their own key order (optree sorts
    them: "layers.10" before "layers.2"), other containers in flatten order."""
    if isinstance(params, dict):
        out = []
        for key, value in params.items():
            out += [(f"{key}.{p}" if p else str(key), n) for p, n in _in_order(value)]
        return out
    leaves = tree_flatten(params)[0]
    paths = leaf_paths(params) if leaves else []
    return [("" if p == "<root>" else p, x.numel()) for p, x in zip(paths, leaves, strict=True)]


def by_module(model: nn.Module, classes: type[Any] | tuple[type[Any], ...]) -> list[str]:
    """The names of `model`'s submodules that are instances of `classes` (e.g. a block class).

    FSDP2's `fully_shard` per transformer block; pass the same `model` as `module=` to
    `sharded_step` so each unit is gathered just before its forward.

    Args:
      model: the module the loss calls (through `torch.func.functional_call`).
      classes: a class or tuple of classes; nested matches become nested units.

    Returns:
      A list of submodule names, in `named_modules` order.
    """
    names = [name for name, m in model.named_modules() if name and isinstance(m, classes)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no submodule of type {classes}")
    return names


def auto(model: nn.Module) -> list[str]:
    """One unit per block of `model`, found without naming its classes.

    The blocks are the submodules whose class `_no_split_modules` names (Hugging Face
    models declare the layers that must stay whole: `LlamaDecoderLayer`, `GPT2Block`,
    `BertLayer`), where `model` or a submodule declares it; otherwise the children of each
    `nn.ModuleList`/`nn.Sequential` that holds several of one class (a transformer's
    layers). The outermost match wins: a block inside a block is not a unit of its own.
    Ties are followed: a block whose parameters all belong to another unit under their
    first name (`named_parameters`' choice, so `dict(model.named_parameters())` lacks
    them) is left out, as is a block without parameters. Whatever is not in a block
    (embeddings, final norm, head) is the root unit.

    Args:
      model: the module the loss calls, e.g. a `transformers` model.

    Returns:
      A list of submodule names, in `named_modules` order, for `units=`; empty (one unit,
      the root) when the model has no blocks.
    """
    declared = {
        name
        for m in model.modules()
        for name in (getattr(m, "_no_split_modules", None) or ())
        if isinstance(name, str)
    }
    if declared:
        found = [n for n, m in model.named_modules() if n and type(m).__name__ in declared]
    else:
        found = [
            f"{n}.{child}" if n else child
            for n, m in model.named_modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential))
            for child in _repeated(m)
        ]
    owned = {id(p) for _, p in model.named_parameters()}  # first names only
    first = {id(p): n for n, p in model.named_parameters()}
    units: list[str] = []
    for name in found:
        if any(name.startswith(u + ".") for u in units):
            continue  # inside a block already taken
        sub = model.get_submodule(name)
        mine = [first[id(p)] for p in sub.parameters() if id(p) in owned]
        if any(n == name or n.startswith(name + ".") for n in mine):
            units.append(name)
    return units


def _repeated(container: nn.Module) -> list[str]:
    """Names of `container`'s children of a class it holds several of."""
    counts: dict[type, int] = {}
    for child in container.children():
        counts[type(child)] = counts.get(type(child), 0) + 1
    return [n for n, c in container.named_children() if counts[type(c)] > 1]


def grouped(units: Sequence[str], size: int) -> list[str | tuple[str, ...]]:
    """`units` joined `size` at a time, in order, each run one unit (FSDP2's
    `fully_shard([block0, block1])`): fewer, larger collectives, without regrouping the
    model (which would rename its parameters).

    Coarser units pay off where each collective has a high fixed cost (gloo, CPU hosts:
    see the README's tuning note); at stage 3 a unit's full parameters are then held for
    the forward of all its members.

    Args:
      units: unit prefixes, usually consecutive siblings (`by_module(model, Block)`).
      size: how many to join; the last run may be shorter.

    Returns:
      A list for `units=`: a lone prefix where a run has one member, else a tuple.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    runs = [tuple(units[k : k + size]) for k in range(0, len(units), size)]
    return [r[0] if len(r) == 1 else r for r in runs]
