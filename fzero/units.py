"""Unit policies: which parameter-path prefixes are gathered and reduced as one buffer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ._tree import PyTree, leaf_paths, tree_flatten


def by_size(params: PyTree, min_params: int) -> list[str]:
    """Units of at least `min_params` parameters, innermost first (FairScale `auto_wrap`).

    Walks the dotted-path hierarchy bottom up: a prefix becomes a unit when the parameters
    under it that no inner unit took number at least `min_params`. Whatever remains is
    the root unit.

    Args:
      params: the parameter tree (e.g. `dict(model.named_parameters())`).
      min_params: the smallest unit, in parameters.

    Returns:
      A list of prefixes, for `units=` of `shard_state` and `sharded_step`.
    """
    if min_params < 1:
        raise ValueError(f"min_params must be >= 1, got {min_params}")
    sizes: dict[tuple[str, ...], int] = {}
    for path, leaf in zip(leaf_paths(params), tree_flatten(params)[0]):
        parts = tuple(path.split("."))
        for k in range(1, len(parts)):  # every proper prefix; a lone leaf is not a unit
            sizes[parts[:k]] = sizes.get(parts[:k], 0) + leaf.numel()
    # Deepest prefixes first, so an inner unit claims its parameters before its parents.
    taken: dict[tuple[str, ...], int] = {}
    units: list[tuple[str, ...]] = []
    for prefix in sorted(sizes, key=lambda p: -len(p)):
        free = sizes[prefix] - taken.get(prefix, 0)
        if free >= min_params:
            units.append(prefix)
            for k in range(1, len(prefix)):
                taken[prefix[:k]] = taken.get(prefix[:k], 0) + free
    first_seen = {p: i for i, p in enumerate(sizes)}
    return [".".join(u) for u in sorted(units, key=lambda p: first_seen[p])]


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
