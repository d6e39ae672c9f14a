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
from typing import Any, NamedTuple

import torch
from torch import nn

from .._core import ShardLayout

Hook = Callable[[torch.Tensor], Any]
Trained = tuple[tuple[str, torch.Tensor], ...]  # (leaf path, module='s parameter there)


class ParamHooks(NamedTuple):
    """A parameter's gradient hooks, and its dtype: what torch hands them a gradient in."""

    dtype: torch.dtype
    hooks: tuple[Hook, ...]


Hooks = Mapping[str, ParamHooks]


def trained_parameters(layout: ShardLayout, module: nn.Module | None) -> Trained:
    """The trainable leaves of `layout` that name a parameter of `module`, with it (a
    walk of the module: made once per layout, its hooks read every step)."""
    if module is None:
        return ()
    own = dict(module.named_parameters(remove_duplicate=False))
    pairs = zip(layout.paths, layout.frozen)
    return tuple((path, own[path]) for path, frozen in pairs if path in own and not frozen)


def gradient_hooks(trained: Trained, rank: int, first: bool = False) -> Hooks:
    """Per parameter of `trained` with gradient hooks, those hooks in the order they were
    registered (read now: one may be registered at any time). `first`: the first step's
    check, agreed among the ranks, which refuses a post-accumulate-grad hook (later
    steps do not look for one: raised inside a step, it would end the job).

    Raises:
      TypeError: naming the first parameter with a post-accumulate-grad hook (`first`).
    """
    out: dict[str, ParamHooks] = {}
    for path, p in trained:
        if first and getattr(p, "_post_accumulate_grad_hooks", None):
            raise TypeError(
                f"rank {rank}: module='s parameter {path!r} has a post-accumulate-grad hook "
                "(register_post_accumulate_grad_hook), which would never run: the step "
                "accumulates gradients in buffers of its own, not in the parameter's .grad. "
                "Remove it; a transformation of the gradient belongs in a hook of "
                "register_hook (run by the step) or in the optimizer (fzero.optim.chain)"
            )
        hooks = tuple((p._backward_hooks or {}).values())
        if hooks:
            out[path] = ParamHooks(p.dtype, hooks)
    return out


def hooks_for(found: ParamHooks | None, dtype: torch.dtype) -> tuple[Hook, ...]:
    """`found`'s hooks as they run on a tensor of `dtype`: where it computes in another
    dtype than the parameter (mixed precision), each is handed the gradient in the
    parameter's dtype and its result goes back, as torch hands a parameter's hooks its
    own dtype."""
    if found is None:
        return ()
    if dtype == found.dtype:
        return found.hooks
    return tuple(_cast(hook, found.dtype) for hook in found.hooks)


def _cast(hook: Hook, dtype: torch.dtype) -> Hook:
    def run(g: torch.Tensor) -> Any:
        out = hook(g.to(dtype))
        return None if out is None else out.to(g.dtype)

    return run


def run_hooks(views: Mapping[str, torch.Tensor], hooks: Hooks) -> None:
    """Registers `hooks` on the tensors the loss is handed (`views`, by path)."""
    for path, view in views.items():
        for hook in hooks_for(hooks.get(path), view.dtype) if view.requires_grad else ():
            view.register_hook(hook)
