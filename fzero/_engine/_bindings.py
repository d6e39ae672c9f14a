"""Bindings: the tensors a module tree has bound as parameters and buffers, recorded in a
forward and bound again for the recompute of an activation checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
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


def shared_slots(module: nn.Module | None, buffers: Collection[str] = ()) -> Slots:
    """Where the submodules `module` reaches by more than one path (`ModuleList([layer] *
    n)`, a head registered twice) bind the tensors a step hands `functional_call`: their
    parameters, and the buffers named in `buffers` (the state's, by path). torch 2.13's
    `functional_call` (pytorch#164759) swaps such a slot once per path and puts back what
    its second swap found: the tensor it was given, which the module then keeps
    (`restored` mends it). Other buffers are the module's own to change (a cache a
    forward registers anew)."""
    if module is None:
        return ()
    paths: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), (sub, []))[1].append(name)
    out: list[tuple[dict[str, Any], str]] = []
    for sub, names in paths.values():
        if len(names) > 1:
            out += [(sub._parameters, k) for k in sub._parameters]
            out += [
                (sub._buffers, k)
                for k in sub._buffers
                if any((f"{n}.{k}" if n else k) in buffers for n in names)
            ]
    return tuple(out)


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
