"""Loss wrappers a step composes: buffers threaded through, and loss scaling; and the
copies of a batch a rank without data runs again."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import optree
import torch

from .._comm import Mesh, all_reduce_mean, all_reduce_sum, broadcast_
from .._core import NAMESPACE, LossFn, PyTree, check_loss, leaf_paths, tree_flatten, tree_map


def copied(buffers: PyTree) -> PyTree:
    """Detached copies of a state's buffers, for a loss (or forward) that may update them
    in place, as functional_call does with BatchNorm's statistics."""
    return tree_map(lambda b: b.detach().clone(), buffers)


def kept_batch(batch: Any) -> Any:
    """`batch` as a rank without data keeps it to run again (`CompiledLoss.last`): its
    containers copied, the ones the tree walks and the ones it does not (a Hugging Face
    `BatchEncoding`), so a loss that pops from them pops from the copy; tensors shared."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x
        try:
            return copy.copy(x)
        except Exception:  # an object that cannot be copied: shared, as before
            return x

    return optree.tree_map(leaf, batch, namespace=NAMESPACE)


def private_batch(batch: Any) -> Any:
    """A copy of `batch` its loss cannot reach the original through (a rank without data
    running, in a micro-batch's place, one of its own still to come: the loss may scale
    its tensors in place or pop from its containers)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        return copy.deepcopy(x)

    return optree.tree_map(leaf, batch, namespace=NAMESPACE)


class BufferThread:
    """`loss_fn(params, buffers, batch) -> (loss, new_buffers)` as a loss of (params, batch).

    Buffers thread through the micro-batches of a step in order; the state's own buffers
    are copied first, since functional_call writes in-place buffer updates into the dict.
    """

    def __init__(self, loss_fn: Callable[..., Any], buffers: PyTree, rank: int = 0) -> None:
        self.loss_fn, self.rank = loss_fn, rank
        self.buffers = copied(buffers)

    def __call__(self, params: PyTree, batch: Any) -> torch.Tensor:
        out = self.loss_fn(params, self.buffers, batch)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "with buffers in the state, loss_fn(params, buffers, batch) must return "
                f"(loss, new_buffers), got {type(out).__name__}"
            )
        loss, new = out
        self._check(new)
        self.buffers = tree_map(lambda b: b.detach(), new)
        return loss

    def _check(self, new: Any) -> None:
        """Raises a TypeError naming the first difference if `new` is not shaped like the
        buffers given (paths, shapes, dtypes): the ranks would agree on it, and a tree of
        other tensors (aux outputs, a batch-sized one) becomes the state's buffers, or
        stops gloo's collectives with mismatched sizes."""
        (old, spec), (now, now_spec) = tree_flatten(self.buffers), tree_flatten(new)
        if spec == now_spec and all(_alike(n, b) for n, b in zip(now, old)):
            return  # every micro-batch: no paths spelled out unless something differs
        want, got = dict(zip(leaf_paths(self.buffers), old)), dict(zip(leaf_paths(new), now))
        what = None
        if set(got) != set(want):
            gone, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            what = f"missing {gone[:3]}" if gone else f"not buffers {extra[:3]}"
        else:
            for path, b in want.items():
                n = got[path]
                if not _alike(n, b):
                    kind = tuple(n.shape) if isinstance(n, torch.Tensor) else type(n).__name__
                    what = f"{path!r} is {kind}, expected {tuple(b.shape)} {b.dtype}"
                    break
        if what is not None:
            raise TypeError(
                f"rank {self.rank}: loss_fn's new_buffers are not shaped like the buffers it "
                f"was given: {what}. loss_fn(params, buffers, batch) returns (loss, "
                "new_buffers); with has_aux=True, ((loss, new_buffers), aux)"
            )


def _alike(new: Any, old: torch.Tensor) -> bool:
    return isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype


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
