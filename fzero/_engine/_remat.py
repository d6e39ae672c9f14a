"""remat: activation checkpointing that recomputes with the parameters the forward used."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from ._gathered import ACTIVE


def remat(module: nn.Module) -> Callable[..., Any]:
    """`module` as a callable whose activations are recomputed in backward, not stored.

    Call it inside a forward: `x = fzero.remat(self.mlp)(x)`. Non-reentrant
    `torch.utils.checkpoint` alone is unsafe under `torch.func.functional_call`: the
    recompute runs during backward, after functional_call has put the module's own
    parameters back, and silently recomputes with those (stale) values. remat records
    the tensors bound to the module's parameters and buffers when the forward runs and
    binds them again for the recompute.

    Inside a unit (`fzero.units`), remat of the unit's body is FSDP(checkpoint(m)), the
    order fzero recommends: the unit is gathered once for its backward and the recompute
    uses that. remat of the unit module itself is checkpoint(FSDP(m)): the recompute
    re-enters the unit's hook inside the backward, where it reuses the forward's entry of
    the unit (the same one gather for the backward; no reduction of its own), but the
    unit's parameters are then alive for the whole recompute.

    Args:
      module: the submodule to checkpoint.

    Returns:
      A callable with the module's call signature.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return rebound(_non_reentrant, module, module, *args, **kwargs)

    return call


def _non_reentrant(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


def rebound(
    checkpointer: Callable[..., Any],
    module: nn.Module,
    fn: Callable[..., Any],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """`checkpointer(fn, *args, **kwargs)` (torch's checkpoint, or one that calls it), its
    recompute run with `module`'s parameters and buffers bound to what they were when the
    forward ran."""
    # The forward binds what is bound now; the recompute keeps only what the step would
    # save of it (inside a resharding stage-3 step, handles to a unit's parameters
    # rather than the tensors, which the backward gathers again).
    engine = ACTIVE.get()
    now: list[Any] | None = _bindings(module)
    hold = (lambda v: v) if engine is None else engine.hold
    later = [(sub, slot, k, hold(v)) for sub, slot, k, v in now]

    def run(*a: Any, **kw: Any) -> Any:
        if now is not None:
            bound = now
        else:  # the recompute, inside the backward
            fetch = (lambda v: v) if engine is None else engine.fetch
            bound = [(sub, slot, k, fetch(v)) for sub, slot, k, v in later]
        with _bind(module, bound):
            return fn(*a, **kw)

    try:
        return checkpointer(run, *args, **kwargs)
    finally:
        now = None


@contextlib.contextmanager
def layers_rebound(module: nn.Module | None) -> Iterator[None]:
    """Within the block, layers that checkpoint their own forward (Hugging Face's
    `gradient_checkpointing_enable()` gives each a `_gradient_checkpointing_func`, which
    torch's checkpoint runs again inside the backward, after `functional_call` has put the
    module's own, stale parameters back: silently wrong gradients, or meta ones from a
    deferred model) checkpoint as `remat` does, recomputing with the forward's
    parameters."""
    swapped = []
    for sub in () if module is None else module.modules():
        own = vars(sub).get("_gradient_checkpointing_func")
        if own is not None and getattr(sub, "gradient_checkpointing", False) is True:
            swapped.append((sub, own))  # its own kept inside: its kwargs, its offload
            sub._gradient_checkpointing_func = functools.partial(rebound, own, sub)
    try:
        yield
    finally:
        for sub, own in swapped:
            sub._gradient_checkpointing_func = own


def _bindings(module: nn.Module) -> list[tuple[nn.Module, str, str, Any]]:
    out = []
    for sub in module.modules():
        out += [(sub, "_parameters", k, v) for k, v in sub._parameters.items()]
        out += [(sub, "_buffers", k, v) for k, v in sub._buffers.items()]
    return out


@contextlib.contextmanager
def _bind(module: nn.Module, bound: list[tuple[nn.Module, str, str, Any]]) -> Iterator[None]:
    old = [(sub, slot, k, getattr(sub, slot)[k]) for sub, slot, k, _ in bound]
    try:
        for sub, slot, k, v in bound:
            getattr(sub, slot)[k] = v
        yield
    finally:
        for sub, slot, k, v in old:
            getattr(sub, slot)[k] = v
