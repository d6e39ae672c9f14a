"""A compiled step's rank without data runs a batch through the graph in a micro-batch's
place (the collectives pair by order): that batch must be a copy its loss cannot reach
the real one through. Against one process with torch.optim over the present batches."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch

import fzero
from tests.support import run

F64 = torch.float64


def _params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": {"w": torch.randn(5, 7, generator=g, dtype=F64)},
        "b": {"w": torch.randn(7, 3, generator=g, dtype=F64)},
    }


def _model(p: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["a"]["w"]) @ p["b"]["w"]


def scaling_loss(p: Any, batch: Any) -> torch.Tensor:
    x = batch["x"].div_(2.0)  # preprocessing in place, as some pipelines do
    return ((_model(p, x) - batch["y"]) ** 2).mean()


def popping_loss(p: Any, inputs: Any) -> torch.Tensor:
    labels = inputs.pop("labels")  # Hugging Face Trainer's compute_loss idiom
    return ((_model(p, inputs["x"]) - labels) ** 2).mean()


def _batch(seed: int, kind: type = dict) -> Any:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, generator=g, dtype=F64), torch.randn(4, 3, generator=g, dtype=F64)
    return kind({"x": x, "y": y}) if kind is dict else kind({"x": x, "labels": y})


def _reference(loss_fn: Any, steps: list[list[Any]]) -> dict[str, Any]:
    """torch.optim.SGD on one process: each step the mean of its present batches' losses."""
    params = _params()
    leaves = [params["a"]["w"].requires_grad_(), params["b"]["w"].requires_grad_()]
    opt = torch.optim.SGD(leaves, lr=0.1)
    for batches in steps:
        opt.zero_grad()
        losses = [loss_fn(params, b) for b in batches]
        (sum(losses) / len(losses)).backward()
        opt.step()
    return {"a": {"w": leaves[0].detach()}, "b": {"w": leaves[1].detach()}}


def first_step_without_its_first(mesh: fzero.Mesh, compile: Any) -> Any:
    """Stage 2, two micro-batches, rank 1 without the first: in its place it runs one of
    its own, still to come, through the graph."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=2, units=["a", "b"])
    step = fzero.sharded_step(
        scaling_loss, opt, mesh, stage=2, compile=compile, accumulate="sharded"
    )
    micro = [_batch(10 * mesh.rank), _batch(10 * mesh.rank + 1)]
    if mesh.rank == 1:
        micro[0] = None
    state, _ = step(state, micro)
    return fzero.gather_params(state.params, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_a_missing_micro_batch_runs_a_private_copy_of_one_to_come(compile: Any) -> None:
    # Compiled, its loss scaled the real micro-batch's tensors in place: it trained on
    # x / 4, without an error.
    want = _reference(scaling_loss, [[_batch(0), _batch(1), _batch(11)]])
    for got in run(2, first_step_without_its_first, compile):
        fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-12)


def later_step_without_data(mesh: fzero.Mesh, compile: Any) -> Any:
    """Rank 1 has no batch at the third step: it runs its last one again, from which its
    loss popped the labels (a `UserDict`, which the tree does not walk)."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=2, units=["a", "b"])
    step = fzero.sharded_step(popping_loss, opt, mesh, stage=2, compile=compile)
    for t in range(3):
        batch = _batch(10 * t + mesh.rank, collections.UserDict)
        state, _ = step(state, None if (mesh.rank == 1 and t == 2) else batch)
    return fzero.gather_params(state.params, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_a_rank_without_data_runs_its_last_batch_with_its_containers_copied(compile: Any) -> None:
    # Compiled, the replay found "labels" popped: KeyError on every rank.
    kind = collections.UserDict
    steps = [
        [_batch(10 * t + r, kind) for r in range(2) if not (r == 1 and t == 2)] for t in range(3)
    ]
    want = _reference(popping_loss, steps)
    for got in run(2, later_step_without_data, compile):
        fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-12)


def numpy_loss(p: Any, batch: Any) -> torch.Tensor:
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])
    return ((_model(p, x) - y) ** 2).mean()


def _numpy_batch(seed: int) -> dict[str, Any]:
    b = _batch(seed)
    return {"x": b["x"].numpy(), "y": b["y"].numpy()}


def numpy_batches(mesh: fzero.Mesh) -> Any:
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=1, units=["a", "b"])
    step = fzero.sharded_step(numpy_loss, opt, mesh, stage=1, compile="aot_eager")
    for t in range(2):
        state, _ = step(state, _numpy_batch(10 * t + mesh.rank))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_loss_reading_numpy_arrays_from_its_batch_compiles() -> None:
    # Under the step's guard filter torch built the from_numpy guard twice and raised an
    # InternalTorchDynamoError on every rank; it is traced again keeping every guard.
    want = _reference(numpy_loss, [[_numpy_batch(10 * t + r) for r in range(2)] for t in range(2)])
    for got in run(2, numpy_batches):
        fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-12)
