"""Ranks in different fzero calls at once (a rank whose data ran out saves while its peers
step; `master_params` under `if rank == 0:`) raise on every rank at once, naming each
rank's call, and the job trains on afterwards exactly like one process."""

from __future__ import annotations

import tempfile
import time
from typing import Any

import pytest
import torch

import fzero
from tests.faults.harness import outcomes, raised_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

D = 6


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(D, D, generator=g, dtype=torch.float64),
        "b": torch.randn(D, generator=g, dtype=torch.float64),
    }


def _batches(steps: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, 2 * world, D, generator=g, dtype=torch.float64)


def train_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"]).square().mean()


def eval_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (x @ p["w"]).abs().mean()


def _reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """One process, torch.optim.AdamW, over the whole batch of each step."""
    params = {k: v.clone().requires_grad_() for k, v in _params().items()}
    opt = torch.optim.AdamW(list(params.values()), lr=0.05, weight_decay=0.1, foreach=False)
    for x in _batches(steps, world):
        opt.zero_grad()
        train_loss(params, x).backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def _diverge(mesh: fzero.Mesh, stage: int, odd: str, folder: str) -> Any:
    """Step 1 on every rank; then rank 1 makes the `odd` call while rank 0 steps; the
    ValueError is caught and every rank steps twice more: the failed call changed
    nothing, so three steps must match torch.optim's."""
    opt = fzero.optim.adamw(lr=0.05, weight_decay=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=stage)
    step = fzero.sharded_step(train_loss, opt, mesh, stage=stage)
    xs = _batches(3, mesh.size)[:, 2 * mesh.rank : 2 * mesh.rank + 2]
    state, _ = step(state, xs[0])
    try:
        if mesh.rank != 1:
            step(state, xs[1])
        elif odd == "save":
            fzero.checkpoint.save(state, folder, mesh)
        elif odd == "master_params":
            fzero.master_params(state, mesh)
        elif odd == "eval step":
            fzero.sharded_step(eval_loss, opt, mesh, stage=stage)(state, xs[1])
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("no error")
    for x in xs[1:]:
        state, _ = step(state, x)
    return message, fzero.master_params(state, mesh)


@pytest.mark.parametrize(
    ("stage", "odd", "named"),
    [
        (0, "save", "rank 1 in checkpoint.save"),
        (3, "save", "rank 1 in checkpoint.save"),
        (3, "master_params", "rank 1 in master_params"),  # stage 3: it gathers
        (0, "eval step", "rank 1 in sharded_step(eval_loss)"),
        (3, "eval step", "rank 1 in sharded_step(eval_loss)"),
    ],
)
def test_different_calls_raise_on_every_rank_and_the_job_goes_on(
    stage: int, odd: str, named: str
) -> None:
    world = 3
    with tempfile.TemporaryDirectory() as folder:
        outs = outcomes(world, _diverge, stage, odd, folder)
    for o in outs:
        assert o.error is None, f"rank {o.rank}: {o.message}"
    messages = {o.value[0] for o in outs}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "different fzero calls" in message
    assert "rank 0 in sharded_step(train_loss)" in message and named in message
    want = _reference(3, world)
    assert not torch.allclose(want["w"], _params()["w"])  # training moved them
    for o in outs:
        for k, v in want.items():
            torch.testing.assert_close(o.value[1][k], v, rtol=1e-10, atol=1e-12)


def _save_on_rank_zero(mesh: fzero.Mesh, folder: str) -> None:
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=2)
    if mesh.rank == 0:  # the DDP habit: torch.save on rank 0 only
        fzero.checkpoint.save(state, folder, mesh)
    fzero.sharded_step(train_loss, opt, mesh, stage=2)(state, _batches(1, mesh.size)[0])


def test_a_save_on_one_rank_raises_on_every_rank_at_once() -> None:
    with tempfile.TemporaryDirectory() as folder:
        outs = outcomes(2, _save_on_rank_zero, folder)
    raised_together(outs, ValueError, "rank 0 in checkpoint.save", "rank 1 in sharded_step")


def _sample_on_rank_zero(mesh: fzero.Mesh, stage: int) -> dict[str, torch.Tensor]:
    opt = fzero.optim.adamw(lr=0.05, weight_decay=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=stage)
    step = fzero.sharded_step(train_loss, opt, mesh, stage=stage)
    forward = fzero.sharded_forward(eval_loss, mesh)
    for k, x in enumerate(_batches(3, mesh.size)):
        state, _ = step(state, x[2 * mesh.rank : 2 * mesh.rank + 2])
        if mesh.rank == 0 and k == 1:  # a forward sends nothing at stages 0-2
            forward(state, x)
    return fzero.master_params(state, mesh)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_forward_on_one_rank_at_stages_0_to_2_is_no_call_to_check(stage: int) -> None:
    want = _reference(3, 2)
    for got in fzero.Simulation(2, collective_timeout=20, timeout=90).run(
        _sample_on_rank_zero, stage
    ):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)


def _sample_then_fail(mesh: fzero.Mesh, stage: int) -> None:
    """Rank 0 samples alone (a forward at stages 0-2 sends nothing); at the next step its
    loss raises: its peers, waiting in that step, must raise it at once."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=stage)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if mesh.rank == 0 and x.shape[0] == 3:
            raise RuntimeError("rank 0's loss failed")
        return train_loss(p, x)

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    state, _ = step(state, _batches(1, mesh.size)[0, :2])
    if mesh.rank == 0:
        fzero.sharded_forward(eval_loss, mesh)(state, _batches(1, 1)[0])
    step(state, _batches(1, mesh.size)[0, :3])


@pytest.mark.parametrize("stage", [0, 2])
def test_a_failure_after_a_forward_one_rank_made_alone_reaches_every_rank_at_once(
    stage: int,
) -> None:
    """The forward has no number of its own (it sends nothing): the failure after it is
    published under the step its peers wait in (it reached them at the collective
    timeout: the ranks' calls were numbered apart; a reader of this stop's diff)."""
    raised_together(outcomes(2, _sample_then_fail, stage), RuntimeError, "rank 0's loss failed")


def _master_params_on_rank_zero(mesh: fzero.Mesh) -> float:
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)
    state, _ = fzero.sharded_step(train_loss, opt, mesh, stage=0)(state, _batches(1, 2)[0])
    start = time.monotonic()
    if mesh.rank == 0:  # the end of a job: stage 0's parameters are on every rank
        fzero.master_params(state, mesh)
    return time.monotonic() - start


def test_master_params_on_one_rank_where_it_sends_nothing_returns_at_once() -> None:
    """At stages 0-2 without sharded masters `master_params` gathers nothing: it is not
    checked, and a rank may call it alone (it waited out the collective timeout for its
    peers' call names; a reader of this stop's diff)."""
    took = fzero.Simulation(2, collective_timeout=20, timeout=90).run(_master_params_on_rank_zero)
    assert max(took) < 5, took
