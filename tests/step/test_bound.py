"""A step inside a `fzero.bind` block: refused over its own model or state on every rank
(it would run inside bind's forward), allowed beside a bound teacher."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import errors_on_every_rank, run

F64 = torch.float64


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=F64, generator=torch.Generator().manual_seed(rank))


def step_inside(mesh: fzero.Mesh, stage: int, hooks: bool) -> None:
    model = net(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["0"])

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model if hooks else None)
    with fzero.bind(model, state, mesh):
        step(state, batch(mesh.rank))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "hooks"), [(0, False), (3, False), (3, True)])
def test_a_step_inside_a_bind_of_its_own_model_or_state_is_refused_on_every_rank(
    stage: int, hooks: bool
) -> None:
    # At stage 3 bind's hooks handed the loss units without a gradient (their weights
    # never moved); at stages 0-2 the update wrote bind's tensors, and leaving the block
    # said the loss had written a parameter in place.
    for said in errors_on_every_rank(2, lambda mesh: step_inside(mesh, stage, hooks)):
        assert said.startswith("ValueError: fzero: rank "), said
        if hooks:
            assert "inside a `with fzero.bind(...)` block over its own model and state" in said
        else:  # without module=, what the loss runs cannot be told: refused as such
            assert "sharded_step without module= inside a `with fzero.bind" in said, said


def step_beside_its_average(mesh: fzero.Mesh, stage: int) -> None:
    """A step without module= inside a bind of the same model holding another state (a
    moving average's): its loss ran on the average's weights, a third of the loss off."""
    model = net(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["0"])
    average = fzero.shard_state({k: v * 0.5 for k, v in params.items()}, opt, mesh, stage=stage)

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    with fzero.bind(model, average, mesh):
        step(state, batch(mesh.rank))


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_without_module_inside_a_bind_of_another_state_is_refused(stage: int) -> None:
    for said in errors_on_every_rank(2, lambda mesh: step_beside_its_average(mesh, stage)):
        assert "sharded_step without module= inside a `with fzero.bind" in said, said


def distil(mesh: fzero.Mesh, stage: int) -> dict[str, torch.Tensor]:
    """A student stepped at `stage` inside a bind of a sharded teacher, its target."""
    teacher, student = net(1), net(0)
    opt = fzero.optim.sgd(lr=0.1)
    taught = fzero.shard_state(
        {k: v.detach().clone() for k, v in teacher.named_parameters()},
        opt, mesh, stage=3, units=["0", "2"],
    )  # fmt: skip
    params = {k: v.detach().clone() for k, v in student.named_parameters()}
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["0"])

    def loss_fn(p: dict, xy: Any) -> torch.Tensor:
        x, y = xy
        return (functional_call(student, p, (x,)) - y).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=student)
    with fzero.bind(teacher, taught, mesh) as bound:
        for _ in range(3):
            x = batch(mesh.rank)
            state, _ = step(state, (x, bound(x)))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_student_steps_inside_a_bind_of_its_teacher_like_torch_optim(stage: int) -> None:
    teacher, student = net(1), net(0)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    x = torch.cat([batch(0), batch(1)])
    for _ in range(3):
        opt.zero_grad()
        with torch.no_grad():
            y = teacher(x)
        (student(x) - y).square().mean().backward()
        opt.step()
    want = {k: v.detach() for k, v in student.named_parameters()}
    assert not torch.equal(want["0.weight"], net(0)[0].weight)
    for got in run(2, distil, stage):
        fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-14, what=f"stage {stage}")


def apart(mesh: fzero.Mesh, how: str) -> str:
    """Rank 0 calls the model twice, rank 1 once: inside `bind`, or `sharded_forward`."""
    model = net(0)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=["0", "2"])
    x = batch(mesh.rank)
    try:
        if how == "bind":
            with fzero.bind(model, state, mesh) as bound:
                for _ in range(2 - mesh.rank):
                    bound(x)
        else:
            forward = fzero.sharded_forward(
                lambda p, x: functional_call(model, p, (x,)), mesh, module=model
            )
            for _ in range(2 - mesh.rank):
                forward(state, x)
    except RuntimeError as exc:
        return str(exc)
    return "returned"  # sharded_forward's rank 1: it makes no later fzero call to fail


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["bind", "forward"])
def test_ranks_calling_the_model_apart_are_told_why_the_gather_timed_out(how: str) -> None:
    # gloo said only "Timed out waiting 3000ms for send operation to complete".
    said = fzero.Simulation(2, collective_timeout=3, timeout=60).run(apart, how)
    told = [s for s in said if "a collective failed or timed out" in s]
    assert told and all("Usually a peer stopped calling" in s for s in told), said
    why = "synced_gpus=True" if how == "bind" else "forward(state, None)"
    assert all(why in s for s in told), said
