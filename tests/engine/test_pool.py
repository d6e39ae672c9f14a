"""Buffers a step function keeps across calls (`fzero._engine._pool`) never overwrite what a state
still holds: an optimizer that keeps the gradient itself, as a pure function may."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero._core._tree import tree_flatten, tree_map, tree_unflatten
from fzero._engine._pool import Pool
from tests.engine import test_units
from tests.support import make_params, mlp_loss, run

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


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_state_holding_the_gradient_itself_trains_like_one_process(stage: int) -> None:
    # Every stage reduces into host buffers the step function keeps: the all-reduced
    # bursts are stage 0's gradient, the reduce-scattered rows that of stages 1-3. Reused
    # while this state holds them, the next step's gradient would overwrite g_prev.
    params = make_params([3, 5, 2], torch.float64, seed=3)
    want = reference(params)
    moved = [
        (a - b).abs().max().item() for a, b in zip(tree_flatten(want)[0], tree_flatten(params)[0])
    ]
    assert max(moved) > 1e-2  # the reference trained
    for got in run(WORLD, train, params, stage):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


def _holds(t: torch.Tensor, kind: int) -> Any:
    """Something that keeps `t`'s memory in use without being `t`: a view, what autograd
    saved of it, or a tensor set onto its storage."""
    if kind == 0:
        return t[1:]
    if kind == 1:
        w = torch.ones(t.numel(), requires_grad=True)
        return (w * t).sum()  # its graph saved t
    return t.new_empty(0).set_(t.untyped_storage(), 0, t.shape)


@settings(max_examples=200)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "drop", "hold", "end"]), st.integers(0, 5)),
        max_size=40,
    )
)
def test_the_pool_never_lends_memory_in_use_and_reuses_what_is_not(
    ops: list[tuple[str, int]],
) -> None:
    # What a step's tensors hold of the pool's buffers changes under it: a buffer comes
    # back only when nothing refers to its memory any more, whatever referred to it.
    pool = Pool()
    alive: list[tuple[int, int, Any]] = []  # (size, data_ptr, what holds it)
    most: dict[int, int] = {}  # size -> most buffers of it alive at once
    for op, k in ops:
        if op == "take":
            n = 4 + k % 2
            buf = pool.take(n, torch.float32, torch.device("cpu"))
            assert buf.numel() == n and buf.dtype == torch.float32
            assert all(buf.data_ptr() != ptr for _, ptr, _ in alive)
            alive.append((n, buf.data_ptr(), buf))
            del buf  # only `alive` holds it
            most[n] = max(most.get(n, 0), sum(1 for m, _, _ in alive if m == n))
            assert pool.nbytes() <= 4 * sum(m * c for m, c in most.items())
        elif op == "drop" and alive:
            alive.pop(k % len(alive))
        elif op == "hold" and alive:
            n, ptr, t = alive[k % len(alive)]
            if isinstance(t, torch.Tensor) and t.dim():  # not held some other way already
                alive[k % len(alive)] = (n, ptr, _holds(t, k % 3))
            del t
        elif op == "end":
            pool.reclaim()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_without_a_pool_one_rank_hands_the_burst_over_as_its_gradient(stage: int) -> None:
    # On one rank a burst's sum is the burst itself. A host burst is the pool's, so
    # stages 2-3 copy it out (they keep no gradient between steps); a device burst comes
    # from the caching allocator (nothing pooled) and becomes the gradient uncopied. The
    # device is played here by a pool that pools nothing: the reduce-scatters then get
    # no buffer to copy into, and the step still trains like one process.
    case = test_units.make_case([4, 6, 6, 3], 1, seed=11)
    expected = test_units.reference(case)
    units = ["layers.0", "layers.1", "layers.2"]
    original = fzero._comm.reduce_scatter_async

    def traced(mesh: fzero.Mesh, pooled: bool) -> Any:
        outs: list[bool] = []  # per reduce-scatter: whether it was given a buffer

        def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            outs.append(kwargs.get("out") is not None)
            return original(t, *args, **kwargs)

        fzero._comm.reduce_scatter_async = spy  # in this rank's own (forked) process
        if not pooled:
            Pool.take = lambda self, numel, dtype, device: torch.empty(numel, dtype=dtype)
            Pool.pools = lambda self, buf: False
        return test_units.train(mesh, case, units, stage, module=case["model"]), outs

    for pooled in (True, False):
        ((params, _ledger, _layout), outs), *_ = run(1, traced, pooled)
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{pooled=}")
        assert outs and all(given == pooled for given in outs), outs
