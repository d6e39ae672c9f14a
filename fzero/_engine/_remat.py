"""remat: activation checkpointing that recomputes with the parameters the forward used."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._bindings import Bindings, bind, bindings, recall, slots
from ._checkpoints import current_step, kept, placeholders_said


def remat(module: nn.Module) -> Callable[..., Any]:
    """`module` as a callable whose activations are recomputed in backward, not stored.

    Call it inside a forward: `x = fzero.remat(self.mlp)(x)`. Non-reentrant
    `torch.utils.checkpoint` alone is unsafe under `torch.func.functional_call`: the
    recompute runs during backward, after functional_call has put the module's own
    parameters back, and silently recomputes with those (stale) values. remat records
    the tensors bound to the module's parameters and buffers when the forward runs and
    binds them again for the recompute. Inside an eager `sharded_step`, torch's own
    checkpoint is rebound the same way (`checkpoints_rebound`); remat also works by hand,
    outside a step.

    Inside a unit (`fzero.units`), remat of the unit's body is FSDP(checkpoint(m)), the
    order fzero recommends: the unit is gathered once for its backward and the recompute
    uses that. remat of the unit module itself is checkpoint(FSDP(m)): the recompute
    re-enters the unit's hook inside the backward, where it reuses the forward's entry of
    the unit (the same one gather for the backward; no reduction of its own), but the
    unit's parameters are then alive for the whole recompute.

    The recompute is a replay: the buffers the forward wrote, in place (BatchNorm's running
    statistics, a power iteration's vectors) or by rebinding (`self.ema = ...`), read what
    they held before the forward, and what the recompute writes to them is dropped.
    torch's checkpoint writes them a second time (BatchNorm's statistics move twice a
    step); FairScale's `checkpoint_wrapper` mends BatchNorm alone. This costs a copy of the
    module's buffers, kept from the forward to its backward.

    Args:
      module: the submodule to checkpoint.

    Returns:
      A callable with the module's call signature.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return rebound(_non_reentrant, module, _replayed(module), *args, **kwargs)

    return call


def _replayed(module: nn.Module) -> Callable[..., Any]:
    """`module` as a function whose second call (the recompute) reads the module's buffers
    as the first call (the forward) found them, and writes to copies of them."""
    found: list[tuple[dict[str, Any], str, torch.Tensor]] | None = None

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal found
        if found is not None:  # the recompute: fresh copies, should it run twice
            with bind(_copies(found)):
                return module(*args, **kwargs)
        if torch.is_grad_enabled():  # else no graph: torch's checkpoint never recomputes
            with torch.no_grad():
                found = _copies(_replayable(module))
        return module(*args, **kwargs)

    run.__qualname__ = type(module).__name__  # what messages call it: the module's class
    return run


def _replayable(module: nn.Module) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """The buffer slots of `module`'s tree a replay copies, with what is bound there.

    Every buffer, not only those whose version counter the forward moves: BatchNorm's
    kernel writes its statistics without moving it. Left as they are: one that needs a
    gradient (a copy would cut it; autograd refuses writes to a leaf that needs one), and
    views sharing memory with another buffer (copies would part them)."""
    slots = [
        (d, k, v)
        for d in (sub._buffers for sub in module.modules())
        for k, v in d.items()
        if isinstance(v, torch.Tensor) and not v.requires_grad
    ]
    tensors: dict[Any, set[int]] = {}  # storage -> the distinct tensors on it
    for _, _, v in slots:
        tensors.setdefault(_storage(v), set()).add(id(v))
    return [(d, k, v) for d, k, v in slots if len(tensors[_storage(v)]) == 1]


def _copies(slots: list[tuple[dict[str, Any], str, torch.Tensor]]) -> list[Any]:
    """`slots` bound to copies of their tensors, one copy per tensor (a buffer registered
    in two submodules stays one)."""
    made: dict[int, torch.Tensor] = {}
    for _, _, v in slots:
        if id(v) not in made:
            made[id(v)] = v.clone()
    return [(d, k, made[id(v)]) for d, k, v in slots]


def _storage(v: torch.Tensor) -> Any:
    return (v.device, v.untyped_storage().data_ptr()) if v.device.type != "meta" else id(v)


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
    now: Bindings | None = bindings(slots([module]))
    later = recall(now)
    keep = kept()  # for checkpoints nested in the recompute
    step = current_step()

    def run(*a: Any, **kw: Any) -> Any:
        if now is not None:  # the forward, with what is bound: binding it again would put
            # back, after the forward, a buffer the forward itself rebinds (`self.ema = ...`)
            with keep(), placeholders_said(step, now, fn, "fzero.remat"):
                return fn(*a, **kw)
        bound = later()  # the recompute, whose own rebinding is put back after it
        with keep(), bind(bound), placeholders_said(step, bound, fn, "fzero.remat"):
            return fn(*a, **kw)

    run._fzero_rebinds = True  # type: ignore[attr-defined]  # torch's checkpoint: as it is
    try:
        return checkpointer(run, *args, **kwargs)
    finally:
        now = None
