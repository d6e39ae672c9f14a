"""Gradient accumulation, local (no_sync) and sharded, against one process on everything."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.support import Case, cases, counting, make_optimizer, mlp_loss, run, train_reference

K = 3  # micro-batches per step


def micro_batches(case: Case, t: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s share of step `t`'s global batch, cut into K equal micro-batches."""
    per_rank = case.xs.shape[1] // case.world_size
    x = case.xs[t, rank * per_rank : (rank + 1) * per_rank]
    y = case.ys[t, rank * per_rank : (rank + 1) * per_rank]
    return list(zip(x.chunk(K), y.chunk(K)))


def train(mesh: fzero.Mesh, case: Case, mode: str) -> tuple[Any, list[int]]:
    opt = make_optimizer(case.optimizer)
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, layout=case.layout)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=case.stage, accumulate=mode)
    # gradient elements reduced, per collective
    with counting(
        ("reduce_scatter_mean", "reduce_scatter_async", "all_reduce_mean", "all_reduce_async")
    ) as reductions:
        for t in range(case.xs.shape[0]):
            state, _ = step(state, micro_batches(case, t, mesh.rank))
    return fzero.gather_params(state.params, mesh), reductions


@st.composite
def accumulation_cases(draw: Any) -> Case:
    case = draw(
        cases(
            world_sizes=st.integers(1, 4),
            optimizers=st.sampled_from(["sgd", "momentum", "adam", "adamw", "torch_rmsprop"]),
        )
    )
    # K micro-batches of 1-2 examples per rank: regenerate the data at that size.
    micro = draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    steps, d_in, d_out = case.xs.shape[0], case.xs.shape[2], case.ys.shape[2]
    case.xs = torch.randn(
        steps, case.world_size * K * micro, d_in, generator=g, dtype=torch.float64
    )
    case.ys = torch.randn(
        steps, case.world_size * K * micro, d_out, generator=g, dtype=torch.float64
    )
    return case


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=16)
@given(accumulation_cases(), st.sampled_from(["local", "sharded"]))
def test_accumulation_matches_single_process_on_the_whole_batch(case: Case, mode: str) -> None:
    expected = train_reference(case)  # one step per global batch: all ranks, all micro-batches
    for rank, (params, _) in enumerate(run(case.world_size, train, case, mode)):
        fzero.assert_trees_close(
            params, expected, rtol=1e-10, atol=1e-12, what=f"{mode} stage {case.stage} rank {rank}"
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_local_accumulation_reduces_once_per_step_and_sharded_every_micro_batch(stage: int) -> None:
    g = torch.Generator().manual_seed(0)
    from tests.support import make_params

    case = Case(
        make_params([3, 4, 2], torch.float64, 1),
        torch.randn(2, 2 * K, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 2 * K, 2, generator=g, dtype=torch.float64),
        world_size=2,
        optimizer="adam",
        stage=stage,
    )
    local = run(2, train, case, "local")
    sharded = run(2, train, case, "sharded")
    for (p_local, r_local), (p_sharded, r_sharded) in zip(local, sharded):
        fzero.assert_trees_close(p_local, p_sharded, rtol=1e-12, atol=1e-14)
        steps = case.xs.shape[0]
        assert len(r_local) == steps  # one bucket, one reduction, after the last micro-batch
        assert len(r_sharded) == steps * K
        assert sum(r_sharded) == K * sum(r_local)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_one_rank_stage_0_accumulates_like_one_process(mode: str) -> None:
    # One rank at stage 0 differentiates by leaf (no units, no flat gradients): its own
    # path, checked here every run rather than whenever hypothesis draws it.
    from tests.support import make_params

    g = torch.Generator().manual_seed(1)
    case = Case(
        make_params([3, 5, 2], torch.float64, 2),
        torch.randn(3, K * 2, 3, generator=g, dtype=torch.float64),
        torch.randn(3, K * 2, 2, generator=g, dtype=torch.float64),
        world_size=1,
        optimizer="adam",
        stage=0,
    )
    ((params, reductions),) = run(1, train, case, mode)
    fzero.assert_trees_close(params, train_reference(case), rtol=1e-12, atol=1e-14)
    assert reductions == []  # one rank: nothing to communicate


@pytest.mark.multiprocess
def test_accumulate_wants_a_list_of_micro_batches() -> None:
    from tests.support import make_params

    params = make_params([2, 2], torch.float64, 0)

    def fn(mesh: fzero.Mesh, batch: Any) -> None:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=0)
        fzero.sharded_step(mlp_loss, opt, mesh, stage=0, accumulate="local")(state, batch)

    with pytest.raises(TypeError, match="non-empty list of micro-batches, got list"):
        run(1, fn, [])
    # One micro-batch's (x, y), which read as two micro-batches x and y would run here.
    xy = (torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"got tuple \(a tuple reads as one micro-batch"):
        run(1, fn, xy)
    with pytest.raises(ValueError, match="accumulate must be"):
        fzero.sharded_step(mlp_loss, fzero.optim.sgd(), None, stage=0, accumulate="ddp")


def train_units(mesh: fzero.Mesh, case: dict, stage: int, mode: str) -> Any:
    from torch.func import functional_call

    model = case["model"]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    opt = fzero.optim.adam(lr=0.05)
    units = [f"layers.{i}" for i in range(len(model.layers))] + ["unused"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model, accumulate=mode)
    per_rank = case["xs"].shape[1] // mesh.size
    for t in range(case["xs"].shape[0]):
        sl = slice(mesh.rank * per_rank, (mesh.rank + 1) * per_rank)
        state, _ = step(state, list(zip(case["xs"][t, sl].chunk(K), case["ys"][t, sl].chunk(K))))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("mode", ["local", "sharded"])
def test_accumulation_with_just_in_time_units(stage: int, mode: str) -> None:
    from tests.engine.test_units import make_case, reference

    case = make_case([3, 4, 4, 4, 2], 2, seed=11, twice=1, remat=2)
    g = torch.Generator().manual_seed(3)
    case["xs"] = torch.randn(2, 2 * K * 2, 3, generator=g, dtype=torch.float64)
    case["ys"] = torch.randn(2, 2 * K * 2, 2, generator=g, dtype=torch.float64)
    expected = reference(case)
    for params in run(2, train_units, case, stage, mode):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{mode}")
