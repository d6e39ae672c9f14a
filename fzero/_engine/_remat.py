"""remat: activation checkpointing that recomputes with the parameters the forward used."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._gathered import ACTIVE

Bindings = list[tuple[nn.Module, str, str, Any]]


def remat(module: nn.Module) -> Callable[..., Any]:
    """`module` as a callable whose activations are recomputed in backward, not stored.

    Call it inside a forward: `x = fzero.remat(self.mlp)(x)`. Non-reentrant
    `torch.utils.checkpoint` alone is unsafe under `torch.func.functional_call`: the
    recompute runs during backward, after functional_call has put the module's own
    parameters back, and silently recomputes with those (stale) values. remat records
    the tensors bound to the module's parameters and buffers when the forward runs and
    binds them again for the recompute. Inside an eager `sharded_step`, torch's own
    checkpoint is rebound the same way (`recomputes_rebound`); remat also works by hand,
    outside a step.

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
    now: Bindings | None = _bindings([module])
    later = _recall(now)

    def run(*a: Any, **kw: Any) -> Any:
        with _bind(now if now is not None else later()):  # else: the recompute
            return fn(*a, **kw)

    run._fzero_rebinds = True  # type: ignore[attr-defined]  # torch's checkpoint: as it is
    try:
        return checkpointer(run, *args, **kwargs)
    finally:
        now = None


def _recall(now: Bindings) -> Callable[[], Bindings]:
    """`now` again, for a recompute inside the backward. Only what the step would save
    of it is kept: inside a resharding stage-3 step, handles to a unit's parameters
    rather than the tensors, which the backward gathers again."""
    engine = ACTIVE.get()
    if engine is None:
        return lambda: now
    held = [(sub, slot, k, engine.hold(v)) for sub, slot, k, v in now]
    return lambda: [(sub, slot, k, engine.fetch(v)) for sub, slot, k, v in held]


@contextlib.contextmanager
def recomputes_rebound(module: nn.Module | None) -> Iterator[None]:
    """Within the block (an eager step's forward and backward), activation checkpoints
    recompute with the parameters their forward used, as `remat` does.

    Non-reentrant `torch.utils.checkpoint` runs its function again inside the backward,
    after `functional_call` (or fzero's module hooks) have put the module's own, stale
    parameters back: silently wrong gradients, or meta ones from a deferred model. Two
    doors are watched: Hugging Face's `gradient_checkpointing_enable()` gives each layer a
    `_gradient_checkpointing_func`, wrapped for the block; and every other non-reentrant
    checkpoint (however the caller imported `checkpoint`) passes torch's generator, whose
    function is what the recompute runs (`_install`). What a checkpointed function reads
    is told from the function: a module, a module's method, a closure or partial holding
    modules, modules among its arguments; else the step's `module`, whole.

    Args:
      module: the step's `module=` (None: the function's own modules only).
    """
    swapped = []
    for sub in () if module is None else module.modules():
        own = vars(sub).get("_gradient_checkpointing_func")
        if own is not None and getattr(sub, "gradient_checkpointing", False) is True:
            swapped.append((sub, own))  # its own kept inside: its kwargs, its offload
            sub._gradient_checkpointing_func = functools.partial(rebound, own, sub)
    _install()
    token = _STEP.set([] if module is None else [module])
    try:
        yield
    finally:
        _STEP.reset(token)
        for sub, own in swapped:
            sub._gradient_checkpointing_func = own


# The step's fallback modules while an eager step runs (None: outside one, where torch's
# checkpoint runs untouched). A context variable: simulated ranks are threads.
_STEP: ContextVar[list[nn.Module] | None] = ContextVar("fzero_recompute_step", default=None)
_GENERATOR = "_checkpoint_without_reentrant_generator"  # torch >= 2.1
_INSTALLED: list[Any] = []
_LOCK = threading.Lock()


def _install() -> None:
    """Wraps torch's non-reentrant checkpoint generator, once per process: outside an
    eager step it runs as it is; inside one, the function it recomputes with binds the
    bindings its forward saw first. The generator takes the function, a fixed number of
    options, then the function's own arguments (`checkpoint`'s call, torch 2.1-2.13)."""
    with _LOCK:
        if _INSTALLED:
            return
        original = getattr(torch_checkpoint, _GENERATOR, None)
        if original is None:  # a torch that checkpoints otherwise: said, not guessed at
            _INSTALLED.append(None)
            warnings.warn(
                f"fzero: torch {torch.__version__} has no torch.utils.checkpoint."
                f"{_GENERATOR}: a non-reentrant torch.utils.checkpoint inside a step "
                "recomputes with the module's own parameters, not the step's; checkpoint "
                "with fzero.remat instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        kinds = [p.kind for p in inspect.signature(original).parameters.values()]
        options = kinds.index(inspect.Parameter.VAR_POSITIONAL) - 1

        @functools.wraps(original)
        def generator(fn: Callable[..., Any], *rest: Any, **kwargs: Any) -> Any:
            step = _STEP.get()
            if step is None or getattr(fn, "_fzero_rebinds", False):
                return original(fn, *rest, **kwargs)
            modules = _reach(fn, *rest[options:], *kwargs.values()) or step
            return original(_recomputing(modules, fn) if modules else fn, *rest, **kwargs)

        setattr(torch_checkpoint, _GENERATOR, generator)
        _INSTALLED.append(original)


def _recomputing(modules: list[nn.Module], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, binding what `modules` have bound now for the call (torch's recompute)."""
    later = _recall(_bindings(modules))

    def run(*a: Any, **kw: Any) -> Any:
        with _bind(later()):
            return fn(*a, **kw)

    return run


def _reach(*objs: Any, depth: int = 2) -> list[nn.Module]:
    """The modules a checkpointed function can be seen to read, among `objs`: modules, a
    method's owner, and what partials and functions (closures, defaults; `depth` levels
    of them) and lists or tuples hold (torch's `checkpoint_sequential` closes over a list
    of modules)."""
    found: list[nn.Module] = []
    for obj in objs:
        owner = getattr(obj, "__self__", None)
        if isinstance(obj, nn.Module):
            found.append(obj)
        elif isinstance(owner, nn.Module):
            found.append(owner)
        elif isinstance(obj, list | tuple):
            found += [x for x in obj if isinstance(x, nn.Module)]
        elif depth and isinstance(obj, functools.partial):
            found += _reach(obj.func, *obj.args, *obj.keywords.values(), depth=depth - 1)
        elif depth and inspect.isfunction(obj):
            found += _reach(*_held(obj), depth=depth - 1)
    return found


def _held(fn: Any) -> Iterator[Any]:
    """What a function holds: its closure's cells and its arguments' defaults."""
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    yield from fn.__defaults__ or ()
    yield from (fn.__kwdefaults__ or {}).values()


def _bindings(modules: list[nn.Module]) -> Bindings:
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


@contextlib.contextmanager
def _bind(bound: Bindings) -> Iterator[None]:
    old = [(sub, slot, k, getattr(sub, slot)[k]) for sub, slot, k, _ in bound]
    try:
        for sub, slot, k, v in bound:
            getattr(sub, slot)[k] = v
        yield
    finally:
        for sub, slot, k, v in old:
            getattr(sub, slot)[k] = v
