"""fzero.gathered: units entering a pure loss just in time, against one process."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.support import (
    Case,
    dims_and_units,
    make_optimizer,
    make_params,
    mlp_loss,
    run,
    tolerance,
    train_reference,
)


def gathered_mlp_loss(params: dict[str, Any], batch: tuple) -> torch.Tensor:
    """support.mlp_loss, written the JAX way: each layer's parameters asked for where used."""
    x, y = batch
    h = x
    for i in range(len(params["layers"])):
        layer = fzero.gathered(params, f"layers.{i}")
        h = torch.tanh(h @ layer["w"] + layer["b"])
    out = h * params["scale"] + params["shift"]
    return ((out - y) ** 2).mean()


def train(mesh: fzero.Mesh, case: Case, units: list[str], **options: Any) -> Any:
    opt = make_optimizer(case.optimizer)
    state = fzero.shard_state(
        case.params, opt, mesh, stage=case.stage, layout=case.layout, units=units
    )
    step = fzero.sharded_step(gathered_mlp_loss, opt, mesh, stage=case.stage, **options)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
    return fzero.gather_params(state.params, mesh)


def make_case(dims: list[int], n: int, stage: int, layout: str, seed: int) -> Case:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(3, 2 * n, dims[0], generator=g, dtype=torch.float64)
    ys = torch.randn(3, 2 * n, dims[-1], generator=g, dtype=torch.float64)
    return Case(make_params(dims, torch.float64, seed), xs, ys, n, "adam", stage, layout)


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=24)
@given(
    dims_and_units(),
    st.integers(1, 4),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["flat", "tensor"]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_a_pure_loss_asking_for_its_units_trains_like_one_process(
    dims_units: tuple, n: int, stage: int, layout: str, jit: bool, reshard: bool, prefetch: bool
) -> None:
    # Any subset of the layers as units (the rest, with the scale and shift, is the root);
    # the reference runs the same loss on plain tensors, where gathered is the identity.
    dims, units = dims_units
    case = make_case(dims, n, stage, layout, seed=len(dims) + n)
    expected = train_reference(case)
    assert not torch.equal(expected["layers"][0]["w"], case.params["layers"][0]["w"])
    options = {"just_in_time": jit, "reshard_after_forward": reshard, "prefetch": prefetch}
    for params in run(n, train, case, units, **options):
        what = f"stage {stage} units {units} {options}"
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64), what=what)


def test_the_reference_loss_is_the_same_function() -> None:
    # Outside a step gathered returns the part of the tree: the two losses agree.
    params = make_params([3, 4, 2], torch.float64, seed=0)
    batch = (torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64))
    assert torch.equal(gathered_mlp_loss(params, batch), mlp_loss(params, batch))
    got = fzero.gathered(params, "layers.1")
    assert got.keys() == {"w", "b"} and all(got[k] is params["layers"][1][k] for k in got)
    flat = {"a.weight": torch.zeros(2), "a.bias": torch.ones(1), "b": torch.zeros(())}
    assert set(fzero.gathered(flat, "a")) == {"weight", "bias"}
    with pytest.raises(ValueError, match="no leaf"):
        fzero.gathered(flat, "c")


def _stage3_step(mesh: fzero.Mesh, loss_fn: Any, units: list[str]) -> Any:
    case = make_case([3, 4, 4, 2], mesh.size, 3, "flat", seed=1)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(case.params, opt, mesh, stage=3, units=units)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, just_in_time=True)
    return step(state, case.micro_batch(0, mesh.rank))


def _uses_a_leaf_directly(params: dict, batch: tuple) -> torch.Tensor:
    return gathered_mlp_loss(params, batch) + params["layers"][1]["w"].sum()


@pytest.mark.multiprocess
def test_a_just_in_time_leaf_used_without_gathered_fails_clearly() -> None:
    named = r"'layers.1.w' of the just-in-time unit 'layers.1' .*\.gathered\(params, 'layers.1'\)"
    with pytest.raises(ValueError, match=named):
        run(2, _stage3_step, _uses_a_leaf_directly, ["layers.0", "layers.1"])


def _asks_inside_a_unit(params: dict, batch: tuple) -> torch.Tensor:
    x, _ = batch
    w = fzero.gathered(params, "layers.0.w")  # the unit is "layers.0"
    return (x @ w).sum()


@pytest.mark.multiprocess
def test_a_path_inside_a_just_in_time_unit_is_refused() -> None:
    inside = r"'layers\.0\.w' is only part of the just-in-time unit 'layers\.0'"
    with pytest.raises(ValueError, match=inside):
        run(2, _stage3_step, _asks_inside_a_unit, ["layers.0"])


def _whole_stack(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    for layer in fzero.gathered(params, "layers"):  # one call enters every unit under it
        x = torch.tanh(x @ layer["w"] + layer["b"])
    out = x * params["scale"] + params["shift"]
    return ((out - y) ** 2).mean()


def _train_whole(mesh: fzero.Mesh, case: Case) -> Any:
    opt = make_optimizer(case.optimizer)
    units = [f"layers.{i}" for i in range(3)]
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, units=units)
    step = fzero.sharded_step(_whole_stack, opt, mesh, stage=case.stage, just_in_time=True)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_asking_for_a_node_of_several_units_enters_each(stage: int) -> None:
    case = make_case([3, 4, 4, 2], 3, stage, "flat", seed=4)
    expected = train_reference(case)
    for params in run(3, _train_whole, case):
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64))


def _one_unit(mesh: fzero.Mesh, params: dict) -> Any:
    state = fzero.shard_state(params, fzero.optim.sgd(), mesh, stage=3, units=["layers.1"])
    return fzero.gather_params(state.params, mesh, unit="layers.1")


@pytest.mark.multiprocess
def test_gather_params_of_one_unit_is_its_part_of_the_tree() -> None:
    params = make_params([3, 5, 2, 4], torch.float64, seed=2)
    for got in run(3, _one_unit, params):
        fzero.assert_trees_close(got, params["layers"][1], rtol=0, atol=0)
