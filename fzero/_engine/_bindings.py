"""Bindings: the tensors a module tree has bound as parameters and buffers, recorded in a
forward and bound again for the recompute of an activation checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ._gathered import ACTIVE

# Where a module tree binds tensors: each submodule's `_parameters` or `_buffers` dict,
# and a name in it; and what is bound there.
Slots = tuple[tuple[dict[str, Any], str], ...]
Bindings = list[tuple[dict[str, Any], str, Any]]


def slots(modules: list[nn.Module]) -> Slots:
    """Where `modules` and their submodules bind parameters and buffers (a walk of the
    trees: a step that binds the same modules again walks them once)."""
    out: list[tuple[dict[str, Any], str]] = []
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                out += [(sub._parameters, k) for k in sub._parameters]
                out += [(sub._buffers, k) for k in sub._buffers]
    return tuple(out)


def bindings(where: Slots) -> Bindings:
    """What is bound now at `where`."""
    return [(d, k, d[k]) for d, k in where]


def recall(now: Bindings) -> Callable[[], Bindings]:
    """`now` again, for a recompute inside the backward. Only what the step would save
    of it is kept: inside a resharding stage-3 step, handles to a unit's parameters
    rather than the tensors, which the backward gathers again."""
    engine = ACTIVE.get()
    if engine is None:
        return lambda: now
    held = [(d, k, engine.hold(v)) for d, k, v in now]
    return lambda: [(d, k, engine.fetch(v)) for d, k, v in held]


@contextlib.contextmanager
def bind(bound: Bindings) -> Iterator[None]:
    """Within the block, `bound`'s tensors are bound; what was bound before, after it."""
    old = [(d, k, d[k]) for d, k, _ in bound]
    try:
        for d, k, v in bound:
            d[k] = v
        yield
    finally:
        for d, k, v in old:
            d[k] = v


def shared_slots(module: nn.Module | None) -> Slots:
    """Where the submodules `module` reaches by more than one path (`ModuleList([layer] *
    n)`, a head registered twice) bind tensors. torch's `functional_call` (2.13,
    pytorch#164759) swaps such a slot once per path and puts back what its second swap
    found: the tensor it was given, which the module then keeps (`restored` mends it)."""
    if module is None:
        return ()
    seen: set[int] = set()
    twice: dict[int, nn.Module] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in seen:
            twice[id(sub)] = sub
        seen.add(id(sub))
    return slots(list(twice.values()))


@contextlib.contextmanager
def restored(where: Slots) -> Iterator[None]:
    """What is bound at `where` now is bound there again after the block, whatever the
    block (a loss calling `functional_call`) left there."""
    before = bindings(where)
    try:
        yield
    finally:
        for d, k, v in before:
            if d.get(k) is not v:
                d[k] = v
