"""Exact means over uneven work: (total, weight) losses and ranks without data, against
one process minimising the sum of token losses over the sum of tokens with torch.optim."""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import fzero
from fzero._core._tree import max_abs_diff, tree_flatten, tree_unflatten
from tests.support import (
    errors_on_every_rank,
    make_optimizer,
    make_params,
    make_torch_optimizer,
    run,
)

T, D_IN, D_OUT = 3, 3, 2  # tokens per sequence, feature sizes
DIMS = [D_IN, 4, 4, D_OUT]
UNITS = ["layers.0", "layers.1", "layers.2"]


def token_losses(params: Any, x: torch.Tensor, y: torch.Tensor, jit: bool = False) -> torch.Tensor:
    """Per-token squared error of a tanh MLP over (sequences, tokens, features)."""
    h = x
    for i in range(len(DIMS) - 1):
        layer = fzero.gathered(params, f"layers.{i}") if jit else params["layers"][i]
        h = torch.tanh(h @ layer["w"] + layer["b"])
    out = h * params["scale"] + params["shift"]
    return ((out - y) ** 2).sum(-1)


def pair_loss(params: Any, batch: tuple, jit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of real tokens' losses, number of real tokens)."""
    x, y, mask = batch
    return (token_losses(params, x, y, jit) * mask).sum(), mask.sum()


def scalar_loss(params: Any, batch: tuple, jit: bool = False) -> torch.Tensor:
    """This micro-batch's mean token loss, padding included (DDP's per-rank mean)."""
    x, y, _ = batch
    return token_losses(params, x, y, jit).mean()


def make_data(
    sizes: list[list[list[int]]], seed: int, all_padding: bool = False
) -> list[list[list[Any]]]:
    """data[t][r][m]: `sizes[t][r][m]` sequences with random padding (None for 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for per_rank in sizes:
        step = []
        for per_micro in per_rank:
            micro = []
            for n in per_micro:
                if n == 0:
                    micro.append(None)
                    continue
                x = torch.randn(n, T, D_IN, generator=g, dtype=torch.float64)
                y = torch.randn(n, T, D_OUT, generator=g, dtype=torch.float64)
                lengths = torch.randint(0, T + 1, (n, 1), generator=g)
                mask = (torch.arange(T) < lengths).double() * (0.0 if all_padding else 1.0)
                micro.append((x, y, mask))
            step.append(micro)
        out.append(step)
    return out


def reference(
    params: Any,
    data: list,
    kind: str,
    optimizer: str,
    frozen: tuple[str, ...] = (),
    losses: list[float] | None = None,
) -> Any:
    """One process, torch.optim: the loss over every rank's and micro-batch's data at once
    (pairs: sum of totals over sum of tokens; scalars: the mean over micro-batches that
    had data). A step where nothing counts is skipped (its loss 0). Leaves under a
    `frozen` path prefix are not trained. `losses`, if given, gets each step's loss."""
    leaves, treedef = tree_flatten(params)
    paths = fzero._core._tree.leaf_paths(params)
    tensors = [
        x.detach().clone().requires_grad_(not p.startswith(frozen)) for x, p in zip(leaves, paths)
    ]
    trained = [(t, p) for t, p in zip(tensors, paths) if t.requires_grad]
    opt = make_torch_optimizer(optimizer, [t for t, _ in trained], [p for _, p in trained])
    for step in data:
        batches = [mb for per_rank in step for mb in per_rank if mb is not None]
        p = tree_unflatten(treedef, tensors)
        if kind == "pair":
            weight = sum(float(b[2].sum()) for b in batches)
            loss = sum(pair_loss(p, b)[0] for b in batches) / weight if weight else None
        else:
            loss = sum(scalar_loss(p, b) for b in batches) / len(batches) if batches else None
        if losses is not None:
            losses.append(0.0 if loss is None else float(loss.detach()))
        if loss is None:
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tree_unflatten(treedef, [t.detach() for t in tensors])


def train(
    mesh: fzero.Mesh,
    params: Any,
    data: list,
    kind: str,
    optimizer: str,
    stage: int,
    accumulate: str | None,
    jit: bool,
    compile: Any = False,
) -> tuple[Any, list[float], int]:
    """fzero's parameters after every step, its losses, and how many warnings it gave
    (`compile`: `sharded_step`'s)."""
    opt = make_optimizer(optimizer)
    units = UNITS if jit else None
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    base = scalar_loss if kind == "scalar" else pair_loss

    def loss_fn(p: Any, batch: tuple) -> Any:
        if kind == "pair numpy":  # the token count as numpy gives it: np.int64
            total, count = pair_loss(p, batch, jit)
            return total, np.int64(round(float(count)))
        return base(p, batch, jit)

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, accumulate=accumulate, just_in_time=jit, compile=compile
    )
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t, per_rank in enumerate(data):
            micro = per_rank[mesh.rank]
            if accumulate is None:
                batch = micro[0]
            else:  # with no data at all, None (as many micro-batches as last step's)
                batch = None if t and all(mb is None for mb in micro) else micro
            state, loss = step(state, batch)
            losses.append(float(loss))
    return fzero.gather_params(state.params, mesh), losses, len(caught)


@st.composite
def uneven(draw: Any) -> dict[str, Any]:
    world = draw(st.integers(1, 4))
    accumulate = draw(st.sampled_from([None, "local", "sharded"]))
    micro = 1 if accumulate is None else draw(st.integers(1, 3))
    jit = draw(st.booleans())
    steps = 3
    sizes = [
        [[draw(st.integers(0, 2)) for _ in range(micro)] for _ in range(world)]
        for _ in range(steps)
    ]
    if jit:  # a rank without data follows last step's unit calls: the first has data
        sizes[0] = [[max(n, 1) for n in per_rank] for per_rank in sizes[0]]
    return {
        "world": world,
        "accumulate": accumulate,
        "jit": jit,
        "sizes": sizes,
        "stage": draw(st.integers(0, 3)),
        "kind": draw(st.sampled_from(["pair", "scalar"])),
        "optimizer": draw(st.sampled_from(["sgd", "adam"])),
        "seed": draw(st.integers(0, 99)),
    }


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=40)
@given(uneven())
def test_uneven_work_trains_like_one_process_on_the_global_mean(c: dict[str, Any]) -> None:
    params = make_params(DIMS, torch.float64, c["seed"])
    data = make_data(c["sizes"], c["seed"])
    want_losses: list[float] = []
    expected = reference(params, data, c["kind"], c["optimizer"], losses=want_losses)
    results = run(
        c["world"],
        train,
        params,
        data,
        c["kind"],
        c["optimizer"],
        c["stage"],
        c["accumulate"],
        c["jit"],
    )
    # A step where nothing counts anywhere updates nothing and warns (once per step fn).
    empty = [not _weighs(step, c["kind"]) for step in data]
    for rank, (got, losses, warned) in enumerate(results):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what=f"rank {rank} {c}")
        assert warned == int(any(empty))
        if c["kind"] == "pair":  # every rank returns the loss over all the data (0: none)
            torch.testing.assert_close(losses, want_losses, rtol=1e-10, atol=1e-12)
        else:
            assert all(loss == loss for loss in losses)  # a rank's own: no NaN, even without data


def _weighs(step: list, kind: str) -> bool:
    batches = [mb for per_rank in step for mb in per_rank if mb is not None]
    return bool(batches) and (kind == "scalar" or sum(float(b[2].sum()) for b in batches) > 0)


@pytest.mark.multiprocess
def test_weighted_mean_is_not_the_mean_of_rank_means() -> None:
    # The property above can fail: on data where one rank has far fewer real tokens than
    # the other, the token mean and DDP's mean of per-rank means train differently, and
    # fzero matches the former. The returned loss is the global token mean on every rank.
    params = make_params(DIMS, torch.float64, 3)
    data = make_data([[[1], [2]], [[2], [1]]], seed=4)
    data[0][0][0][2][:] = torch.tensor([1.0, 0.0, 0.0])  # rank 0: one real token
    data[0][1][0][2][:] = 1.0  # rank 1: six
    for per_rank in data[1]:
        per_rank[0][2][:] = 1.0  # then no padding (a rank mean over 0 tokens is NaN)
    expected = reference(params, data, "pair", "adam")
    results = run(2, train, params, data, "pair", "adam", 2, None, False)
    for got, losses, _ in results:
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12)
        assert losses == results[0][1]
    per_rank_mean = _rank_means_reference(params, data)
    assert max_abs_diff(expected, per_rank_mean) > 1e-4
    assert max_abs_diff(expected, params) > 1e-3  # and training moved the parameters
    step0 = [mb for per_rank in data[0] for mb in per_rank]
    totals = sum(float(pair_loss(params, b)[0]) for b in step0)
    tokens = sum(float(b[2].sum()) for b in step0)
    assert results[0][1][0] == pytest.approx(totals / tokens, rel=1e-12)


@pytest.mark.multiprocess
def test_a_weight_from_numpy_counts_as_the_number_it_is() -> None:
    """np.int64 is a numbers.Real, as a batch's token count often is (it was refused)."""
    params = make_params(DIMS, torch.float64, 3)
    data = make_data([[[2], [1]], [[1], [3]]], seed=4)
    expected = reference(params, data, "pair", "adam")
    assert max_abs_diff(expected, params) > 1e-3
    for got, _, _ in run(2, train, params, data, "pair numpy", "adam", 2, None, False):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12)


def _rank_means_reference(params: Any, data: list) -> Any:
    leaves, treedef = tree_flatten(params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = make_torch_optimizer("adam", tensors)
    for step in data:
        p = tree_unflatten(treedef, tensors)
        means = [pair_loss(p, b)[0] / b[2].sum() for per_rank in step for b in per_rank]
        opt.zero_grad()
        (sum(means) / len(means)).backward()
        opt.step()
    return tree_unflatten(treedef, [t.detach() for t in tensors])


class Net(nn.Module):
    """Linear layers, one applied twice and one checkpointed around its unit
    (checkpoint(FSDP(m)): its recompute re-enters the unit inside the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in [(3, 4), (4, 4), (4, 4), (4, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i == 2 else layer(x)
            if i == 1:
                x = layer(torch.tanh(x))  # the same unit entered twice
            x = torch.tanh(x)
        return x


# Per step, per rank of 3: examples (0: the rank has no data). Rank 1 runs out first.
MODULE_SIZES = [[2, 3, 1], [2, 0, 3], [0, 0, 2], [1, 0, 0]]


def module_data(seed: int) -> list[list[Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for per_rank in MODULE_SIZES:
        step = []
        for n in per_rank:
            if n == 0:
                step.append(None)
                continue
            x = torch.randn(n, 3, generator=g, dtype=torch.float64)
            y = torch.randn(n, 2, generator=g, dtype=torch.float64)
            step.append((x, y, (torch.rand(n, generator=g) < 0.7).double()))
        out.append(step)
    return out


def module_reference(model: nn.Module, data: list) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for step in data:
        batches = [b for b in step if b is not None]
        weight = sum(float(b[2].sum()) for b in batches)
        if weight == 0:
            continue
        total = sum((((model(x) - y) ** 2).sum(-1) * m).sum() for x, y, m in batches)
        opt.zero_grad()
        (total / weight).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train_module(mesh: fzero.Mesh, model: nn.Module, data: list, stage: int, **options: Any) -> Any:
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, mask = batch
        return ((((functional_call(model, p, (x,)) - y) ** 2).sum(-1)) * mask).sum(), mask.sum()

    opt = fzero.optim.adam(lr=0.05)
    units = [f"layers.{i}" for i in range(4)]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model, **options)
    for per_rank in data:
        state, _ = step(state, per_rank[mesh.rank])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_without_data_follow_module_hooks_and_recomputes(stage: int) -> None:
    # A rank without data enters the hooked units in last step's order, and its backward
    # re-gathers and reduces what the others' do, though their recompute re-enters a unit
    # inside the backward.
    torch.manual_seed(5)
    model = Net().double()
    data = module_data(6)
    expected = module_reference(model, data)
    assert max_abs_diff(expected, dict(model.named_parameters())) > 1e-3
    for got in run(3, train_module, model, data, stage):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")


MAX_NORM = 0.05  # small enough that every step clips


def clipped_reference(params: Any, data: list, weighted: bool = True) -> Any:
    """torch.optim.SGD after clip_grad_norm_, in float64, on the global token mean (or, not
    `weighted`, DDP's mean of per-rank means, which the test must be able to tell apart)."""
    leaves, treedef = tree_flatten(params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.SGD(tensors, lr=0.1, momentum=0.9, foreach=False)
    for step in data:
        batches = [mb for per_rank in step for mb in per_rank if mb is not None]
        if not batches:
            continue
        p = tree_unflatten(treedef, tensors)
        if weighted:
            loss = sum(pair_loss(p, b)[0] for b in batches) / sum(b[2].sum() for b in batches)
        else:
            loss = sum(pair_loss(p, b)[0] / b[2].sum() for b in batches) / len(batches)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tensors, MAX_NORM, foreach=False)
        opt.step()
    return tree_unflatten(treedef, [t.detach() for t in tensors])


def train_mixed(mesh: fzero.Mesh, params: Any, data: list, stage: int) -> Any:
    """float32 compute and reduction, float64 masters, a loss scaler, global-norm clipping."""
    opt = fzero.optim.chain(
        fzero.optim.clip_by_global_norm(MAX_NORM), fzero.optim.sgd(lr=0.1, momentum=0.9)
    )
    state = fzero.shard_state(
        params,
        opt,
        mesh,
        stage=stage,
        precision=fzero.Precision(param_dtype=torch.float32),
        loss_scale=fzero.DynamicLossScale(init_scale=2.0**10, growth_interval=2),
    )

    def loss_fn(p: Any, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, mask = batch
        return pair_loss(p, (x.float(), y.float(), mask.float()))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    seen = []
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for per_rank in data:
            state, loss = step(state, per_rank[mesh.rank][0])
            seen.append((state.step, float(state.scaler.scale), float(loss)))
    return fzero.master_params(state, mesh), seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_loss_scaling_and_clipping_use_the_weighted_gradient(stage: int) -> None:
    # Rank 1 has no data at step 1, and nobody has any at step 2: that step changes
    # nothing, the loss scale included (it is not an overflow).
    sizes = [[[2], [1]], [[3], [0]], [[0], [0]], [[1], [2]]]
    params = make_params(DIMS, torch.float64, 8)
    data = make_data(sizes, seed=9)
    expected = clipped_reference(params, data)
    ddp_like = clipped_reference(params, data, weighted=False)
    tol = {"rtol": 1e-5, "atol": 1e-6}  # float32 compute against a float64 reference
    assert max_abs_diff(expected, ddp_like) > 100 * tol["atol"]
    for masters, seen in run(2, train_mixed, params, data, stage):
        fzero.assert_trees_close(masters, expected, **tol, what=f"stage {stage}")
        steps, scales, losses = zip(*seen)
        assert steps == (1, 2, 2, 3)  # the empty step is not counted
        assert scales == (2.0**10, 2.0**11, 2.0**11, 2.0**11)  # nor does it move the scale
        assert losses[2] == 0.0


def stop_early(mesh: fzero.Mesh, stop: int, stage: int) -> str:
    """Rank 1 stops calling step at step `stop` and stays alive, its sockets open."""
    params = make_params(DIMS, torch.float64, 0)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage)
    step = fzero.sharded_step(pair_loss, opt, mesh, stage=stage)
    (batch,) = make_data([[[2]]], seed=1)[0][0]
    for t in range(3):
        if mesh.rank == 1 and t == stop:
            time.sleep(3600)  # killed by simulate once a peer has failed
        state, _ = step(state, batch)
    return "done"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("world_size", "shard_size", "stage"), [(2, None, 2), (2, None, 3), (4, 2, 2)]
)
def test_a_rank_that_stops_calling_step_fails_the_others_within_their_timeout(
    world_size: int, shard_size: int | None, stage: int
) -> None:
    # Within the 3 s the process group was given, not torch's 30 minutes for the groups
    # fzero makes (its gloo reductions' twin group, a hybrid mesh's axes).
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank \d: step 2: .*stopped calling step"):
        fzero.Simulation(world_size, collective_timeout=3, timeout=50, shard_size=shard_size).run(
            stop_early, 2, stage
        )
    assert time.monotonic() - start < 30


def bad_weights(mesh: fzero.Mesh, how: str) -> None:
    params = make_params(DIMS, torch.float64, 0)
    opt = fzero.optim.sgd(lr=0.1)
    jit = how == "first step without data"
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS if jit else None)

    def loss_fn(p: Any, batch: tuple) -> Any:
        total, weight = pair_loss(p, batch, jit)
        if how == "mixed kinds" and mesh.rank == 1:
            return total / weight
        if how == "bool tensor":
            return total, weight > 0
        if how == "learned weight":  # a soft mask of the parameters: its gradient dropped
            return total, torch.as_tensor(weight, dtype=total.dtype) * p["scale"].exp()
        return (
            total,
            {"negative": -weight, "three": weight}.get(how, weight),
            *((1,) if how == "tuple of 3" else ()),
        )

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, just_in_time=jit)
    (batch,) = make_data([[[2]]], seed=1)[0][0]
    step(state, None if jit and mesh.rank == 1 else batch)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("how", "error", "match"),
    [
        ("mixed kinds", ValueError, r"^loss_fn returned \(total, weight\) 1 times and a "),
        ("negative", ValueError, r"rank \d: loss_fn's weight must be finite and >= 0, got -"),
        (
            "bool tensor",
            ValueError,
            r"rank \d: .*one-element tensor, got shape \(\) dtype torch.bool",
        ),
        ("tuple of 3", TypeError, r"rank \d: loss_fn returned a tuple of 3"),
        ("learned weight", ValueError, r"rank \d: loss_fn's weight requires grad: weights are"),
        (
            "first step without data",
            ValueError,
            r"rank\(s\) \[1\] called step\(state, None\) on the first",
        ),
    ],
)
def test_bad_weights_fail_clearly(how: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fzero.Simulation(2, collective_timeout=10, timeout=60).run(bad_weights, how)


@pytest.mark.multiprocess
def test_a_missing_first_micro_batch_on_a_first_just_in_time_step_raises_on_every_rank() -> None:
    """Eagerly, a rank without data follows the units the step called last time; on the
    first call a None micro-batch before the rank's first batch has none to follow:
    every rank raises, saying what to do (after the one it has, it follows that one's)."""
    params = make_params(DIMS, torch.float64, 1)
    data = make_data([[[2, 2], [0, 2]]], seed=1)

    def fn(mesh: fzero.Mesh) -> None:
        train(mesh, params, data, "pair", "sgd", 3, "sharded", True)

    for said in errors_on_every_rank(2, fn):
        assert "a None micro-batch before the rank's first batch" in said, said
