"""sharded_update: an optimizer step applied to the shard a rank owns."""

from __future__ import annotations

from typing import Any

import torch

from ._mesh import Mesh
from ._shards import Shards
from ._tree import PyTree, leaf_paths, tree_flatten
from .optim import Optimizer
from .optim._context import ShardContext, shard_context


def sharded_update(
    optimizer: Optimizer,
    params: PyTree,
    grads: PyTree,
    opt_state: Any,
    *,
    donate: bool = False,
    mesh: Mesh | None = None,
) -> tuple[PyTree, Any]:
    """Applies `optimizer` to this rank's parameter shard with its gradient shard.

    With Shards the optimizer sees `Shards.pieces()`: whole flat buffers ("flat" layout;
    right for pointwise optimizers) or whole owned tensors in their shapes ("tensor"
    layout; right for any optimizer). With replicated full trees (stage 0) it is simply
    `optimizer.update`. Out of place by default: nothing passed in is modified.

    With `donate=True` (and an optimizer that has `update_`) the new values are written
    into `params` and `opt_state`, which are returned: no second copy of the shard and its
    optimizer state ever exists. The caller must not use the donated values afterwards.

    Args:
      optimizer: an `fzero.optim.Optimizer`.
      params: this rank's parameter Shards (or a full tree).
      grads: the matching gradient Shards (or a full tree), already averaged over ranks.
      opt_state: the optimizer state of this rank's pieces, from `shard_state`.
      donate: update `params` and `opt_state` in place (consuming them).
      mesh: the mesh; needed by transformations that look across ranks, such as
        `fzero.optim.clip_by_global_norm` on shards (the norm of the whole model).

    Returns:
      `(new_params, new_opt_state)`, params of the same kind as given.
    """
    inplace = donate and optimizer.update_ is not None
    update = optimizer.update_ if inplace else optimizer.update
    if not isinstance(params, Shards):
        _check_like(grads, params)
        with shard_context(ShardContext(mesh, sharded=False, segments=None)):
            return update(grads, opt_state, params)
    if not isinstance(grads, Shards) or grads.layout != params.layout or grads.rank != params.rank:
        raise ValueError(
            "sharded_update: grads must be Shards with the parameters' layout and "
            "rank (use reduce_scatter_grads or local_shard)"
        )
    lay = params.layout
    ctx = ShardContext(mesh, True, lay.piece_segments(params.rank), lay.world_size)
    with shard_context(ctx):
        new_pieces, new_state = update(grads.pieces(), opt_state, params.pieces())
    if inplace:  # the pieces are views into params.buffers, updated where they are
        return params, new_state
    return params.replace_pieces(tuple(new_pieces)), new_state


def _check_like(grads: PyTree, params: PyTree) -> None:
    """Raises ValueError naming the first leaf where `grads` does not match `params`."""
    g_leaves, g_def = tree_flatten(grads)
    p_leaves, p_def = tree_flatten(params)
    if g_def != p_def:
        extra = sorted(set(leaf_paths(grads)) ^ set(leaf_paths(params)))
        raise ValueError(
            f"sharded_update: grads and params differ in structure (leaves only "
            f"in one of them: {extra[:5]})"
        )
    for path, g, p in zip(leaf_paths(params), g_leaves, p_leaves):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
            got = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(
                f"sharded_update: grads leaf {path!r} is {got}, params have "
                f"{tuple(p.shape)} {p.dtype}"
            )
