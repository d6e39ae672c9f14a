"""Ranks in different fzero calls at once (a rank whose data ran out saves while its peers
step; `master_params` under `if rank == 0:`) raise on every rank at once, naming each
rank's call, and the job trains on afterwards exactly like one process."""

from __future__ import annotations

import contextlib
import tempfile
import time
from typing import Any

import pytest
import torch

import fzero
from tests.faults.harness import outcomes, raised_together, tiny_params

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

D = 6


def _params() -> dict[str, torch.Tensor]:
    return tiny_params(D)


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
    assert "rank 0 in sharded_step" in message and named in message
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


def _same_forward_mistake_then_step(mesh: fzero.Mesh, stage: int, skew: float) -> Any:
    """Every rank's forward at stages 0-2 raises alike (a batch of the wrong width) and is
    caught; one rank comes to the next step late: the job must go on."""
    opt = fzero.optim.adamw(lr=0.05, weight_decay=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=stage)
    step = fzero.sharded_step(train_loss, opt, mesh, stage=stage)
    xs = _batches(3, mesh.size)[:, 2 * mesh.rank : 2 * mesh.rank + 2]
    state, _ = step(state, xs[0])
    with contextlib.suppress(RuntimeError):  # the mistake, caught on every rank
        fzero.sharded_forward(eval_loss, mesh)(state, torch.ones(2, D + 1, dtype=torch.float64))
    time.sleep(skew * mesh.rank)
    for x in xs[1:]:
        state, _ = step(state, x)
    return fzero.master_params(state, mesh)


@pytest.mark.parametrize("stage", [0, 2])
def test_the_same_forward_mistake_on_every_rank_leaves_the_job_usable(stage: int) -> None:
    """A forward that sends nothing numbers between two calls that do: its failures, on
    every rank alike, are not the next step's (every rank raised the first forward's error
    there when one came late; a reader of this stop's diff)."""
    want = _reference(3, 2)
    for got in fzero.Simulation(2, collective_timeout=20, timeout=90).run(
        _same_forward_mistake_then_step, stage, 1.0
    ):
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12)


def _flip_alone_or_nested(mesh: fzero.Mesh, nested: bool) -> str:
    """A module= parameter frozen after the first step, at world size 1 or in a step inside
    a stage-3 `bind` block (whose name check the step does not repeat)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, 2))
    model = model.double()
    opt = fzero.optim.sgd(lr=0.1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fzero.shard_state(params, opt, mesh, stage=3)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model)
    x = torch.ones(2, D, dtype=torch.float64)
    state, _ = step(state, x)
    model[0].weight.requires_grad_(False)
    try:
        if nested:
            with fzero.bind(model, state, mesh):
                step(state, x)
        else:
            step(state, x)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("world", "nested"), [(1, False), (2, True)])
def test_a_flip_is_refused_alone_and_inside_another_call(world: int, nested: bool) -> None:
    """The refusal travels with the call's name check, which a one-rank mesh and a call
    inside another skip: it was dropped there, and the frozen weight trained on."""
    for said in fzero.Simulation(world, collective_timeout=20, timeout=90).run(
        _flip_alone_or_nested, nested
    ):
        assert "module='s parameter '0.weight' was frozen" in said, said


def _raising_at_three(error: BaseException) -> Any:
    """`train_loss`, raising `error` on a batch of three rows (a step given one fails)."""

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise error
        return train_loss(p, x)

    return loss_fn


def _fails_while_its_peer_is_elsewhere(mesh: fzero.Mesh) -> tuple[str, float]:
    from fzero._comm import _calls

    _calls._EXIT_WAIT = 2.0  # how long the failing call waits: shortened for the test
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)

    loss_fn = _raising_at_three(ValueError("rank 0's own loss bug"))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=0)
    state, _ = step(state, _batches(1, 2)[0, :2])
    if mesh.rank == 1:  # busy with work of its own, in no fzero call
        time.sleep(8)
        return "", 0.0
    start = time.monotonic()
    try:  # a later step: no exchange before the forward, where the loss raises
        step(state, _batches(1, 2)[0, :3])
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "no error", 0.0


def test_a_failing_call_raises_its_own_error_when_no_peer_comes() -> None:
    """The call's unchecked name exchange is waited for a bounded while as it fails: its
    own error then goes on (it became the process group's timeout after 30 min under
    torch's default, 20 s here; a reader of this stop's diff)."""
    said, took = fzero.Simulation(2, collective_timeout=20, timeout=90).run(
        _fails_while_its_peer_is_elsewhere
    )[0]
    assert said == "ValueError: rank 0's own loss bug", said
    assert took < 6, took


def _alike_then_alone(mesh: fzero.Mesh) -> None:
    """Every rank's stage-0 forward raises alike (caught: usable); the next forward, with
    no call that sends between them, raises on rank 0 alone, which then stops."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)
    step = fzero.sharded_step(train_loss, opt, mesh, stage=0)
    forward = fzero.sharded_forward(eval_loss, mesh)
    state, _ = step(state, _batches(1, 2)[0, :2])
    with contextlib.suppress(RuntimeError):
        forward(state, torch.ones(2, D + 1, dtype=torch.float64))
    forward(state, torch.ones(2, D + (mesh.rank == 0), dtype=torch.float64))
    step(state, _batches(1, 2)[0, :2])


def test_a_lone_failure_after_one_every_rank_made_alike_is_not_taken_for_it() -> None:
    """Each call that sends nothing between two that do is counted afresh: the second
    forward's lone failure was taken for the first's, which every rank had made (its
    peer waited for the timeout; a reader of this stop's diff)."""
    raised_together(outcomes(2, _alike_then_alone), RuntimeError, "mat1 and mat2 shapes")


def _own_bug_while_peer_saves(mesh: fzero.Mesh, folder: str) -> str:
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)

    loss_fn = _raising_at_three(ValueError("rank 0's own loss bug"))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=0)
    state, _ = step(state, _batches(1, 2)[0, :2])
    try:
        if mesh.rank == 0:
            step(state, _batches(1, 2)[0, :3])
        else:
            fzero.checkpoint.save(state, folder, mesh)
    except ValueError as exc:
        said = str(exc)
    state, _ = step(state, _batches(1, 2)[0, :2])  # usable: nothing was pending
    return said


def test_a_rank_failing_in_a_call_its_peers_are_not_in_raises_what_they_raise() -> None:
    """Its own error would differ from its peers' (and it was published, failing the job):
    the exchange says the ranks are in different calls, and that is what every rank
    raises (a reader of this stop's diff)."""
    with tempfile.TemporaryDirectory() as folder:
        said = fzero.Simulation(2, collective_timeout=20, timeout=90).run(
            _own_bug_while_peer_saves, folder
        )
    assert said[0] == said[1] and "rank 1 in checkpoint.save" in said[0], said


def _interrupted_at_other_points(mesh: fzero.Mesh, folder: str) -> float:
    """Ctrl-C reaches rank 0 in a forward, rank 1 in the next step's loss; each handler
    saves: the save must raise at once (the job has failed) on both."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)

    loss_fn = _raising_at_three(KeyboardInterrupt)

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=0)
    state, _ = step(state, _batches(1, 2)[0, :2])
    try:
        if mesh.rank == 0:
            fzero.sharded_forward(loss_fn, mesh)(state, _batches(1, 2)[0, :3])
        else:
            step(state, _batches(1, 2)[0, :3])
    except KeyboardInterrupt:
        start = time.monotonic()
        with contextlib.suppress(fzero.PeerError):
            fzero.checkpoint.save(state, folder, mesh)
        return time.monotonic() - start
    return -1.0


def test_a_ctrl_c_reaching_ranks_at_other_points_fails_their_saves_at_once() -> None:
    """The rank interrupted outside any collective waited 60 s before its save raised:
    it settled on its peers' counts, not on the failure they had published."""
    with tempfile.TemporaryDirectory() as folder:
        took = fzero.Simulation(2, collective_timeout=20, timeout=120).run(
            _interrupted_at_other_points, folder
        )
    assert all(0 <= t < 5 for t in took), took
