"""Bindings: the tensors a module tree has bound as parameters and buffers, recorded in a
forward and bound again for the recompute of an activation checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ._gathered import ACTIVE

Bindings = list[tuple[nn.Module, str, str, Any]]  # (module, slot, name, what is bound)


def bindings(modules: list[nn.Module]) -> Bindings:
    """What `modules` and their submodules have bound as parameters and buffers now."""
    out: Bindings = []
    seen: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if id(sub) not in seen:
                seen.add(id(sub))
                out += [(sub, "_parameters", k, v) for k, v in sub._parameters.items()]
                out += [(sub, "_buffers", k, v) for k, v in sub._buffers.items()]
    return out


def recall(now: Bindings) -> Callable[[], Bindings]:
    """`now` again, for a recompute inside the backward. Only what the step would save
    of it is kept: inside a resharding stage-3 step, handles to a unit's parameters
    rather than the tensors, which the backward gathers again."""
    engine = ACTIVE.get()
    if engine is None:
        return lambda: now
    held = [(sub, slot, k, engine.hold(v)) for sub, slot, k, v in now]
    return lambda: [(sub, slot, k, engine.fetch(v)) for sub, slot, k, v in held]


@contextlib.contextmanager
def bind(bound: Bindings) -> Iterator[None]:
    """Within the block, `bound`'s tensors are bound; what was bound before, after it."""
    old = [(sub, slot, k, getattr(sub, slot)[k]) for sub, slot, k, _ in bound]
    try:
        for sub, slot, k, v in bound:
            getattr(sub, slot)[k] = v
        yield
    finally:
        for sub, slot, k, v in old:
            getattr(sub, slot)[k] = v
