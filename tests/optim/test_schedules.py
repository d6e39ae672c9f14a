"""Schedules from torch's and Hugging Face's schedulers: the rates a torch loop uses."""

from __future__ import annotations

import functools
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch.optim import lr_scheduler

import fzero
from tests.support import run

F64 = torch.float64
MAKERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "cosine": functools.partial(lr_scheduler.CosineAnnealingLR, T_max=4),
    "step": functools.partial(lr_scheduler.StepLR, step_size=2, gamma=0.3),
    "onecycle": functools.partial(
        lr_scheduler.OneCycleLR, max_lr=0.2, total_steps=7, cycle_momentum=False
    ),
    "sequential": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), lr_scheduler.ExponentialLR(opt, 0.5)],
        milestones=[2],
    ),
    "hf-cosine-warmup": lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 2, 6),
    "hf-get_scheduler": lambda opt: transformers.get_scheduler(
        "linear", opt, num_warmup_steps=1, num_training_steps=6
    ),
}


def torch_training(make: Callable[[torch.optim.Optimizer], Any], steps: int) -> Any:
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=F64, requires_grad=True)
    x = torch.randn(steps, 8, 4, dtype=F64)
    opt = torch.optim.AdamW([w], lr=0.05, weight_decay=0.1)
    scheduler, rates = make(opt), []
    start = w.detach().clone()
    for k in range(steps):
        loss = (x[k] @ w).square().mean()
        opt.zero_grad()
        loss.backward()
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return start, x, w.detach(), rates


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*sorted(MAKERS), "lambda"])
def test_a_torch_scheduler_gives_the_rates_of_a_torch_loop(name: str) -> None:
    steps = 7
    if name == "lambda":
        factor = lambda k: 0.7**k + 0.1 * (k % 2)  # noqa: E731

        def make(opt: torch.optim.Optimizer) -> Any:
            return lr_scheduler.LambdaLR(opt, factor)

        schedule = fzero.optim.lambda_lr(0.05, factor)
    else:
        make = MAKERS[name]
        schedule = fzero.optim.from_torch_scheduler(make, 0.05)
    start, x, want, rates = torch_training(make, steps)
    assert [schedule(k) for k in range(steps)] == rates  # exactly the loop's rates
    assert len(set(rates)) > 2

    def fn(mesh: fzero.Mesh) -> torch.Tensor:
        opt = fzero.optim.adamw(schedule, weight_decay=0.1)
        state = fzero.shard_state({"w": start.clone()}, opt, mesh, stage=2)
        step = fzero.sharded_step(lambda p, b: (b @ p["w"]).square().mean(), opt, mesh, stage=2)
        for k in range(steps):
            state, _ = step(state, x[k, mesh.rank * 4 : (mesh.rank + 1) * 4])
        return state.params["w"]

    for got in run(2, fn):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert not torch.equal(got, start)


def test_a_resumed_run_asks_for_a_late_rate_first() -> None:
    make = MAKERS["hf-cosine-warmup"]
    late = fzero.optim.from_torch_scheduler(make, 0.05)(5)
    assert late == torch_training(make, 6)[3][5]


def test_a_rewound_run_gets_the_loops_rates_and_a_long_one_keeps_no_list_of_them() -> None:
    """A checkpoint reloaded in the same process asks for earlier counts again (torch's
    schedulers only go forward), and a run of millions of updates must not keep every
    rate it used (32 bytes an update: 320 MB at ten million, a long-run reader's find)."""
    make = MAKERS["hf-cosine-warmup"]
    rates = torch_training(make, 8)[3]
    schedule = fzero.optim.from_torch_scheduler(make, 0.05)
    assert [schedule(k) for k in (7, 2, 3, 0, 6, 6, 1)] == [rates[k] for k in (7, 2, 3, 0, 6, 6, 1)]
    warmup = lambda opt: lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 100))  # noqa: E731
    schedule = fzero.optim.from_torch_scheduler(warmup, 0.05)
    tracemalloc.start()
    try:
        for k in range(1000):
            schedule(k)
        before = tracemalloc.get_traced_memory()[0]
        for k in range(1000, 6000):
            schedule(k)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 16_000, grown  # 5000 updates: 160 kB when every rate was kept
    assert schedule(5999) == 0.05


def test_a_metric_or_momentum_scheduler_is_refused() -> None:
    with pytest.raises(TypeError, match="ReduceLROnPlateau steps on a metric"):
        fzero.optim.from_torch_scheduler(lr_scheduler.ReduceLROnPlateau, 0.1)
    cycling = functools.partial(lr_scheduler.OneCycleLR, max_lr=0.2, total_steps=7)
    with pytest.raises(ValueError, match="OneCycleLR schedules the momentum too"):
        fzero.optim.from_torch_scheduler(cycling, 0.1)  # refused when built


def _kind(make: Callable[[torch.optim.Optimizer], Any], lr: float) -> str:
    from fzero._step._config import optimizer_kind

    return optimizer_kind(fzero.optim.adamw(lr=fzero.optim.from_torch_scheduler(make, lr)))


def test_the_ranks_compare_a_torch_schedulers_settings() -> None:
    """Ranks compare their optimizers at a step function's first call; a torch scheduler's
    settings live inside the scheduler object, which was compared by its class alone:
    ranks with other step sizes or base rates trained apart (a second reader's find)."""
    step = MAKERS["step"]
    assert _kind(step, 0.05) == _kind(step, 0.05)  # what two ranks building alike say
    other_size = functools.partial(lr_scheduler.StepLR, step_size=3, gamma=0.3)
    assert "step_size=3" in _kind(other_size, 0.05) and _kind(other_size, 0.05) != _kind(step, 0.05)
    assert _kind(step, 0.05) != _kind(step, 0.1)
    hf = MAKERS["hf-cosine-warmup"]
    longer = lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 2, 60)  # noqa: E731
    assert _kind(hf, 0.05) == _kind(hf, 0.05) and _kind(hf, 0.05) != _kind(longer, 0.05)
    assert "num_training_steps=60" in _kind(longer, 0.05)
    for held in (  # schedulers holding schedulers: their settings are compared too
        lambda g: lambda opt: lr_scheduler.SequentialLR(
            opt,
            [lr_scheduler.LinearLR(opt, 0.1, total_iters=2), lr_scheduler.ExponentialLR(opt, g)],
            milestones=[2],
        ),
        lambda g: lambda opt: lr_scheduler.ChainedScheduler(
            [lr_scheduler.ExponentialLR(opt, g), lr_scheduler.StepLR(opt, 2)]
        ),
    ):  # fmt: skip
        assert _kind(held(0.5), 0.05) == _kind(held(0.5), 0.05)
        assert _kind(held(0.5), 0.05) != _kind(held(0.9), 0.05)


def _steps_with_rank_step_size(mesh: fzero.Mesh) -> None:
    make = functools.partial(lr_scheduler.StepLR, step_size=2 + mesh.rank, gamma=0.3)
    opt = fzero.optim.adamw(lr=fzero.optim.from_torch_scheduler(make, 0.05))
    params = {"w": torch.ones(4, 3, dtype=F64)}
    state = fzero.shard_state(params, opt, mesh, stage=0)
    loss = lambda p, x: (x @ p["w"]).square().mean()  # noqa: E731
    fzero.sharded_step(loss, opt, mesh, stage=0)(state, torch.ones(2, 4, dtype=F64))


@pytest.mark.multiprocess
def test_ranks_whose_schedulers_differ_raise_on_every_rank() -> None:
    with pytest.raises(
        ValueError, match=r"optimizer: rank 0: .*step_size=2.*rank 1: .*step_size=3"
    ):
        run(2, _steps_with_rank_step_size)
