"""StepCache: what a step function carries from one call to the next."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .._core import ShardLayout, leaf_paths, tree_flatten
from .._engine import Context, Pool, hookable_units, shared_slots, trained_parameters


@dataclass
class StepCache:
    """What a step function (`sharded_step`, `sharded_forward`) keeps between calls.

    Written by the step function alone, between its calls' parts: what it calls reads
    the values it is given and returns what it learned.

    Attributes:
      order: the just-in-time units the last call called, in order (None: no call yet).
        The next call prefetches by it, and a rank without data follows it.
      micro: the micro-batches of the last step (accumulating), which a rank without
        data repeats.
      warned: a step with no weight anywhere was reported (once).
      checked_use: the first eager step with weight somewhere has said which trainable
        leaves no loss used (`_step._unused`).
      pool: the host buffers the step's collectives reuse (`_engine._pool`).
      looked: whether an offloaded update asked for the gradient's global norm (None:
        none ran yet). Once one ran without asking, offloaded buckets step while the
        backward goes on (`_step._overlap`).
    """

    order: list[str] | None = None
    micro: int | None = None
    warned: bool = False
    checked_use: bool = False
    looked: bool | None = None
    present: list[bool] = field(default_factory=list)  # first step: which ranks had data
    pool: Pool = field(default_factory=Pool)
    # (layout, key, its engine context): planned once per layout and key (the state's
    # precision, ...), as the options are the step function's and only the state varies.
    _planned: tuple[Any, Any, Context | None] = (None, None, None)
    _hooked: tuple[Any, dict[str, Any]] = (None, {})  # (layout, its hooked units)
    _shared: tuple[Any, Any, Any] = (None, None, ())  # (module, buffers' treedef, slots)
    _trained: tuple[Any, Any] = (None, ())  # (layout, module='s parameters it trains)
    _thread: ThreadPoolExecutor | None = None
    _compiled: tuple[Any, Any, Any] = (None, None, None)  # (layout, precision, loss)
    _flags: tuple[Any, Any] = (None, ())  # (layout, (path, parameter, frozen) watched)

    def compiled(self, layout: ShardLayout, precision: Any, make: Callable[[], Any]) -> Any:
        """The step's compiled loss for `layout` and `precision` (`_step._compiled`), made
        once per pair: torch.compile then recompiles by its own guards (shapes, dtypes)."""
        if self._compiled[0] is not layout or self._compiled[1] != precision:
            before = self._compiled[2]
            self._compiled = (layout, precision, make())
            # A rank without data runs its last batch again (`CompiledLoss.last`): any of
            # the step function's, whatever layout it ran under (before a reload, say).
            if before is not None and self._compiled[2].last is None:
                self._compiled[2].last = before.last
        return self._compiled[2]

    def host_thread(self) -> ThreadPoolExecutor:
        """The thread on which offloaded units step during the backward (`_step._overlap`):
        one per step function, kept between steps (a new thread would build its own pool
        of OpenMP workers every step)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fzero-offload")
        return self._thread

    def context(self, layout: ShardLayout, key: Any, make: Callable[[], Context]) -> Context:
        """The engine context for `layout` and `key` (what else of the state it depends
        on), made by `make` when either changed."""
        planned_layout, planned_key, ctx = self._planned
        if ctx is None or planned_layout is not layout or planned_key != key:
            ctx = make()
            self._planned = (layout, key, ctx)
        return ctx

    def trained_parameters(self, layout: ShardLayout, module: nn.Module | None) -> Any:
        """`module`'s parameters that `layout` trains, by path (walked once per layout)."""
        if self._trained[0] is not layout:
            self._trained = (layout, trained_parameters(layout, module))
        return self._trained[1]

    def flag_changed(self, layout: ShardLayout | None, module: nn.Module | None) -> str:
        """A leaf of `layout` whose `module=` parameter's `requires_grad` disagrees with
        the state's frozen flag, where it agreed at the first step under this layout
        ("" if none): a parameter frozen or unfrozen since would train unlike
        torch.optim. (One that disagreed from the start is the first step's warning.)"""
        if module is None or layout is None:
            return ""
        if self._flags[0] is not layout:
            named = dict(module.named_parameters(remove_duplicate=False))
            watched = tuple(
                (path, named[path], frozen)
                for path, frozen in zip(layout.paths, layout.frozen)
                if path in named and named[path].requires_grad != frozen
            )
            self._flags = (layout, watched)
            return ""
        return next((path for path, t, frozen in self._flags[1] if t.requires_grad == frozen), "")

    def shared_slots(self, module: nn.Module | None, buffers: Any = None) -> Any:
        """Where `module`'s submodules reached by several paths bind what a step hands
        `functional_call` (the parameters, and the state's `buffers`; walked once a
        module and buffer tree): what the step puts back after it (`restored`)."""
        spec = None if buffers is None else tree_flatten(buffers)[1]  # paths: only anew
        if self._shared[0] is not module or self._shared[1] != spec:
            paths = frozenset(() if buffers is None else leaf_paths(buffers))
            self._shared = (module, spec, shared_slots(module, paths))
        return self._shared[2]

    def hooked_units(self, layout: ShardLayout, module: nn.Module | None) -> dict[str, Any]:
        """The units of `layout` entered by hooks on `module`'s submodules (walked once)."""
        if self._hooked[0] is not layout:
            self._hooked = (layout, hookable_units(layout, module))
        return self._hooked[1]
