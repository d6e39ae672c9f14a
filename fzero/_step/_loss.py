"""Loss wrappers a step composes: buffers threaded through, and loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._comm import Mesh, all_reduce_mean, all_reduce_sum, broadcast_
from .._core import LossFn, PyTree, check_loss, tree_map


def copied(buffers: PyTree) -> PyTree:
    """Detached copies of a state's buffers, for a loss (or forward) that may update them
    in place, as functional_call does with BatchNorm's statistics."""
    return tree_map(lambda b: b.detach().clone(), buffers)


class BufferThread:
    """`loss_fn(params, buffers, batch) -> (loss, new_buffers)` as a loss of (params, batch).

    Buffers thread through the micro-batches of a step in order; the state's own buffers
    are copied first, since functional_call writes in-place buffer updates into the dict.
    """

    def __init__(self, loss_fn: Callable[..., Any], buffers: PyTree) -> None:
        self.loss_fn = loss_fn
        self.buffers = copied(buffers)

    def __call__(self, params: PyTree, batch: Any) -> torch.Tensor:
        out = self.loss_fn(params, self.buffers, batch)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "with buffers in the state, loss_fn(params, buffers, batch) must return "
                f"(loss, new_buffers), got {type(out).__name__}"
            )
        loss, new = out
        self.buffers = tree_map(lambda b: b.detach(), new)
        return loss


def sync_buffers(
    buffers: PyTree, how: str, mesh: Mesh, present: tuple[bool, ...] | None = None
) -> PyTree:
    """Buffers agreed over ranks: "broadcast" (rank 0's), "mean" (floating ones) or "local".

    `present`: which ranks ran a forward this step. When some did not, their buffers are
    last step's: "broadcast" takes the first rank that did, "mean" averages those that
    did (nothing ran anywhere: rank 0's, unchanged)."""
    if how == "local":
        return buffers
    ran = [r for r, p in enumerate(present or ()) if p]
    everyone = present is None or len(ran) == mesh.size
    src = 0 if everyone or not ran else ran[0]

    def sync(b: torch.Tensor) -> torch.Tensor:
        if how == "mean" and b.is_floating_point():
            if everyone:
                return all_reduce_mean(b, mesh)
            if ran:
                mine = b if mesh.rank in ran else torch.zeros_like(b)
                return all_reduce_sum(mine, mesh).div_(len(ran))
        return broadcast_(b.clone(), mesh, src=src)

    return tree_map(sync, buffers)


class ScaledLoss:
    """The loss times the loss scale, for differentiation."""

    def __init__(self, loss_fn: LossFn, scale: torch.Tensor, rank: int) -> None:
        self.loss_fn, self.scale, self.rank = loss_fn, scale, rank

    def __call__(self, params: PyTree, batch: Any) -> torch.Tensor:
        loss = check_loss(self.loss_fn(params, batch), rank=self.rank)
        # A float32 0-d scale promotes a 16-bit loss to float32, as GradScaler.scale does.
        return loss * self.scale
