"""`sharded_step(has_aux=True)`: a loss's auxiliary outputs handed back detached, per
micro-batch, as one process computes them, the training unchanged (torch.optim)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from fzero._core._tree import tree_flatten, tree_unflatten
from tests.step.test_weights import DIMS, UNITS, make_data, pair_loss, token_losses
from tests.support import errors_on_every_rank, make_params, run


def aux_loss(params: Any, batch: tuple) -> tuple:
    """The token-weighted pair, and as aux each sequence's mean token loss (a tensor that
    needs the forward's graph) beside a Python value, passed as it is."""
    x, y, mask = batch
    tokens = token_losses(params, x, y)
    return ((tokens * mask).sum(), mask.sum()), {"per_sequence": tokens.mean(-1), "n": len(x)}


def reference(params: Any, data: list) -> tuple[Any, list]:
    """One process, torch.optim.Adam on the global token mean; per step, rank and
    micro-batch, the per-sequence losses at the parameters the step started from (None
    where there was no micro-batch)."""
    leaves, treedef = tree_flatten(params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.Adam(tensors, lr=0.01, foreach=False)
    seen = []
    for step in data:
        p = tree_unflatten(treedef, tensors)
        with torch.no_grad():
            seen.append(
                [
                    [None if mb is None else token_losses(p, mb[0], mb[1]).mean(-1) for mb in r]
                    for r in step
                ]
            )
        batches = [mb for per_rank in step for mb in per_rank if mb is not None]
        loss = sum(pair_loss(p, b)[0] for b in batches) / sum(b[2].sum() for b in batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tree_unflatten(treedef, [t.detach() for t in tensors]), seen


def train(
    mesh: fzero.Mesh, params: Any, data: list, stage: int, compile: Any, accumulate: Any
) -> tuple[Any, list]:
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)
    step = fzero.sharded_step(
        aux_loss, opt, mesh, stage=stage, units=UNITS, compile=compile, accumulate=accumulate,
        has_aux=True,
    )  # fmt: skip
    got = []
    for per_rank in data:
        micro = per_rank[mesh.rank]
        state, (loss, aux) = step(state, micro if accumulate else micro[0])
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        got.append(aux if accumulate else [aux])
    return fzero.gather_params(state.params, mesh), got


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "compile", "accumulate"),
    [(0, False, None), (3, False, "sharded"), (2, "aot_eager", None),
     (3, "aot_eager", "sharded"), (1, "aot_eager", "local")],
)  # fmt: skip
def test_aux_comes_back_per_micro_batch_as_one_process_computes_it(
    stage: int, compile: Any, accumulate: Any
) -> None:
    """Each rank's aux, per micro-batch (None where it had none: rank 1 misses the first
    of the first step's two, or has no batch on the last step), holds the per-sequence
    losses one process computes at the step's starting parameters, detached, and the
    Python value as it was; training is torch.optim's."""
    m = 2 if accumulate else 1
    sizes = [[[2] * m, [1] * m], [[1] * m, [2] * m]]
    if accumulate:  # compiled, it runs its other micro-batch again in the first's place
        sizes[0][1][0] = 0
    else:
        sizes[-1][1][0] = 0
    params = make_params(DIMS, torch.float64, 6)
    data = make_data(sizes, seed=8)
    want_params, want = reference(params, data)
    for rank, (got_params, got) in enumerate(run(2, train, params, data, stage, compile,
                                                 accumulate)):  # fmt: skip
        fzero.assert_trees_close(got_params, want_params, rtol=1e-10, atol=1e-12)
        for t, per_micro in enumerate(got):
            for j, aux in enumerate(per_micro):
                expected = want[t][rank][j]
                if expected is None:
                    assert aux is None, (t, rank, j)
                    continue
                assert aux["n"] == len(expected) and isinstance(aux["n"], int)
                assert not aux["per_sequence"].requires_grad
                torch.testing.assert_close(aux["per_sequence"], expected, rtol=1e-10, atol=1e-12)
    assert not torch.equal(want_params["layers"][0]["w"], params["layers"][0]["w"])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()


def first_outputs(mesh: fzero.Mesh, xs: torch.Tensor, compile: Any) -> tuple[Any, dict, Any]:
    """A step whose loss has buffers (BatchNorm's statistics) and an aux, the model's
    output: `((loss, new_buffers), aux)`; then a step where rank 1 has no batch (its aux
    None, its buffers the broadcast ones)."""
    model = make_model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, buffers=dict(model.named_buffers()))

    def loss_fn(p: dict, bufs: dict, x: torch.Tensor) -> tuple:
        merged = {**p, **bufs}
        out = functional_call(model, merged, (x,))
        return (out.square().mean(), {k: merged[k] for k in bufs}), out

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, compile=compile,
                              has_aux=True)  # fmt: skip
    state, (_, out) = step(state, xs[mesh.rank])
    buffers = {k: v.clone() for k, v in state.buffers.items()}
    _, (_, second) = step(state, None if mesh.rank == 1 else xs[mesh.rank])
    return out, buffers, second


@pytest.mark.multiprocess
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_aux_beside_buffers(compile: Any) -> None:
    """With buffers the loss returns `((loss, new_buffers), aux)`: the aux is the model's
    output on the rank's batch at the starting parameters (BatchNorm's batch statistics),
    and the buffers move as one process's BatchNorm moves them on the rank-0 batch
    (`buffer_sync="broadcast"`). A rank without data next gets None (compiled, its
    stand-in's aux is dropped)."""
    xs = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    model = make_model()
    want = [model(x) for x in xs]  # training mode: each rank's own batch statistics
    ref = make_model()
    stats = {k: v.clone() for k, v in ref.named_buffers()}
    with torch.no_grad():  # BatchNorm writes rank 0's batch's statistics into `stats`
        functional_call(ref, {**dict(ref.named_parameters()), **stats}, (xs[0],))
    assert not torch.equal(stats["1.running_mean"], dict(ref.named_buffers())["1.running_mean"])
    for rank, (out, buffers, second) in enumerate(run(2, first_outputs, xs, compile)):
        assert not out.requires_grad
        torch.testing.assert_close(out, want[rank].detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(buffers["1.running_mean"], stats["1.running_mean"])
        assert (second is None) == (rank == 1)


@pytest.mark.multiprocess
def test_a_loss_without_its_aux_raises_on_every_rank() -> None:
    """Rank 1's loss returns a bare scalar under `has_aux=True`: every rank raises the
    same TypeError, before any backward."""
    params = make_params(DIMS, torch.float64, 1)
    batch = make_data([[[2], [2]]], seed=1)[0]

    def fn(mesh: fzero.Mesh) -> None:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=2)

        def loss(p: Any, b: tuple) -> Any:
            (total, weight), aux = aux_loss(p, b)
            return ((total, weight), aux) if mesh.rank == 0 else total / weight

        step = fzero.sharded_step(loss, opt, mesh, stage=2, has_aux=True)
        step(state, batch[mesh.rank][0])

    for said in errors_on_every_rank(2, fn):
        assert "rank 1: with has_aux=True loss_fn must return (output, aux)" in said, said
        assert "got Tensor" in said


def parameters_as_aux(mesh: fzero.Mesh, params: Any, data: list, stage: int, compile: Any) -> list:
    """Three donating steps whose aux is a parameter itself, as the loss received it."""
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)

    def loss_fn(p: Any, batch: tuple) -> tuple:
        return pair_loss(p, batch), (p["layers"][0]["w"], p["scale"])

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, compile=compile, has_aux=True
    )
    seen = []
    for per_rank in data:
        state, (_, aux) = step(state, per_rank[mesh.rank][0])
        seen.append(aux)
    return seen


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "compile"), [(0, False), (2, False), (3, False), (1, "aot_eager")]
)
def test_a_parameter_returned_as_aux_keeps_the_value_the_loss_saw(stage: int, compile: Any) -> None:
    """A parameter handed back as it is shares the state's memory, which the next
    updates overwrite in place (a donating step): it is copied, so each step's aux holds
    the parameters one process had when that step began, after later steps too."""
    params = make_params(DIMS, torch.float64, 2)
    data = make_data([[[2], [1]], [[1], [2]], [[2], [2]]], seed=3)
    starts = [reference(params, data[:t])[0] for t in range(len(data))]
    for seen in run(2, parameters_as_aux, params, data, stage, compile):
        for t, (w, scale) in enumerate(seen):
            want = starts[t]
            torch.testing.assert_close(w, want["layers"][0]["w"], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(scale, want["scale"], rtol=1e-10, atol=1e-12)
    assert not torch.equal(starts[-1]["scale"], params["scale"])
