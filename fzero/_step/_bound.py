"""Bound: the models and states inside an open `fzero.bind` block, which a step refuses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._core import Shards, tree_flatten

# Open `bind` blocks on this process, innermost last: the model and its parameters'
# tensors. A step on either would run inside bind's session: at stage 3 bind's hooks hand
# the loss gathered units that carry no gradient (those units' weights never move), and
# at stages 0-2 the step's update writes the tensors bind holds.
_OPEN: list[tuple[nn.Module, frozenset[int]]] = []


@contextlib.contextmanager
def bound(model: nn.Module, state: Any) -> Iterator[None]:
    """Within the block, `model` and `state` are bound (`bound_said` names them)."""
    entry = (model, _tensors(state))
    _OPEN.append(entry)
    try:
        yield
    finally:
        _OPEN.remove(entry)  # this block's, whatever order blocks end in


def bound_said(module: nn.Module | None, state: Any, rank: int) -> str:
    """Why this rank refuses a step ("" if it does not): it runs inside a `bind` block over
    its own model (`module=`, or one sharing a submodule with it) or its own state, or
    without `module=`, where what its loss runs cannot be told from the bound model."""
    if not _OPEN:
        return ""
    if module is None:
        return (
            f"fzero: rank {rank}: sharded_step without module= inside a `with fzero.bind"
            f"(...)` block ({type(_OPEN[-1][0]).__name__}): fzero cannot tell whether its "
            "loss runs the bound model, which would then run inside bind's forward (at "
            "stage 3 without a gradient). Pass module= (the model the loss runs), or step "
            "after the block"
        )
    mine = _tensors(state)
    subs = {id(m) for m in module.modules()}
    for model, tensors in _OPEN:
        hit = [("model", any(id(m) in subs for m in model.modules())), ("state", tensors & mine)]
        own = " and ".join(what for what, found in hit if found)
        if own:
            return (
                f"fzero: rank {rank}: sharded_step inside a `with fzero.bind(...)` block "
                f"over its own {own} ({type(model).__name__}): the step would run inside "
                "bind's forward (at stage 3 its units reach the loss without a gradient; "
                "at stages 0-2 the update writes what bind holds). Step after the block, "
                "or bind another model (a teacher's) and state"
            )
    return ""


def _tensors(state: Any) -> frozenset[int]:
    params = getattr(state, "params", None)
    if isinstance(params, Shards):
        return frozenset(id(x) for x in params.buffers if x.numel())
    return frozenset(id(x) for x in tree_flatten(params)[0])
