"""Every stage, layout and optimizer trains exactly like one process on the whole batch."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.support import (
    OPTIMIZERS,
    Case,
    cases,
    make_params,
    run,
    tolerance,
    train_fzero,
    train_reference,
)


@pytest.mark.slow
@pytest.mark.multiprocess
@given(cases())
def test_every_stage_matches_single_process_float64(case: Case) -> None:
    expected = train_reference(case)
    for rank, (params, _) in enumerate(run(case.world_size, train_fzero, case)):
        fzero.assert_trees_close(
            params,
            expected,
            **tolerance(torch.float64),
            what=f"stage {case.stage} {case.layout} {case.optimizer} rank {rank}",
        )


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=6)
@given(cases(dtype=torch.float32, world_sizes=st.sampled_from([2, 3, 5])))
def test_every_stage_matches_single_process_float32(case: Case) -> None:
    expected = train_reference(case)
    params, _ = run(case.world_size, train_fzero, case)[0]
    fzero.assert_trees_close(
        params, expected, **tolerance(torch.float32), what=f"stage {case.stage}"
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=6)
@given(cases(stages=st.just(0)), st.sampled_from(["flat", "tensor"]))
def test_all_stages_agree_with_each_other(case: Case, layout: str) -> None:
    # One simulate call runs all four stages back to back on the same ranks.
    def all_stages(mesh: fzero.Mesh) -> list:
        out = []
        for stage in range(4):
            case.stage, case.layout = stage, layout
            out.append(train_fzero(mesh, case))
        return out

    per_rank = run(case.world_size, all_stages)
    for rank, results in enumerate(per_rank):
        (p0, l0) = results[0]
        for stage, (p, losses) in enumerate(results[1:], start=1):
            fzero.assert_trees_close(
                p, p0, rtol=1e-12, atol=1e-14, what=f"stage {stage} vs 0, rank {rank}"
            )
            assert losses == l0, f"stage {stage} losses differ from stage 0 on rank {rank}"


def _adafactor_case(layout: str) -> Case:
    g = torch.Generator().manual_seed(3)
    params = make_params([4, 6, 5, 3], torch.float64, seed=11)
    xs = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    ys = torch.randn(3, 6, 3, generator=g, dtype=torch.float64)
    return Case(params, xs, ys, world_size=3, optimizer="torch_adafactor", stage=2, layout=layout)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_layout_makes_per_tensor_optimizers_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registered for this test only: `cases()` draws from the registry.
    monkeypatch.setitem(OPTIMIZERS, "torch_adafactor", (None, torch.optim.Adafactor, {"lr": 0.01}))
    case = _adafactor_case("tensor")
    expected = train_reference(case)
    for stage in (1, 2, 3):
        case.stage = stage
        params, _ = run(3, train_fzero, case)[0]
        fzero.assert_trees_close(
            params, expected, **tolerance(torch.float64), what=f"stage {stage}"
        )


@pytest.mark.multiprocess
def test_flat_layout_refuses_per_tensor_optimizers_whose_slices_train_differently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Adafactor factors each 2-D matrix's second moment by rows and columns, and a rank
    # holding a 1-D slice of the flattened matrix cannot: shard_state refuses it. The same
    # Adafactor told it is elementwise trains, and lands away from torch: the refusal
    # guards a real difference.
    monkeypatch.setitem(OPTIMIZERS, "torch_adafactor", (None, torch.optim.Adafactor, {"lr": 0.01}))
    case = _adafactor_case("flat")
    with pytest.raises(ValueError, match=r"from_torch\(Adafactor\) .*layout='tensor'"):
        run(3, train_fzero, case)

    def as_if_elementwise(**kwargs: Any) -> fzero.optim.Optimizer:
        return fzero.optim.from_torch(torch.optim.Adafactor, **kwargs)._replace(whole_tensors=None)

    unchecked = (as_if_elementwise, torch.optim.Adafactor, {"lr": 0.01})
    monkeypatch.setitem(OPTIMIZERS, "adafactor_unchecked", unchecked)
    case.optimizer = "adafactor_unchecked"
    params, _ = run(3, train_fzero, case)[0]
    assert fzero._core._tree.max_abs_diff(params, train_reference(case)) > 1e-6


@pytest.mark.multiprocess
def test_losses_are_each_ranks_own_micro_batch_loss() -> None:
    case = Case(
        make_params([3, 2], torch.float64, 0),
        torch.randn(2, 4, 3, dtype=torch.float64),
        torch.randn(2, 4, 2, dtype=torch.float64),
        world_size=2,
        optimizer="sgd",
        stage=3,
    )
    from tests.support import mlp_loss

    results = run(2, train_fzero, case)
    for rank, (_, losses) in enumerate(results):
        first = mlp_loss(case.params, case.micro_batch(0, rank)).item()
        assert abs(losses[0] - first) < 1e-12
