"""Run any stateful ``torch.optim.Optimizer`` as a pure ``init``/``update`` pair."""

from __future__ import annotations

import inspect
from typing import Any

import optree
import torch

from ._base import Grads, Optimizer, OptState, Params, flatten_as, from_inplace

# torch's optimizers whose update is elementwise (per element: its gradient, state and
# value, and step counts): any slice of a tensor updates as it would within the tensor.
_ELEMENTWISE = frozenset(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta",
        "RMSprop", "Rprop", "ASGD",
    )
    if hasattr(torch.optim, name)
)  # fmt: skip


def _whole_tensors(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> Any:
    """None if `optimizer_cls` updates elementwise, else why it needs whole tensors.

    Classes outside torch's known elementwise ones are tried: two steps on a 3 x 5
    tensor, and on the same values cut into two flat pieces, with the same gradients.
    Adafactor (factored second moments, an RMS over the tensor) and trust-ratio
    optimizers disagree; an elementwise one gives the same values.
    """
    if optimizer_cls in _ELEMENTWISE:
        return None
    name = f"from_torch({optimizer_cls.__name__})"
    try:
        same = _steps_slices_alike(optimizer_cls, kwargs)
    except Exception as exc:  # it cannot step a small float64 tensor: assume the worst
        return f"{name} could not be checked for elementwise updates ({exc})"
    return None if same else f"{name} updates a tensor by more than its elements"


def _steps_slices_alike(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> bool:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3, 5, generator=g, dtype=torch.float64)
    grads = [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    whole = start.clone()
    pieces = [p.clone() for p in start.reshape(-1).split([7, 8])]  # cut across a row
    opt_whole, opt_pieces = optimizer_cls([whole], **kwargs), optimizer_cls(pieces, **kwargs)
    with torch.no_grad():
        for grad in grads:
            whole.grad = grad.clone()
            for p, part in zip(pieces, grad.reshape(-1).split([7, 8]), strict=True):
                p.grad = part.clone()
            opt_whole.step()
            opt_pieces.step()
    return torch.allclose(torch.cat(pieces), whole.reshape(-1), rtol=1e-9, atol=1e-12)


def _edits_grads(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> bool:
    """Whether `optimizer_cls` may write into the gradients it is given.

    Some do in some configurations (SGD's foreach path with Nesterov momentum adds the
    momentum to them; torch's other paths write only into copies they made), so
    `update_` hands those copies. One seen to leave them alone over three steps on two
    small tensors is handed the gradients themselves, saving a full copy of the
    gradient shard per step. One that cannot be tried on the host (`capturable`, a
    device-only option) gets copies. Where the options leave the implementation to
    torch, it is tried on its foreach path too: torch's default for CUDA tensors, not
    the host's.
    """
    paths = [kwargs]
    takes = inspect.signature(optimizer_cls.__init__).parameters
    if "foreach" in takes and not any(kwargs.get(k) is not None for k in ("foreach", "fused")):
        paths.append({**kwargs, "foreach": True})
    return any(_edits_on(optimizer_cls, options) for options in paths)


def _edits_on(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> bool:
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(n, generator=g, dtype=torch.float32) for n in (5, 8)]
    try:
        opt = optimizer_cls(params, **kwargs)
        with torch.no_grad():
            for _ in range(3):
                grads = [torch.randn(p.shape, generator=g) for p in params]
                for p, grad in zip(params, grads, strict=True):
                    p.grad = grad.clone()
                opt.step()
                if any(not torch.equal(p.grad, grad) for p, grad in zip(params, grads)):
                    return True
    except Exception:  # it cannot step small host tensors: assume the worst
        return True
    return False


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
        without a closure (SGD, Adam, AdamW, Adagrad, RMSprop, Adafactor, ...). One whose
        update of a tensor is not elementwise (Adafactor; found by trying a class torch
        does not list as elementwise on two slices of a small tensor) gets
        ``whole_tensors`` set: at stages 1-3 it needs ``layout="tensor"``.
      **kwargs: hyper-parameters forwarded to ``optimizer_cls``.

    Returns:
      The functional :class:`Optimizer`.

    Raises:
      TypeError: if ``optimizer_cls`` is not a ``torch.optim.Optimizer`` subclass.
      ValueError: if its ``step`` needs a closure (LBFGS), or (from torch) if
        ``kwargs`` are invalid hyper-parameters.
    """
    _check_optimizer_cls(optimizer_cls)
    if callable(kwargs.get("lr")) and not isinstance(kwargs["lr"], torch.Tensor):
        raise TypeError(
            f"from_torch({optimizer_cls.__name__}): lr= is a schedule; a torch optimizer's "
            "hyper-parameters are fixed here. fzero's own optimizers take lr=lambda step: "
            "... (optim.from_torch_scheduler makes one from a torch scheduler)"
        )
    # Instantiate once on a dummy tensor so bad hyper-parameters fail here, at
    # construction time, rather than at the first update.
    optimizer_cls([torch.zeros(1)], **kwargs)
    copy_grads = _edits_grads(optimizer_cls, kwargs)
    # Held as a tuple, not the dict: a step compares what an optimizer's closure holds
    # across ranks, immutable values only (a dict there may be a cache).
    settings = tuple(sorted(kwargs.items()))

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
                    p.grad = g.detach().clone() if copy_grads else g.detach()
            optimizer = optimizer_cls(tensors, **dict(settings))
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

    return Optimizer(init, from_inplace(update_), update_, _whole_tensors(optimizer_cls, kwargs))
