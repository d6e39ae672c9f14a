"""Units of several submodules (FSDP2's `fully_shard([m1, m2])`), against one process."""

import tempfile
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fzero
from fzero._core._layout import build_layout
from tests.checkpoint import test_checkpoint
from tests.engine import test_gathered, test_units
from tests.support import (
    Case,
    counting,
    errors_on_every_rank,
    make_optimizer,
    make_params,
    run,
    tolerance,
    train_reference,
)

F64 = torch.float64


def layer_groups(n_layers: int) -> Any:
    """Units for an MLP's layers (`test_units.unit_splits` without the Net's unused layer
    or the whole stack), every unit a tuple of its layers' paths."""
    return test_units.unit_splits(n_layers, unused=False).map(
        lambda units: [u if isinstance(u, tuple) else (u,) for u in units]
    )


def grouped_loss(groups: list[tuple[str, ...]]) -> Any:
    """support.mlp_loss written the JAX way over grouped units: the first layer of a group
    to run asks for the whole group, with the tuple of its paths."""

    def loss_fn(params: dict[str, Any], batch: tuple) -> torch.Tensor:
        x, y = batch
        entered: dict[str, Any] = {}
        for i in range(len(params["layers"])):
            path = f"layers.{i}"
            group = next((g for g in groups if path in g), (path,))
            if path not in entered:
                entered.update(zip(group, fzero.gathered(params, group), strict=True))
            layer = entered[path]
            x = torch.tanh(x @ layer["w"] + layer["b"])
        out = x * params["scale"] + params["shift"]
        return ((out - y) ** 2).mean()

    return loss_fn


def train_pure(mesh: fzero.Mesh, case: Case, groups: list, **options: Any) -> Any:
    opt = make_optimizer(case.optimizer)
    units = [g[0] if len(g) == 1 else g for g in groups]
    state = fzero.shard_state(
        case.params, opt, mesh, stage=case.stage, layout=case.layout, units=units
    )
    step = fzero.sharded_step(grouped_loss(groups), opt, mesh, stage=case.stage, **options)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=24)
@given(
    st.lists(st.integers(1, 5), min_size=2, max_size=5).flatmap(
        lambda dims: st.tuples(st.just(dims), layer_groups(len(dims) - 1))
    ),
    st.integers(1, 4),
    st.sampled_from([0, 1, 2, 3]),
    st.sampled_from(["flat", "tensor"]),
    st.booleans(),
    st.booleans(),
)
def test_a_pure_loss_asking_for_grouped_units_trains_like_one_process(
    dims_groups: tuple, n: int, stage: int, layout: str, reshard: bool, prefetch: bool
) -> None:
    dims, groups = dims_groups
    case = test_gathered.make_case(dims, n, stage, layout, seed=len(dims) + n)
    expected = train_reference(case)
    assert not torch.equal(expected["layers"][0]["w"], case.params["layers"][0]["w"])
    options = {"just_in_time": True, "reshard_after_forward": reshard, "prefetch": prefetch}
    for params in run(n, train_pure, case, groups, **options):
        what = f"stage {stage} groups {groups} {options}"
        fzero.assert_trees_close(params, expected, **tolerance(F64), what=what)


def _one_buffer(mesh: fzero.Mesh, units: list) -> tuple[list, list]:
    """Stage 3 with module hooks: the storage each layer's weight lives in during its
    forward, and the number of elements of each all-gather one step makes."""
    case = test_units.make_case([3, 4, 4, 4, 2], mesh.size, seed=2)
    model = case["model"]
    seen: list[int] = []
    handles = [
        layer.register_forward_hook(
            lambda m, a, out: seen.append(m.weight.untyped_storage().data_ptr())
        )
        for layer in model.layers
    ]
    with counting(("all_gather",)) as sizes:
        test_units.train(mesh, case, units, 3, module=model, reshard_after_forward=False)
    for h in handles:
        h.remove()
    return seen[:4], sizes


@pytest.mark.multiprocess
def test_a_group_is_gathered_as_one_buffer() -> None:
    # The layers of a group compute with views of one gathered buffer; ungrouped, each
    # layer has its own. Measured on the tensors the forward sees and on the collectives.
    per_layer = run(2, _one_buffer, [f"layers.{i}" for i in range(4)])[0]
    grouped = run(2, _one_buffer, [("layers.0", "layers.1"), ("layers.2", "layers.3")])[0]
    assert len(set(per_layer[0])) == 4
    a, b, c, d = grouped[0]
    assert a == b and c == d and a != c
    assert len(grouped[1]) < len(per_layer[1])


def _asks_for_one_member(params: dict, batch: tuple) -> torch.Tensor:
    x, _ = batch
    layer = fzero.gathered(params, "layers.0")  # the unit is ("layers.0", "layers.1")
    return (x @ layer["w"]).sum()


def _uses_a_member_directly(params: dict, batch: tuple) -> torch.Tensor:
    x, _ = batch
    return (x @ params["layers"][0]["w"]).sum()


def _stage3_step(mesh: fzero.Mesh, loss_fn: Any) -> Any:
    case = test_gathered.make_case([3, 4, 4, 2], mesh.size, 3, "flat", seed=1)
    opt = fzero.optim.sgd(lr=0.1)
    units = [("layers.0", "layers.1")]
    state = fzero.shard_state(case.params, opt, mesh, stage=3, units=units)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, just_in_time=True)
    return step(state, case.micro_batch(0, mesh.rank))


@pytest.mark.multiprocess
def test_part_of_a_group_is_refused_naming_the_whole() -> None:
    whole = r"\.gathered\(params, \('layers\.0', 'layers\.1'\)\)"
    for msg in errors_on_every_rank(2, lambda m: _stage3_step(m, _asks_for_one_member)):
        assert "'layers.0' is only part of the just-in-time unit 'layers.0+layers.1'" in msg
        assert pytest.importorskip("re").search(whole, msg), msg
    for msg in errors_on_every_rank(2, lambda m: _stage3_step(m, _uses_a_member_directly)):
        assert "'layers.0.w' of the just-in-time unit ('layers.0', 'layers.1')" in msg, msg


def _gather_group(mesh: fzero.Mesh, stage: int) -> Any:
    params = make_params([3, 4, 4, 2], F64, seed=3)
    opt = fzero.optim.sgd(lr=0.1)
    units = [("layers.2", "layers.0"), "layers.1"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    return fzero.gather_params(state.params, mesh, unit=("layers.2", "layers.0")), params


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_gather_params_of_a_group_gives_each_members_part(stage: int) -> None:
    for (two, zero), params in run(3, _gather_group, stage):
        fzero.assert_trees_close(two, params["layers"][2], rtol=0, atol=0)
        fzero.assert_trees_close(zero, params["layers"][0], rtol=0, atol=0)


def test_grouped_units_from_a_policy() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    names = fzero.units.by_module(model, nn.Linear)
    assert fzero.units.grouped(names, 2) == [("0", "1"), ("2", "3"), "4"]
    assert fzero.units.grouped(names, 1) == names
    with pytest.raises(ValueError, match="size"):
        fzero.units.grouped(names, 0)


@pytest.mark.parametrize(
    ("units", "error"),
    [
        ([("layers.0", "layers.0")], "names a prefix twice"),
        (["layers.0", ("layers.0", "layers.1")], "prefix 'layers.0' in two units"),
        ([("layers", "layers.1")], "prefix 'layers.1' lies inside its own 'layers'"),
        ([("layers.0", "nope")], "prefix 'nope' matches no parameter path"),
        ([()], "non-empty"),
        ([("layers.0", 3)], "non-empty"),
    ],
)
def test_a_malformed_group_is_refused(units: list, error: str) -> None:
    params = make_params([3, 4, 4, 2], F64, seed=0)
    with pytest.raises(ValueError, match=error):
        build_layout(params, 2, "flat", units)


def _mismatched_step(mesh: fzero.Mesh) -> None:
    params = make_params([3, 4, 4, 2], F64, seed=0)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=[("layers.0", "layers.1")])
    step = fzero.sharded_step(lambda p, b: p["scale"], opt, mesh, stage=3, units=["layers.0"])
    step(state, None)


@pytest.mark.multiprocess
def test_a_step_for_other_units_names_both() -> None:
    for msg in errors_on_every_rank(2, _mismatched_step):
        assert "units ['layers.0'], the state has [('layers.0', 'layers.1')]" in msg, msg


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("n1", "n2"), [(2, 3), (3, 1)])
def test_a_checkpoint_of_grouped_units_reshards_and_trains_on(n1: int, n2: int) -> None:
    # Saved with groups at stage 3, loaded with other units (or groups) elsewhere.
    job = test_checkpoint.make_job([3, 4, 4, 4, 2], 3, seed=11, optimizer="adam")
    groups = [("layers.0", "layers.1"), ("layers.3", "layers.2")]
    other = ["layers.1", ("layers.2", "layers.0")] if n2 > 1 else None
    with tempfile.TemporaryDirectory() as d:
        saved = run(n1, test_checkpoint.train_and_save, job, 1, 3, "flat", groups, d)[0]
        results = run(n2, test_checkpoint.load_and_train, job, 1, 3, "flat", other, d)
    test_checkpoint.assert_same_export(results[0][0], saved, f"{n1} -> {n2} ranks")
    expected = test_checkpoint.reference(job)
    for rank, (_, params, _) in enumerate(results):
        fzero.assert_trees_close(params, expected, **test_checkpoint.TIGHT, what=f"rank {rank}")
