"""Run any stateful ``torch.optim.Optimizer`` as a pure ``init``/``update`` pair."""

from __future__ import annotations

import inspect
from typing import Any

import optree
import torch

from ._base import Grads, Optimizer, OptState, Params, flatten_as, from_inplace


def _check_optimizer_cls(optimizer_cls: type[torch.optim.Optimizer]) -> None:
    """Rejects classes that are not optimizers or whose ``step`` requires a closure."""
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch expects a torch.optim.Optimizer subclass, got {optimizer_cls!r}"
        )
    closure = inspect.signature(optimizer_cls.step).parameters.get("closure")
    # LBFGS-style optimizers re-evaluate the loss inside step(); a functional update
    # only has gradients, so there is nothing sensible to pass as the closure.
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_cls.__name__}.step requires a closure (e.g. LBFGS) and cannot "
            "be run from precomputed gradients by from_torch"
        )


def from_torch(optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any) -> Optimizer:
    """Wraps a stateful ``torch.optim.Optimizer`` class into a functional :class:`Optimizer`.

    Each ``update_`` attaches cloned grads to the given tensors, builds
    ``optimizer_cls(tensors, **kwargs)``, loads the given state into it, calls
    ``step()`` (which updates tensors and state in place) and reads the state back;
    ``update`` does the same on copies. Results are bitwise identical to stepping one
    long-lived optimizer on the same tensors (with the same ``kwargs``, hence the same
    foreach/single-tensor code path).

    The state mirrors the params pytree with one ``dict`` per leaf, holding that
    tensor's entries of ``optimizer.state`` (e.g. ``{"step", "exp_avg",
    "exp_avg_sq"}`` for Adam). Since torch creates its state lazily, the dicts
    returned by ``init`` are empty and only fill in after the first ``update``;
    an empty dict means "fresh", exactly as in torch. Tensor entries stay tensors
    so the state can be checkpointed. Leaves with zero elements (e.g. an empty
    shard) are passed to torch without a grad, so torch skips them and their state
    is returned unchanged. Hyper-parameters (including ``lr``) are fixed; updated
    params are returned as new tensors that do not require grad.

    Args:
      optimizer_cls: a ``torch.optim.Optimizer`` subclass whose ``step`` works
        without a closure (SGD, Adam, AdamW, Adagrad, RMSprop, Adafactor, ...).
      **kwargs: hyper-parameters forwarded to ``optimizer_cls``.

    Returns:
      The functional :class:`Optimizer`.

    Raises:
      TypeError: if ``optimizer_cls`` is not a ``torch.optim.Optimizer`` subclass.
      ValueError: if its ``step`` needs a closure (LBFGS), or (from torch) if
        ``kwargs`` are invalid hyper-parameters.
    """
    _check_optimizer_cls(optimizer_cls)
    # Instantiate once on a dummy tensor so bad hyper-parameters fail here, at
    # construction time, rather than at the first update.
    optimizer_cls([torch.zeros(1)], **kwargs)

    def init(params: Params) -> OptState:
        return optree.tree_map(lambda _: {}, params)

    def update_(grads: Grads, state: OptState, params: Params) -> tuple[Params, OptState]:
        leaves, spec, (grad_leaves, state_leaves) = flatten_as(params, grads, state)
        if not leaves:
            # A rank may own no tensors at all; torch refuses an empty param list.
            return spec.unflatten([]), spec.unflatten([])
        with torch.no_grad():
            # torch.optim wants leaf tensors; a donated shard is one, but a view of a
            # tensor that requires grad is not, so step on detached aliases.
            tensors = [p.detach() for p in leaves]
            for p, g in zip(tensors, grad_leaves, strict=True):
                # 0-element leaves (e.g. an empty shard) get no grad, so torch skips
                # them: there is nothing to update, and Adafactor divides by numel().
                if p.numel() > 0:
                    # Cloned because some optimizers (e.g. foreach + maximize) edit
                    # grads in place.
                    p.grad = g.detach().clone()
            optimizer = optimizer_cls(tensors, **kwargs)
            for p, leaf_state in zip(tensors, state_leaves, strict=True):
                # An empty dict keeps whatever the constructor set up (Adagrad
                # initialises its state eagerly) so torch's own fresh-state path runs.
                if leaf_state:
                    optimizer.state[p] = leaf_state
            optimizer.step()
            new_state = [
                optimizer.state.get(p, s) for p, s in zip(tensors, state_leaves, strict=True)
            ]
            for p in tensors:
                p.grad = None
        # The tensors were updated in place: `params` now holds the new values.
        return params, spec.unflatten([dict(s) for s in new_state])

    return Optimizer(init, from_inplace(update_), update_)
