"""Param groups: how an export numbers the trainable parameters and groups them, as the
torch optimizer that loads it does (one group, or the user's: decay and no-decay)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree

from .._core import NAMESPACE, ShardLayout, tree_unflatten
from ._schema import CheckpointError

Hyperparams = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def natural_order(layout: ShardLayout) -> list[int]:
    """Leaf indices in the order the parameter tree was built (a module's parameter order).

    optree flattens dicts in sorted key order ("layers.10" before "layers.2"), but a torch
    optimizer numbers parameters in `model.parameters()` order, which is the insertion
    order of `dict(model.named_parameters())`; unflattening the indices recovers it.
    """
    out: list[int] = []

    def visit(node: Any) -> None:
        if isinstance(node, int) and not isinstance(node, bool):
            out.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)
        elif node is not None:
            for value in optree.tree_flatten_one_level(node, namespace=NAMESPACE)[0]:
                visit(value)

    visit(tree_unflatten(layout.treedef, list(range(len(layout.paths)))))
    return out


def param_groups(
    hyperparams: Hyperparams, lay: ShardLayout, aliases: Mapping[str, str] | None, where: str
) -> tuple[list[int], list[dict[str, Any]]]:
    """`(order, groups)`: the leaves in the numbering torch.optim gives them (its groups'
    parameters, one group after the other), and the groups' hyper-parameters with
    `"params"` as those numbers. Frozen leaves have numbers only where a group lists
    them (an optimizer built over every parameter); they have no state.

    `hyperparams`: one group's hyper-parameters (a mapping; None: none; a `"params"` in
    it is replaced), holding every trainable leaf in the parameter tree's order; or a
    sequence of groups, each a mapping whose `"params"` names its parameters (leaf paths,
    or a tied parameter's other names) in the loading optimizer's order, as
    `get_optimizer_state_dict`'s `param_groups` do (or numbers them, beside torch's own
    `"param_names"`, as a torch optimizer built from named parameters does). Every
    trainable leaf must be in exactly one group. Groups given so keep their other keys
    and gain `"param_names"` where they have none (the leaves' paths), which
    `import_torch` reads back.

    Raises:
      CheckpointError: a group without names, a name no leaf has, a leaf in two groups,
        a trainable leaf in none.
    """
    trainable = [i for i in natural_order(lay) if not lay.frozen[i]]
    if hyperparams is None or isinstance(hyperparams, Mapping):
        return trainable, [{**(hyperparams or {}), "params": list(range(len(trainable)))}]
    if isinstance(hyperparams, str | bytes) or not isinstance(hyperparams, Sequence):
        raise CheckpointError(
            f"{where}: hyperparams must be a dict (one group) or a list of param groups, "
            f"got {type(hyperparams).__name__}"
        )
    named = []
    for g, group in enumerate(hyperparams):
        names = group_names(group)
        if names is None:
            raise CheckpointError(
                f"{where}: param group {g} names no parameters: it needs 'params' as "
                f"parameter names (get_optimizer_state_dict's param_groups) or torch's "
                f"'param_names' (an optimizer built from model.named_parameters())"
            )
        named.append(names)
    order = leaves_of(named, lay, aliases, where)
    groups, start = [], 0
    for group, names in zip(hyperparams, named):
        ids = list(range(start, start + len(names)))
        paths = [lay.paths[i] for i in order[start : start + len(names)]]
        groups.append({"param_names": paths, **group, "params": ids})
        start += len(names)
    return order, groups


def group_names(group: Any) -> list[str] | None:
    """A param group's parameter names: its `"params"` if names (DCP's form), else
    torch's own `"param_names"` beside them; None if it has neither."""
    if not isinstance(group, Mapping):
        return None
    for key in ("params", "param_names"):
        names = group.get(key)
        if (
            isinstance(names, Sequence)
            and not isinstance(names, str)
            and all(isinstance(n, str) for n in names)
        ):
            return list(names)
    return None


# Prefixes wrappers add to parameter names: DDP's module, torch.compile's module.
_WRAPPERS = ("module.", "_orig_mod.")


def _resolve(name: str, index: Mapping[str, int]) -> int | None:
    """The leaf `name` names, through any wrappers' prefixes."""
    while name not in index:
        prefix = next((p for p in _WRAPPERS if name.startswith(p)), None)
        if prefix is None:
            return None
        name = name[len(prefix) :]
    return index[name]


def leaves_of(
    named: list[list[str]], lay: ShardLayout, aliases: Mapping[str, str] | None, where: str
) -> list[int]:
    """The leaves the groups `named` name, group after group; each leaf once, and every
    trainable leaf (frozen ones only where named)."""
    index = dict(lay.path_index)
    for name, canonical in (aliases or {}).items():
        if canonical in lay.path_index:
            index.setdefault(name, lay.path_index[canonical])
    order: list[int] = []
    owner: dict[int, int] = {}
    for g, names in enumerate(named):
        for name in names:
            leaf = _resolve(name, index)
            if leaf is None:
                raise CheckpointError(
                    f"{where}: param group {g}'s {name!r} names no parameter of the state"
                )
            if leaf in owner:
                raise CheckpointError(
                    f"{where}: {lay.paths[leaf]!r} is in param groups {owner[leaf]} and {g}"
                )
            owner[leaf] = g
            order.append(leaf)
    missing = [lay.paths[i] for i in natural_order(lay) if not lay.frozen[i] and i not in owner]
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} trainable parameter(s) in no param group: {missing[:5]}"
        )
    return order


def loaded_order(
    optim_state_dict: Mapping[str, Any],
    lay: ShardLayout,
    param_names: Sequence[Sequence[str]] | None,
    where: str,
) -> list[tuple[Any, int]]:
    """`(torch's parameter id, leaf)` for each trainable leaf of a torch.optim state dict.

    Which id is which leaf: by name where the groups say (`get_optimizer_state_dict`'s
    names as ids, torch's `"param_names"`, or `param_names` given; a wrapper's prefix,
    DDP's "module." or torch.compile's "_orig_mod.", is looked through); one group
    numbers the trainable leaves in the tree's order where it has no names, or names the
    tree does not hold (as `export_torch` writes them). Several groups without names are
    refused: a decay group and a no-decay one number the parameters out of the model's
    order, and same-shaped leaves (a norm's weight and bias) would swap their moments
    without a trace.
    """
    groups = list(optim_state_dict["param_groups"])
    ids = [list(g["params"]) for g in groups]
    named = [list(n) for n in param_names] if param_names is not None else None
    if named is None and all(group_names(g) is not None for g in groups):
        named = [group_names(g) or [] for g in groups]
        if len(groups) == 1 and any(_resolve(n, lay.path_index) is None for n in named[0]):
            named = None  # names of another model's tree: numbered as before, by position
    if named is None:
        if len(groups) != 1:
            raise CheckpointError(
                f"{where}: optim_state_dict has {len(groups)} param groups without names, "
                f"so which parameter is which cannot be told (their order is the "
                f"optimizer's, not the model's); pass param_names=[[names of group 0], "
                f"...], or build the torch optimizer from model.named_parameters()"
            )
        order = [i for i in natural_order(lay) if not lay.frozen[i]]
        if len(ids[0]) != len(order):
            raise CheckpointError(
                f"{where}: optim_state_dict has {len(ids[0])} parameters, the model "
                f"{len(order)} trainable ones"
            )
        return list(zip(ids[0], order))
    if [len(n) for n in named] != [len(i) for i in ids]:
        raise CheckpointError(
            f"{where}: the param groups hold {[len(i) for i in ids]} parameters, their "
            f"names {[len(n) for n in named]}"
        )
    leaves = leaves_of(named, lay, None, where)
    flat_ids = [i for group in ids for i in group]
    return [(i, leaf) for i, leaf in zip(flat_ids, leaves) if not lay.frozen[leaf]]
