"""Torch's own activation checkpoints inside a step, run eagerly: recomputed with the
parameters their forward used ([Note: recomputes]).

Non-reentrant `torch.utils.checkpoint` runs its function again inside the backward,
after `functional_call` (or fzero's module hooks) have put the module's own, stale
parameters back. Every such call, however the caller imported `checkpoint`, passes
torch's generator, whose function is what the recompute runs: wrapped once per process,
it passes through outside a step and, inside one, hands torch a function that binds what
the checkpointed function's modules had bound in its forward. A reentrant checkpoint
cannot run under the step's gradient (taken with respect to given tensors); inside a
step it runs as its non-reentrant twin, the same gradients.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from ._bindings import Slots, bind, bindings, recall, slots


@contextlib.contextmanager
def checkpoints_rebound(module: nn.Module | None, compiled: bool = False) -> Iterator[None]:
    """Within the block (a step's forward and backward), torch's checkpoints that run
    eagerly recompute with the parameters their forward used. What a checkpointed
    function reads is told from the function: a module, a module's method, what a
    partial, a closure, a default or a list holds, modules among its arguments, those
    holding parameters or buffers; `module`, whole, where none is seen or one seen lies
    outside it.

    Args:
      module: the step's `module=` (None: the function's own modules only).
      compiled: the step is compiled: a checkpoint runs eagerly only between the pieces
        of a loss that breaks the graph, where a unit `module=`'s hooks entered in the
        graph cannot enter again for the recompute (a recompute that reads it is
        refused, saying so).
    """
    _install()
    token = _STEP.set(_Step(module, compiled))
    try:
        yield
    finally:
        _STEP.reset(token)


class _Step:
    """A step's `module=` (None: not given), as checkpoints inside it see it."""

    def __init__(self, module: nn.Module | None, compiled: bool = False) -> None:
        self.module, self.compiled = module, compiled
        self._under: set[int] | None = None
        self._walked: dict[tuple[int, ...], Slots] = {}  # its modules' slots, by their ids

    def slots(self, modules: list[nn.Module]) -> Slots:
        """Where `modules` bind tensors: walked once a step (the modules live through it),
        not once a checkpoint (a model's own method, checkpointed per layer, reaches the
        whole model each time)."""
        key = tuple(map(id, modules))
        found = self._walked.get(key)
        if found is None:
            found = self._walked[key] = slots(modules)
        return found

    def modules(self, reached: list[nn.Module]) -> list[nn.Module]:
        """What a checkpointed function that visibly reaches `reached` may read."""
        held = [m for m in reached if _holds_tensors(m)]
        if self.module is None:
            return held
        if self._under is None:
            self._under = {id(m) for m in self.module.modules()}
        if held and all(id(m) in self._under for m in held):
            return held
        # None seen (a function reaching the model through a global, or an object that
        # is not a module), or one outside `module=`: the model may be read otherwise.
        return [*held, self.module]


def _holds_tensors(module: nn.Module) -> bool:
    """Whether `module` (or a submodule) has a parameter or a buffer: a module without
    any (an activation handed as an argument) says nothing about what is read."""
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


# The step running now (None: outside one, where torch's checkpoints run
# untouched). A context variable, as other threads of the process may checkpoint outside
# any step; a recompute sets it again for checkpoints nested inside it (on a GPU autograd
# runs it on a thread of its own).
_STEP: ContextVar[_Step | None] = ContextVar("fzero_recompute_step", default=None)
_GENERATOR = "_checkpoint_without_reentrant_generator"  # torch >= 2.1


def current_step() -> Any:
    """The step running now, as checkpoints see it (None: outside one)."""
    return _STEP.get()


_INSTALLED: list[bool] = []
_LOCK = threading.Lock()


def _install() -> None:
    """Wraps torch's checkpoints, once per process (outside a step, each runs as it
    is): the non-reentrant generator, whose function the recompute calls, and the
    reentrant `CheckpointFunction`, which inside a step runs as the non-reentrant one."""
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
        generator = getattr(torch_checkpoint, _GENERATOR, None)
        reentrant = getattr(torch_checkpoint, "CheckpointFunction", None)
        if generator is None or reentrant is None:  # a torch that checkpoints otherwise
            warnings.warn(
                f"fzero: torch {torch.__version__} has no torch.utils.checkpoint."
                f"{_GENERATOR} or CheckpointFunction: torch.utils.checkpoint inside a step "
                "recomputes with the module's own parameters, not the step's (or refuses "
                "the step's gradient); checkpoint with fzero.remat instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        wrapped = _rebinding(generator)
        setattr(torch_checkpoint, _GENERATOR, wrapped)
        torch_checkpoint.CheckpointFunction = _reentrant(reentrant)
        # Modules that imported the generator by name before now (torch's own composable
        # `checkpoint`, FSDP2's activation checkpointing API) call it through theirs.
        for mod in list(sys.modules.values()):
            if getattr(mod, _GENERATOR, None) is generator:
                setattr(mod, _GENERATOR, wrapped)


def _rebinding(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's non-reentrant generator, its recompute binding the forward's bindings inside
    a step. It takes the function, a fixed number of options, then the function's own
    arguments (`checkpoint`'s call, torch 2.1-2.13)."""
    kinds = [p.kind for p in inspect.signature(original).parameters.values()]
    options = kinds.index(inspect.Parameter.VAR_POSITIONAL) - 1

    @functools.wraps(original)
    def generator(fn: Callable[..., Any], *rest: Any, **kwargs: Any) -> Any:
        step = _STEP.get()
        if step is None or getattr(fn, "_fzero_rebinds", False):
            return original(fn, *rest, **kwargs)
        modules = step.modules(_reach(fn, *rest[options:], *kwargs.values()))
        return original(recomputing(step.slots(modules), fn) if modules else fn, *rest, **kwargs)

    return generator


def _reentrant(original: Any) -> Any:
    """torch's reentrant `CheckpointFunction`, run as the non-reentrant checkpoint inside a
    step where a gradient flows through it: the reentrant one recomputes and runs a
    backward of its own inside the step's, which torch refuses under a gradient taken
    with respect to given tensors (the step's). The gradients are the same. Where none
    flows (no input needs one: torch's reentrant checkpoint then gives its parameters
    none), it is torch's."""

    class CheckpointFunction(original):  # type: ignore[misc, valid-type]
        @classmethod
        def apply(cls, function: Callable[..., Any], preserve: bool, *args: Any) -> Any:  # type: ignore[override]
            flows = torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args
            )
            if _STEP.get() is None or not flows:
                return super().apply(function, preserve, *args)
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=False, preserve_rng_state=preserve
            )

    CheckpointFunction.__doc__ = original.__doc__
    return CheckpointFunction


def recomputing(where: Slots, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, binding what is bound `where` now for the call (the recompute), with the
    step seen by checkpoints nested in it."""
    later = recall(bindings(where))
    keep = kept()
    step = _STEP.get()

    def run(*a: Any, **kw: Any) -> Any:
        bound = later()
        with keep(), bind(bound), placeholders_said(step, bound, fn, "torch.utils.checkpoint"):
            return fn(*a, **kw)

    run._fzero_rebinds = True  # type: ignore[attr-defined]
    return run


@contextlib.contextmanager
def placeholders_said(step: Any, bound: Any, fn: Any, how: str) -> Iterator[None]:
    """Around a recompute: a compiled step's placeholders (units module='s hooks enter
    inside the graph, which cannot enter again here) are bound as they were, and a
    recompute that reads one fails on the meta device: said as what it is (`how`: the
    checkpoint's name). One that reads none runs."""
    apart = step is not None and step.compiled and any(_meta(v) for _, _, v in bound)
    try:
        yield
    # What reading a placeholder raises: an op mixing meta and real tensors
    # (RuntimeError, torch's recompute check among them), or one without a meta kernel
    # (NotImplementedError). Anything else, or no placeholder, as it is.
    except (RuntimeError, NotImplementedError) as exc:
        if not (apart and "meta" in str(exc)):
            raise
        what = getattr(fn, "__qualname__", type(fn).__name__)
        raise ValueError(
            f"fzero: a {how} of {what} ran outside a compiled step's graph (the loss "
            "compiles in pieces, and fzero.remat always breaks the graph) over a unit that "
            "module='s hooks enter, and its recompute in the backward cannot enter it "
            "again: checkpoint the unit's body rather than the unit (inside it), enter "
            "that unit before the loss (no module=), or step it eagerly"
        ) from exc


def kept() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The step seen now, to be seen again later (a recompute, perhaps on another
    thread): a context manager factory that sets it for its block."""
    step = _STEP.get()

    @contextlib.contextmanager
    def again() -> Iterator[None]:
        token = _STEP.set(step)
        try:
            yield
        finally:
            _STEP.reset(token)

    return again


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


def _meta(value: Any) -> bool:
    """A placeholder on the meta device (a unit's, before its hooks enter it)."""
    return isinstance(value, torch.Tensor) and value.is_meta
