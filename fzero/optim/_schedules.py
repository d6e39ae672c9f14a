"""Learning-rate schedules from torch's and Hugging Face's schedulers, for `lr=`."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ._base import Schedule


def lambda_lr(lr: float, lr_lambda: Callable[[int], float]) -> Schedule:
    """torch's `LambdaLR` as a schedule: update k uses `lr * lr_lambda(k)`.

    torch's convention: `LambdaLR(opt, f)` sets the rate to `lr * f(0)` when it is built,
    and each `scheduler.step()` after `optimizer.step()` moves it to the next `f(k)`, so
    the k-th update (0-based) uses `f(k)`; fzero calls `lr=` schedules with that k.

    Args:
      lr: the base learning rate (the optimizer's `lr` in torch).
      lr_lambda: the multiplicative factor per update index, as given to `LambdaLR`.

    Returns:
      A schedule `count -> lr` for an fzero optimizer's `lr=`.
    """
    if not callable(lr_lambda):
        raise TypeError(f"lambda_lr needs a function of the step index, got {lr_lambda!r}")
    base = float(lr)
    return lambda count: base * lr_lambda(count)


def from_torch_scheduler(make: Callable[[torch.optim.Optimizer], Any], lr: float) -> Schedule:
    """Any torch `LRScheduler` (or Hugging Face's, e.g. `get_scheduler("cosine", ...)`) as a
    schedule, with torch's step-count convention.

    `make(optimizer)` builds the scheduler on a stand-in optimizer (one parameter, no
    memory to speak of) whose rate starts at `lr`; the rate of update k is the one the
    stand-in holds after k calls of `scheduler.step()`, which is what a torch loop
    stepping the scheduler after each `optimizer.step()` uses for its k-th update. Rates
    are computed in order and only the last few kept (a run of millions of updates holds
    no list of them), so a resumed run asking for update 5000 first steps the stand-in
    5000 times (microseconds each), and one rewound to an earlier count (a checkpoint
    reloaded in the same process) replays a fresh stand-in from the start.

    Args:
      make: `optimizer -> scheduler`, e.g. `lambda opt: CosineAnnealingLR(opt, T_max=100)`
        or `lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 10, 100)`.
        Schedulers that step on a metric (`ReduceLROnPlateau`) are not schedules of the
        step index and are refused, and so are those that schedule the momentum too
        (`OneCycleLR`, `CyclicLR` unless built with `cycle_momentum=False`).
      lr: the base learning rate (the optimizer's `lr` in torch).

    Returns:
      A schedule `count -> lr` for an fzero optimizer's `lr=`.
    """
    replay = _Replay(make, float(lr))
    scheduler = replay.scheduler

    def schedule(count: int) -> float:
        return replay.rate(count)

    # What ranks compare at a step function's first call (`_step._config`): the base rate
    # and the scheduler's settings, which the closure holds only inside the scheduler.
    schedule.fzero_description = (  # type: ignore[attr-defined]
        f"fzero.optim.from_torch_scheduler(lr={float(lr)!r}, {_settings(scheduler)})"
    )
    return schedule


class _Replay:
    """A torch scheduler stepped on a stand-in optimizer, rate by rate: the rate of each
    update count, the last `_KEPT` of them remembered (a compiled update and the
    unscaled one may ask for a count twice), an earlier one replayed from a fresh stand-in.
    """

    _KEPT = 8

    def __init__(self, make: Callable[[torch.optim.Optimizer], Any], lr: float) -> None:
        self.make, self.lr = make, lr
        self.start()

    def start(self) -> None:
        """A fresh stand-in (one parameter, no memory to speak of) and its scheduler."""
        stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.lr)
        self.momentum = stand_in.param_groups[0]["momentum"]  # before: OneCycleLR sets it
        self.scheduler = self.make(stand_in)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "from_torch_scheduler: ReduceLROnPlateau steps on a metric, not the step "
                "index; reduce the rate yourself (a new optimizer closure) when the metric "
                "stalls"
            )
        if not hasattr(self.scheduler, "step"):
            raise TypeError(f"from_torch_scheduler: make(optimizer) returned {self.scheduler!r}")
        self.group = stand_in.param_groups[0]
        self.at = 0  # the update count whose rate the stand-in holds
        self.recent = {0: float(self.group["lr"])}
        self.check()

    def check(self) -> None:
        if self.group.get("momentum") != self.momentum:
            raise ValueError(
                f"from_torch_scheduler: {type(self.scheduler).__name__} schedules the "
                "momentum too (cycle_momentum=True), which an fzero optimizer's fixed betas "
                "cannot follow: build it with cycle_momentum=False"
            )

    def rate(self, count: int) -> float:
        """The rate of update `count` (0-based), as a torch loop would use it."""
        count = int(count)
        if count < 0:
            raise ValueError(f"from_torch_scheduler: no rate for update count {count}")
        if count in self.recent:
            return self.recent[count]
        if count < self.at:  # rewound (a checkpoint reloaded): torch schedulers go forward only
            self.start()
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            while self.at < count:
                self.scheduler.step()
                self.at += 1
                self.check()
                self.recent[self.at] = float(self.group["lr"])
                self.recent.pop(self.at - self._KEPT, None)
        return self.recent[count]


def _settings(scheduler: Any) -> str:
    """A scheduler's class and its plain settings, as every rank building the same one
    writes them: numbers and names from its state (not the step it is at), its lambdas
    by name with a `functools.partial`'s arguments (Hugging Face's schedules), and the
    schedulers it holds (SequentialLR's, ChainedScheduler's), each so."""
    moving = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial"}
    items = []
    for k, v in sorted(scheduler.state_dict().items()):
        if k in moving or k == "_schedulers":  # SequentialLR's, ChainedScheduler's: below
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            items.append(f"{k}={v!r}")
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            items.append(f"{k}={tuple(v)!r}")
    for fn in getattr(scheduler, "lr_lambdas", ()):
        inner = fn.func if isinstance(fn, functools.partial) else fn
        args = sorted(fn.keywords.items()) if isinstance(fn, functools.partial) else []
        name = getattr(inner, "__qualname__", type(inner).__name__)
        items.append(f"{name}({', '.join(f'{k}={v!r}' for k, v in args)})")
    items += [_settings(inner) for inner in getattr(scheduler, "_schedulers", ())]
    return f"{type(scheduler).__qualname__}({', '.join(items)})"
