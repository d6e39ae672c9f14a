"""Module hooks: a unit enters the loss when its submodule runs (`sharded_step(module=)`).

A thin user of the engine's `enter`, the call `fzero.gathered` makes: a forward pre-hook
enters the unit (its node is created *now*, just in time) and swaps the full views into
the submodule for its forward; a forward hook puts back what was there
(functional_call's placeholders) and tells the engine the unit's forward is over
(`leave`), so a resharding step frees its parameters right there.

A unit grouping several submodules (FSDP2's `fully_shard([m1, m2])`) enters at the
pre-hook of the first of them to run and leaves at the forward hook of the last: each
member swaps in its own leaves from that one entry. A member running again once it has
run (or while it runs) enters the unit anew, as a single-module unit's does.

A forward that never reaches its forward hook leaves its swap for the end of the
micro-batch to undo: torch's non-reentrant checkpoint stops a recompute as soon as it has
the tensors it needs (mid-forward, past the pre-hook). The module then gets its own
parameters back, not views of buffers the step frees. Only slots still holding the views
are touched: a loss that raises inside a submodule unwinds through `functional_call`,
which has put the module's own parameters back already.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .._core import ShardLayout, covers
from ._forward_methods import AsForward, forward_methods

# A hooked unit's parameters: (leaf path, the module holding it, its attribute name).
Slots = tuple[tuple[str, nn.Module, str], ...]
# Per member of a hooked unit (one, or a group's): its submodule and its leaves' slots.
Members = tuple[tuple[nn.Module, Slots], ...]


class _Enters(Protocol):
    def enter(self, unit: str) -> dict[str, torch.Tensor]: ...

    def computes(self, unit: str) -> None: ...

    def leave(self, unit: str, output: Any = None, done: bool = True) -> Any: ...


class _Open(NamedTuple):
    """A hooked unit's current entry: its views, and which members' forwards began and
    ended (indices into the unit's members). A NamedTuple, not a dataclass: a compiled
    step traces the hooks, and dynamo builds a dataclass instance in Python, a hundred
    bytecodes a unit entered."""

    views: dict[str, torch.Tensor]
    started: set[int]
    done: set[int]


class ModuleHooks:
    """Forward hooks on the unit submodules for the duration of one micro-batch."""

    def __init__(
        self, engine: _Enters, hooked: Mapping[str, Members], traced: bool = False
    ) -> None:
        """`traced`: the hooks are meant to be traced (a compiled step's); otherwise they
        are opaque to dynamo, which runs them as they are (an eager step's hooks issue
        collectives): a model the user compiled, `block.compile()` compiling its hooks
        too, breaks its graph around them."""
        self.engine, self.hooked = engine, hooked
        self.opaque = not traced
        self.handles: list[Any] = []
        self.open: dict[str, _Open] = {}
        # Per (unit, member), a stack of swaps: (module, attribute, what was there, view).
        self.swapped: dict[tuple[str, int], list[list[tuple[nn.Module, str, Any, Any]]]] = {}

    def __enter__(self) -> ModuleHooks:
        for unit, members in self.hooked.items():
            for j, (sub, _) in enumerate(members):
                # First of the pre-hooks, last of the hooks: the module's own hooks (the
                # old `torch.nn.utils.weight_norm` computing `weight` from `weight_g` and
                # `weight_v`) see the unit's parameters, not placeholders. A last
                # pre-hook tells the engine what the module's own pushed (a checkpoint's
                # saved-tensor hooks: `torch.distributed._composable.checkpoint`).
                pre = self._opaque(self._pre(unit, j))
                post = self._opaque(self._post(unit, j))
                self.handles.append(sub.register_forward_pre_hook(pre, prepend=True))
                # Traced, the engine has nothing to learn there (`TracedHooks.computes`),
                # and each hook is bytecodes dynamo steps through at every member's call.
                late = self._opaque(self._late(unit)) if self.opaque else None
                if late is not None:
                    self.handles.append(sub.register_forward_pre_hook(late))
                self.handles.append(sub.register_forward_hook(post))
                for name in forward_methods(sub):  # `register_forward_method`'s
                    before = tuple(_no_kwargs(h) for h in (pre, late) if h is not None)
                    self.handles.append(AsForward(sub, name, before, (post,)))
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

    def _opaque(self, hook: Any) -> Any:
        """`hook` as dynamo will run it: as it is, without tracing it (an eager step's).
        Only once dynamo is loaded (something was compiled): loading it takes a second."""
        if self.opaque and "torch._dynamo" in sys.modules:
            return torch.compiler.disable(hook)
        return hook

    def _pre(self, unit: str, j: int) -> Any:
        def hook(sub: nn.Module, args: Any) -> None:
            entry = self.open.get(unit)
            if entry is None or j in entry.started:
                entry = self.open[unit] = _Open(self.engine.enter(unit), set(), set())
            entry.started.add(j)
            swaps = []
            for path, owner, name in self.hooked[unit][j][1]:
                swaps.append((owner, name, owner._parameters[name], entry.views[path]))
                owner._parameters[name] = entry.views[path]
            self.swapped.setdefault((unit, j), []).append(swaps)

        return hook

    def _late(self, unit: str) -> Any:
        def hook(sub: nn.Module, args: Any) -> None:
            self.engine.computes(unit)

        return hook

    def _post(self, unit: str, j: int) -> Any:
        def hook(sub: nn.Module, args: Any, output: Any) -> Any:
            for owner, name, old, _ in reversed(self.swapped[unit, j].pop()):
                owner._parameters[name] = old
            entry = self.open.get(unit)
            if entry is None or j not in entry.started:
                return None
            entry.done.add(j)
            done = len(entry.done) == len(self.hooked[unit])
            if done:
                del self.open[unit]
            return self.engine.leave(unit, output, done)  # the output, unaliased

        return hook


def _no_kwargs(hook: Any) -> Any:
    """A forward pre-hook `(module, args)` as one taking the kwargs too (`AsForward`)."""
    return lambda module, args, kwargs: hook(module, args)


def hookable_units(layout: ShardLayout, module: nn.Module | None) -> dict[str, Members]:
    """The units entered by hooks: those whose prefixes all name submodules of `module`
    that run, each with those submodules and the (path, owning module, attribute) of the
    parameters under each.

    A container such as `nn.ModuleList` has no forward of its own, so no hook would ever
    fire for it: such units are entered before the forward, like units that name no
    submodule, and the root; so are units with a weight tied to a module outside them
    (registered under both names). A submodule whose parent reads its parameters without
    calling it (`nn.MultiheadAttention`'s `out_proj`) is entered by the parent's hooks.
    Every leaf of a hooked unit must be a registered parameter of `module` under its path
    (params from `dict(module.named_parameters())`), since the hook swaps it in by name.
    """
    if module is None:
        return {}
    names = dict(module.named_modules(remove_duplicate=False))  # a shared one by each path
    aliases: dict[int, list[str]] = {}  # a Parameter's names, tied ones all of them
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    out: dict[str, Members] = {}
    for unit, prefixes in zip(layout.units, layout.members, strict=True):
        if not unit or not layout.unit_buckets(unit):
            continue
        subs = [names.get(_runs_at(p, names)) for p in prefixes]
        # A container is never called: its unit enters before the forward.
        if any(m is None or type(m).forward is nn.Module.forward for m in subs):
            continue
        # A weight tied to a module outside the unit (a GPT's head sharing the token
        # embedding's) is used where the unit's hooks do not reach: before the forward.
        if _tied_out(layout, unit, prefixes, names, aliases):
            continue
        slots: list[dict[tuple[int, str], tuple[str, nn.Module, str]]] = [{} for _ in prefixes]
        for i in layout.unit_buckets(unit):
            for s in layout.buckets[i].slots:
                head, _, name = s.path.rpartition(".")
                owner = names.get(head) if head else module
                if owner is None or name not in owner._parameters:
                    raise ValueError(
                        f"unit {unit!r}: leaf {s.path!r} is not a parameter of the module "
                        "passed as module= (use dict(module.named_parameters()) as params)"
                    )
                # The leaf is swapped in under each of its names (all inside the unit):
                # a weight two of its modules share, or a module it reaches by two paths,
                # is seen by whichever member runs it.
                for alias in aliases.get(id(owner._parameters[name]), [s.path]):
                    a_head, _, a_name = alias.rpartition(".")
                    a_owner = names[a_head] if a_head else module
                    j = next(j for j, p in enumerate(prefixes) if covers(p, alias))
                    slots[j].setdefault((id(a_owner), a_name), (s.path, a_owner, a_name))
        members = (tuple(sl.values()) for sl in slots)
        out[unit] = tuple(zip(subs, members, strict=True))
    return out


def _tied_out(
    layout: ShardLayout,
    unit: str,
    prefixes: tuple[str, ...],
    names: Mapping[str, nn.Module],
    aliases: Mapping[int, list[str]],
) -> bool:
    """Whether a parameter of `unit` is also registered under a name outside it."""
    for i in layout.unit_buckets(unit):
        for s in layout.buckets[i].slots:
            head, _, name = s.path.rpartition(".")
            owner = names.get(head)  # "" names the root module
            param = None if owner is None else owner._parameters.get(name)
            if param is None:
                continue  # hookable_units says what is wrong with such a leaf
            if any(not any(covers(p, o) for p in prefixes) for o in aliases[id(param)]):
                return True
    return False


# Modules whose forward reads a child's parameters without calling the child:
# `nn.MultiheadAttention` passes `out_proj.weight` to `F.multi_head_attention_forward`,
# so `out_proj`'s own hooks never fire (FSDP1's size-based auto-wrap keeps it whole).
_READS_CHILDREN = (nn.MultiheadAttention,)


def _runs_at(prefix: str, names: Mapping[str, nn.Module]) -> str:
    """The module whose forward hooks enter the unit of `prefix`'s submodule: itself, or
    the nearest ancestor whose forward uses its parameters when it does not run."""
    while prefix:
        parent = prefix.rpartition(".")[0]
        if not isinstance(names.get(parent), _READS_CHILDREN):
            return prefix
        prefix = parent
    return prefix
