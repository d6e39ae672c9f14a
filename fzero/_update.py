"""sharded_update: an optimizer step applied to the shard a rank owns."""

from __future__ import annotations

from typing import Any

from ._shards import Shards
from ._tree import PyTree
from .optim import Optimizer


def sharded_update(
    optimizer: Optimizer, params: PyTree, grads: PyTree, opt_state: Any
) -> tuple[PyTree, Any]:
    """Applies `optimizer` to this rank's parameter shard with its gradient shard.

    With Shards the optimizer sees `Shards.pieces()`: whole flat buffers ("flat" layout;
    right for pointwise optimizers) or whole owned tensors in their shapes ("tensor"
    layout; right for any optimizer). With replicated full trees (stage 0) it is simply
    `optimizer.update`. Out of place: nothing passed in is modified.

    Args:
      optimizer: an `fzero.optim.Optimizer`.
      params: this rank's parameter Shards (or a full tree).
      grads: the matching gradient Shards (or a full tree), already averaged over ranks.
      opt_state: the optimizer state of this rank's pieces, from `shard_state`.

    Returns:
      `(new_params, new_opt_state)`, params of the same kind as given.
    """
    if not isinstance(params, Shards):
        return optimizer.update(grads, opt_state, params)
    if not isinstance(grads, Shards) or grads.layout != params.layout or grads.rank != params.rank:
        raise ValueError(
            "sharded_update: grads must be Shards with the parameters' layout and "
            "rank (use reduce_scatter_grads or local_shard)"
        )
    new_pieces, new_state = optimizer.update(grads.pieces(), opt_state, params.pieces())
    return params.replace_pieces(tuple(new_pieces)), new_state
