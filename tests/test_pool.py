"""Buffers a step function keeps across calls (`fzero._pool`) never overwrite what a state
still holds: an optimizer that keeps the gradient itself, as a pure function may."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import make_params, mlp_loss, run

import fzero
from fzero._pool import Pool
from fzero._tree import tree_flatten, tree_map, tree_unflatten

LR, KEEP, STEPS, WORLD = 0.1, 0.5, 4, 2


def echo(lr: float, keep: float) -> fzero.optim.Optimizer:
    """p <- p - lr (g + keep * g_prev), its state the last gradient itself, not a copy."""

    def init(params: Any) -> Any:
        return tree_map(torch.zeros_like, params)

    def update(grads: Any, state: Any, params: Any) -> tuple[Any, Any]:
        return tree_map(lambda p, g, h: p - lr * (g + keep * h), params, grads, state), grads

    return fzero.optim.Optimizer(init, update)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(STEPS, 4 * WORLD, 3, generator=g, dtype=torch.float64)
    return xs, torch.randn(STEPS, 4 * WORLD, 2, generator=g, dtype=torch.float64)


def reference(params: dict[str, Any]) -> dict[str, Any]:
    """One process on the whole batch, the same rule written out with autograd."""
    xs, ys = data()
    leaves = [p.clone().requires_grad_() for p in tree_flatten(params)[0]]
    spec = tree_flatten(params)[1]
    prev = [torch.zeros_like(p) for p in leaves]
    for t in range(STEPS):
        loss = mlp_loss(tree_unflatten(spec, leaves), (xs[t], ys[t]))
        grads = torch.autograd.grad(loss, leaves)
        with torch.no_grad():
            for p, g, h in zip(leaves, grads, prev):
                p.sub_(LR * (g + KEEP * h))
        prev = [g.clone() for g in grads]
    return tree_unflatten(spec, [p.detach() for p in leaves])


def train(mesh: fzero.Mesh, params: dict[str, Any], stage: int) -> Any:
    xs, ys = data()
    opt = echo(LR, KEEP)
    state = fzero.shard_state(params, opt, mesh, stage=stage)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)
    per = xs.shape[1] // mesh.size
    for t in range(STEPS):
        cut = slice(mesh.rank * per, (mesh.rank + 1) * per)
        state, _ = step(state, (xs[t, cut], ys[t, cut]))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_state_holding_the_gradient_itself_trains_like_one_process(stage: int) -> None:
    # Stages 0-1 reduce into buffers the step function keeps: the all-reduced bursts are
    # stage 0's gradient, the reduce-scattered rows stage 1's. Reused while this state
    # holds them, the next step's gradient would overwrite g_prev.
    params = make_params([3, 5, 2], torch.float64, seed=3)
    want = reference(params)
    moved = [
        (a - b).abs().max().item() for a, b in zip(tree_flatten(want)[0], tree_flatten(params)[0])
    ]
    assert max(moved) > 1e-2  # the reference trained
    for got in run(WORLD, train, params, stage):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.sampled_from(["take", "give", "end"]), st.integers(0, 3)), max_size=40)
)
def test_the_pool_never_lends_a_buffer_in_use(ops: list[tuple[str, int]]) -> None:
    # Steps of takes and gives, each ended by a reclaim that keeps some buffers in the
    # returned state: nothing lent is lent twice at once, nothing kept is lent again.
    pool, lent, kept = Pool(), [], []
    for op, k in ops:
        if op == "take":
            buf = pool.take(4 + k % 2, torch.float32, torch.device("cpu"))
            assert all(buf is not b for b in lent + kept)
            lent.append(buf)
        elif op == "give" and lent:
            pool.give([lent.pop(k % len(lent))])
        elif op == "end":
            keep = lent[: k % 2]
            pool.reclaim({"w": [t[1:] for t in keep]})  # views into them
            kept += keep
            lent = []
