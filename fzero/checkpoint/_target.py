"""The layout a load targets: `params_like` checked against the saved model, in the dtypes
its leaves were saved in."""

from __future__ import annotations

from typing import Any

import torch

from .._core import (
    PyTree,
    ShardLayout,
    build_layout,
    leaf_paths,
    tree_flatten,
    tree_unflatten,
    unmatched_leaves,
)
from .._state import frozen_leaves
from ._schema import CheckpointError, dtype_of


def as_saved(directory: str, body: dict[str, Any], params_like: PyTree, precision: Any) -> PyTree:
    """`params_like`, its floating leaves in the dtype they were saved in where that is
    another: a state under `precision` saves its masters (a bfloat16 model's float32),
    which the loaded state's masters are again. Without `precision` that would make a
    model of other dtypes: refused, saying what to pass."""
    leaves, treedef = tree_flatten(params_like)
    saved = body["layout"]["leaves"]
    out = list(leaves)
    for i, (x, s) in enumerate(zip(leaves, saved)):
        dtype = getattr(x, "dtype", None)
        if dtype is None or str(dtype) == s["dtype"] or list(x.shape) != s["shape"]:
            continue  # the same, or another model (`target_layout` names it)
        want = dtype_of(s["dtype"])
        if not (dtype.is_floating_point and want.is_floating_point):
            continue
        if precision is None:
            raise CheckpointError(
                f"{directory} holds leaf {s['path']!r} in {want}, params_like has it in "
                f"{dtype}: a state trained under Precision saves its masters. Pass the "
                f"precision it trained with (its masters are loaded as masters again), or "
                f"params_like in {want}"
            )
        out[i] = torch.empty(x.shape, dtype=want, device="meta")
    if any(a is not b for a, b in zip(out, leaves)):  # the layout wants one device of all
        out = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in out]
    return tree_unflatten(treedef, out)


def target_layout(
    directory: str,
    body: dict[str, Any],
    params_like: PyTree,
    world_size: int,
    kind: str | None,
    units: Any,
    frozen: Any,
) -> ShardLayout:
    """The new layout, after checking that `params_like` is the model that was saved."""
    saved = body["layout"]["leaves"]
    leaves = tree_flatten(params_like)[0]
    paths = leaf_paths(params_like)
    said = unmatched_leaves([x["path"] for x in saved], "the checkpoint", paths, "params_like")
    if said is not None:
        raise CheckpointError(f"{directory} holds a different model: {said}")
    for i in range(max(len(saved), len(leaves))):
        if i >= len(saved) or i >= len(leaves) or saved[i]["path"] != paths[i]:
            ours = paths[i] if i < len(paths) else None
            theirs = saved[i]["path"] if i < len(saved) else None
            what = f"params_like has leaf {ours!r} where the checkpoint has {theirs!r}"
            raise CheckpointError(f"{directory} holds a different model: {what}")
        shape, dtype = tuple(getattr(leaves[i], "shape", ())), getattr(leaves[i], "dtype", None)
        if list(shape) != saved[i]["shape"] or str(dtype) != saved[i]["dtype"]:
            raise CheckpointError(
                f"{directory} holds a different model: leaf {paths[i]!r} is saved as "
                f"{tuple(saved[i]['shape'])} {saved[i]['dtype']}, params_like has {shape} {dtype}"
            )
    flags = [x["frozen"] for x in saved] if frozen is None else frozen_leaves(params_like, frozen)
    return build_layout(
        params_like,
        world_size,
        body["layout"]["kind"] if kind is None else kind,
        body["layout"]["units"] if units is None else units,
        flags,
    )
