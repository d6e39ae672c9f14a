"""Module hooks: a unit enters the loss when its submodule runs (`sharded_step(module=)`).

A thin user of the engine's `enter`, the call `fzero.gathered` makes: a forward pre-hook
enters the unit (its node is created *now*, just in time) and swaps the full views into
the submodule for its forward; a forward hook puts back what was there
(functional_call's placeholders) and tells the engine the unit's forward is over
(`leave`), so a resharding step frees its parameters right there.

A forward that never reaches its forward hook leaves its swap for the end of the
micro-batch to undo: torch's non-reentrant checkpoint stops a recompute as soon as it has
the tensors it needs (mid-forward, past the pre-hook). The module then gets its own
parameters back, not views of buffers the step frees. Only slots still holding the views
are touched: a loss that raises inside a submodule unwinds through `functional_call`,
which has put the module's own parameters back already.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ._layout import ShardLayout

# A hooked unit's parameters: (leaf path, the module holding it, its attribute name).
Slots = tuple[tuple[str, nn.Module, str], ...]


class _Enters(Protocol):
    def enter(self, unit: str) -> dict[str, torch.Tensor]: ...

    def leave(self, unit: str) -> None: ...


class ModuleHooks:
    """Forward hooks on the unit submodules for the duration of one micro-batch."""

    def __init__(self, engine: _Enters, hooked: Mapping[str, tuple[nn.Module, Slots]]) -> None:
        self.engine, self.hooked = engine, hooked
        self.handles: list[Any] = []
        # Per unit, a stack of swaps: (module, attribute, what was there, the view put in).
        self.swapped: dict[str, list[list[tuple[nn.Module, str, Any, Any]]]] = {}

    def __enter__(self) -> ModuleHooks:
        for unit, (sub, _) in self.hooked.items():
            self.handles.append(sub.register_forward_pre_hook(self._pre(unit)))
            self.handles.append(sub.register_forward_hook(self._post(unit)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        # Swaps whose forward hook never ran, newest first, so the oldest (what was there
        # before the micro-batch) is what stays.
        for stack in self.swapped.values():
            while stack:
                for owner, name, old, view in reversed(stack.pop()):
                    if owner._parameters.get(name) is view:
                        owner._parameters[name] = old

    def _pre(self, unit: str) -> Any:
        def hook(sub: nn.Module, args: Any) -> None:
            views = self.engine.enter(unit)
            swaps = []
            for path, owner, name in self.hooked[unit][1]:
                swaps.append((owner, name, owner._parameters[name], views[path]))
                owner._parameters[name] = views[path]
            self.swapped.setdefault(unit, []).append(swaps)

        return hook

    def _post(self, unit: str) -> Any:
        def hook(sub: nn.Module, args: Any, output: Any) -> None:
            for owner, name, old, _ in reversed(self.swapped[unit].pop()):
                owner._parameters[name] = old
            self.engine.leave(unit)

        return hook


def hookable_units(
    layout: ShardLayout, module: nn.Module | None
) -> dict[str, tuple[nn.Module, Slots]]:
    """The units entered by hooks: those naming a submodule of `module` that runs, each
    with that submodule and the (path, owning module, attribute) of its parameters.

    A container such as `nn.ModuleList` has no forward of its own, so no hook would ever
    fire for it: such units are entered before the forward, like units that name no
    submodule, and the root. Every leaf of a hooked unit must be a registered parameter
    of `module` under its path (params from `dict(module.named_parameters())`), since the
    hook swaps it in by name.
    """
    if module is None:
        return {}
    names = dict(module.named_modules())
    out: dict[str, tuple[nn.Module, Slots]] = {}
    for unit in layout.units:
        if not unit or unit not in names or not layout.unit_buckets(unit):
            continue
        if type(names[unit]).forward is nn.Module.forward:  # a container: never called
            continue
        slots = []
        for i in layout.unit_buckets(unit):
            for s in layout.buckets[i].slots:
                head, _, name = s.path.rpartition(".")
                owner = names.get(head) if head else module
                if owner is None or name not in owner._parameters:
                    raise ValueError(
                        f"unit {unit!r}: leaf {s.path!r} is not a parameter of the module "
                        "passed as module= (use dict(module.named_parameters()) as params)"
                    )
                slots.append((s.path, owner, name))
        out[unit] = (names[unit], tuple(slots))
    return out
