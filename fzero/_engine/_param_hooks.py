"""Gradient hooks on a module's parameters (`param.register_hook`), run in an eager step.

The loss sees other tensors than the module's parameters (`functional_call` binds the
step's), so autograd would never run a hook registered on a parameter: a gradient mask
(the recipe that trains only the new rows of an embedding) would be dropped silently.
The step registers each such hook on the tensors it hands the loss for that parameter,
every time its unit enters, before the gradient leaves through the unit's reduction: on
each rank's gradient of each use, as DDP runs it on each rank's gradient before its
all-reduce. A linear hook (a mask, a scale) then gives torch's training exactly; one that
is not (a clamp, a norm) sees a rank's and a use's part of the gradient, not the whole.
A post-accumulate-grad hook would never run (the step accumulates into buffers of its
own, not `.grad`): refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._core import ShardLayout

Hooks = Mapping[str, tuple[Callable[[torch.Tensor], Any], ...]]
Trained = tuple[tuple[str, torch.Tensor], ...]  # (leaf path, module='s parameter there)


def trained_parameters(layout: ShardLayout, module: nn.Module | None) -> Trained:
    """The trainable leaves of `layout` that name a parameter of `module`, with it (a
    walk of the module: made once per layout, its hooks read every step)."""
    if module is None:
        return ()
    own = dict(module.named_parameters(remove_duplicate=False))
    pairs = zip(layout.paths, layout.frozen)
    return tuple((path, own[path]) for path, frozen in pairs if path in own and not frozen)


def gradient_hooks(trained: Trained, rank: int) -> Hooks:
    """Per parameter of `trained` with gradient hooks, those hooks in the order they were
    registered (read now: one may be registered at any time).

    Raises:
      TypeError: naming the first parameter with a post-accumulate-grad hook.
    """
    out: dict[str, tuple[Callable[[torch.Tensor], Any], ...]] = {}
    for path, p in trained:
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise TypeError(
                f"rank {rank}: module='s parameter {path!r} has a post-accumulate-grad hook "
                "(register_post_accumulate_grad_hook), which would never run: the step "
                "accumulates gradients in buffers of its own, not in the parameter's .grad. "
                "Remove it; a transformation of the gradient belongs in a hook of "
                "register_hook (run by the step) or in the optimizer (fzero.optim.chain)"
            )
        hooks = tuple((p._backward_hooks or {}).values())
        if hooks:
            out[path] = hooks
    return out


def run_hooks(views: Mapping[str, torch.Tensor], hooks: Hooks) -> None:
    """Registers `hooks` on the tensors the loss is handed (`views`, by path)."""
    for path, view in views.items():
        if view.requires_grad:
            for hook in hooks.get(path, ()):
                view.register_hook(hook)


def has_gradient_hooks(module: nn.Module | None) -> bool:
    """Whether any parameter of `module` has a gradient hook."""
    return module is not None and any(p._backward_hooks for p in module.parameters())
