"""The four primitives by hand: shard/gather, reduce-scatter, and gather's VJP."""

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fzero
from fzero._core._tree import tree_flatten, tree_map
from tests.support import make_optimizer, make_params, mlp_loss, run

layouts = st.sampled_from(["flat", "tensor"])


def rank_tree(params: Any, rank: int) -> Any:
    """A per-rank gradient-like tree: different values on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return tree_map(lambda x: torch.randn(x.shape, generator=g, dtype=x.dtype), params)


@pytest.mark.slow
@pytest.mark.multiprocess
@given(st.integers(1, 8), st.lists(st.integers(1, 5), min_size=2, max_size=4), layouts)
def test_shard_then_gather_is_the_identity(n: int, dims: list[int], layout: str) -> None:
    params = make_params(dims, torch.float64, seed=sum(dims))

    def fn(mesh: fzero.Mesh) -> Any:
        state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, layout=layout)
        return fzero.gather_params(state.params, mesh)

    for gathered in run(n, fn):
        fzero.assert_trees_close(gathered, params, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.multiprocess
@given(st.integers(1, 8), st.lists(st.integers(1, 5), min_size=2, max_size=4), layouts)
def test_reduce_scatter_is_the_own_slice_of_the_mean(n: int, dims: list[int], layout: str) -> None:
    params = make_params(dims, torch.float64, seed=1)
    layout_ = fzero.build_layout(params, n, layout)
    per_rank = [rank_tree(params, r) for r in range(n)]
    mean = tree_map(lambda *xs: torch.stack(xs).sum(0) / n, *per_rank)

    def fn(mesh: fzero.Mesh) -> Any:
        shards = fzero.reduce_scatter_grads(per_rank[mesh.rank], layout_, mesh)
        return shards.buffers, fzero.gather_params(shards, mesh)

    for rank, (buffers, gathered) in enumerate(run(n, fn)):
        for got, want in zip(buffers, layout_.shard(mean, rank), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
        fzero.assert_trees_close(gathered, mean, rtol=1e-14, atol=1e-15)


def _rank_buffers(rank: int, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(k, generator=g, dtype=torch.float64).to(dtype) for k in sizes]


# Gloo's two reduce-scatters: one all-to-all (up to a byte bound), or point-to-point
# messages (above it); the bound moved so that test-sized buffers take either.
GLOO_PATHS = {"all-to-all": 1 << 30, "messages": 0}


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", list(GLOO_PATHS))
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reductions_in_flight_sum_every_rank_in_rank_order(
    n: int, dtype: torch.dtype, path: str
) -> None:
    # Several reduce-scatters started before any is waited on (stage 1's bursts), waited
    # newest first: each must pair with the same reduction on every peer (gloo sends them
    # as one all-to-all each, or as tagged point-to-point messages), leave its input
    # unwritten, and give exactly the left fold over ranks 0..n-1 of this rank's slice,
    # the order one process would add in.
    sizes = [6 * n, 2 * n, 40 * n]

    def fn(mesh: fzero.Mesh) -> Any:
        from fzero import _comm

        _comm._gloo.ALL_TO_ALL_MAX_BYTES = GLOO_PATHS[path]
        fulls = _rank_buffers(mesh.rank, sizes, dtype)
        kept = [f.clone() for f in fulls]
        started = [_comm.reduce_scatter_async(f, mesh) for f in fulls]
        for _, work in reversed(started):
            work.wait()
        untouched = all(torch.equal(f, k) for f, k in zip(fulls, kept))
        return [out for out, _ in started], untouched

    everyone = [_rank_buffers(r, sizes, dtype) for r in range(n)]
    for rank, (outs, untouched) in enumerate(run(n, fn)):
        assert untouched, f"rank {rank}: a reduce-scatter wrote into its input"
        for k, (size, out) in enumerate(zip(sizes, outs)):
            m = size // n
            want = everyone[0][k][rank * m : (rank + 1) * m].clone()
            for r in range(1, n):
                want = want + everyone[r][k][rank * m : (rank + 1) * m]
            assert out.dtype == dtype
            assert torch.equal(out, want), f"rank {rank}, buffer {k}: not the rank-order sum"


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", list(GLOO_PATHS))
@pytest.mark.parametrize("n", [2, 3])
def test_a_reduction_and_a_gather_pair_up_whichever_a_rank_starts_first(n: int, path: str) -> None:
    # A stage-3 backward may start a unit's re-gather before a reduction on one rank and
    # after it on another (each rank's graph decides when it needs the unit). Gloo pairs
    # a group's collectives by the order they start in: a reduction run as a collective on
    # the group the gathers use would pair with a peer's broadcast of the same size here,
    # and both would come back silently wrong.
    def fn(mesh: fzero.Mesh) -> Any:
        from fzero import _comm

        _comm._gloo.ALL_TO_ALL_MAX_BYTES = GLOO_PATHS[path]
        full = torch.arange(4.0 * n, dtype=torch.float64) * (mesh.rank + 1)
        shard = torch.full((4,), 100.0 + mesh.rank, dtype=torch.float64)
        if mesh.rank == 0:
            out, reduced = _comm.reduce_scatter_async(full, mesh)
            gathered, work = _comm.all_gather_async(shard, mesh)
        else:
            gathered, work = _comm.all_gather_async(shard, mesh)
            out, reduced = _comm.reduce_scatter_async(full, mesh)
        work.wait()
        reduced.wait()
        return out, gathered

    total = sum(range(1, n + 1))
    want_gathered = torch.cat([torch.full((4,), 100.0 + r, dtype=torch.float64) for r in range(n)])
    for rank, (out, gathered) in enumerate(run(n, fn)):
        assert torch.equal(out, torch.arange(4.0 * rank, 4.0 * rank + 4) * total)
        assert torch.equal(gathered, want_gathered)


@pytest.mark.multiprocess
def test_reductions_on_a_subgroup_mesh_stay_within_it() -> None:
    # Two meshes of 2 ranks in a world of 4: point-to-point messages address peers by
    # global rank, each group's all-to-alls run on its own twin group, and each group's
    # reductions pair only with its own members'.
    def fn(world: fzero.Mesh) -> Any:
        import torch.distributed as dist

        from fzero import _comm

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mesh = fzero.ProcessGroupMesh(groups[world.rank // 2])
        full = torch.arange(6, dtype=torch.float64) * (world.rank + 1)
        started = [_comm.reduce_scatter_async(full * k, mesh) for k in (1, 10)]
        for _, work in started:
            work.wait()
        return mesh.rank, [out for out, _ in started]

    for world_rank, (rank, outs) in enumerate(run(4, fn)):
        members = [0, 1] if world_rank < 2 else [2, 3]
        total = sum(torch.arange(6, dtype=torch.float64) * (m + 1) for m in members)
        assert rank == world_rank % 2
        for k, out in zip((1, 10), outs):
            assert torch.equal(out, (total * k)[3 * rank : 3 * rank + 3])


@pytest.mark.slow
@pytest.mark.multiprocess
@given(st.integers(1, 6), layouts, st.sampled_from(["autograd", "torch.func"]))
def test_gather_backward_is_reduce_scatter(n: int, layout: str, engine: str) -> None:
    params = make_params([3, 4, 2], torch.float64, seed=2)
    cotangents = [rank_tree(params, r) for r in range(n)]

    def fn(mesh: fzero.Mesh) -> Any:
        state = fzero.shard_state(params, fzero.optim.sgd(), mesh, stage=3, layout=layout)
        cot = tree_flatten(cotangents[mesh.rank])[0]

        def pairing(buffers: tuple) -> torch.Tensor:
            shards = fzero.Shards(buffers, state.layout, mesh.rank)
            full = tree_flatten(fzero.gather_params(shards, mesh))[0]
            return sum((a * c).sum() for a, c in zip(full, cot))

        buffers = state.params.buffers
        if engine == "torch.func":
            vjp = torch.func.grad(pairing)(buffers)
        else:
            leaves = tuple(b.detach().requires_grad_() for b in buffers)
            vjp = torch.autograd.grad(pairing(leaves), leaves)
        expected = fzero.reduce_scatter_grads(cotangents[mesh.rank], state.layout, mesh)
        return vjp, expected.buffers

    for vjp, expected in run(n, fn):
        for a, b in zip(vjp, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)


@pytest.mark.multiprocess
def test_sharded_update_by_hand_equals_the_stage_2_step() -> None:
    params = make_params([4, 3], torch.float64, seed=5)
    g = torch.Generator().manual_seed(5)
    batch = (
        torch.randn(2, 4, dtype=torch.float64, generator=g),
        torch.randn(2, 3, dtype=torch.float64, generator=g),
    )

    def fn(mesh: fzero.Mesh) -> Any:
        opt = fzero.optim.adam(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=2)
        _, grads = fzero.value_and_grad(mlp_loss, state.params, batch)
        grad_shard = fzero.reduce_scatter_grads(grads, state.layout, mesh)
        shard = fzero.local_shard(state.params, state.layout, mesh)
        shard, _ = fzero.sharded_update(opt, shard, grad_shard, state.opt_state)
        by_hand = fzero.gather_params(shard, mesh)
        stepped, _ = fzero.sharded_step(mlp_loss, opt, mesh, stage=2)(state, batch)
        return by_hand, stepped.params

    # To rounding: the step divides each rank's gradient by the world size before the sum
    # (as a 16-bit reduction must, not to overflow), `reduce_scatter_grads` divides the sum;
    # at 3 ranks the two differ in the last bit or two (measured up to 5.6e-17 here, over
    # random batches).
    # The independent reference: one process, torch.optim.Adam, on the batch every rank saw.
    leaves, treedef = tree_flatten(params)
    tensors = [x.clone().requires_grad_(True) for x in leaves]
    torch_opt = torch.optim.Adam(tensors, lr=0.1, foreach=False)
    mlp_loss(fzero._core._tree.tree_unflatten(treedef, tensors), batch).backward()
    torch_opt.step()
    want = fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])
    for by_hand, stepped in run(3, fn):
        fzero.assert_trees_close(stepped, want, rtol=1e-12, atol=1e-12)
        fzero.assert_trees_close(by_hand, stepped, rtol=1e-15, atol=1e-15)
        assert fzero._core._tree.max_abs_diff(stepped, params) > 1e-2  # the step moved them


@pytest.mark.multiprocess
def test_step_with_donate_false_does_not_modify_its_input_state() -> None:
    params = make_params([4, 3], torch.float64, seed=6)
    batch = (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))

    def fn(mesh: fzero.Mesh) -> bool:
        ok = True
        for stage in range(4):
            opt = fzero.optim.adamw(lr=0.1)
            state = fzero.shard_state(params, opt, mesh, stage=stage)
            before = tree_map(torch.clone, (state.params, state.opt_state))
            fzero.sharded_step(mlp_loss, opt, mesh, stage=stage, donate=False)(state, batch)
            after = (state.params, state.opt_state)
            ok &= all(
                torch.equal(a, b) for a, b in zip(tree_flatten(before)[0], tree_flatten(after)[0])
            )
        return ok

    assert all(run(2, fn))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["adamw", "momentum", "torch_rmsprop"])
@pytest.mark.parametrize("layout", ["flat", "tensor"])
def test_donating_step_updates_in_place_and_equals_the_pure_step(
    optimizer: str, layout: str
) -> None:
    params = make_params([4, 5, 3], torch.float64, seed=7)
    batches = [
        (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64))
        for _ in range(3)
    ]

    def storages(tree: Any) -> set[int]:
        return {
            x.untyped_storage().data_ptr()
            for x in tree_flatten(tree)[0]
            if isinstance(x, torch.Tensor) and x.numel()
        }

    def fn(mesh: fzero.Mesh) -> bool:
        ok = True
        for stage in range(4):
            opt = make_optimizer(optimizer)
            pure = fzero.shard_state(params, opt, mesh, stage=stage, layout=layout)
            kept = fzero.shard_state(params, opt, mesh, stage=stage, layout=layout)
            before = storages((kept.params, kept.opt_state))
            pure_step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage, donate=False)
            donating = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)
            for batch in batches:
                pure, _ = pure_step(pure, batch)
                kept, _ = donating(kept, batch)
            # The donated state lives in the very storages it started in (the optimizer
            # may add lazily created state, e.g. torch's "step" counters, but not copies).
            ok &= before <= storages((kept.params, kept.opt_state))
            same = [
                torch.equal(a, b)
                for a, b in zip(
                    tree_flatten((pure.params, pure.opt_state))[0],
                    tree_flatten((kept.params, kept.opt_state))[0],
                )
                if isinstance(a, torch.Tensor)
            ]
            ok &= all(same)
        return ok

    assert all(run(3, fn))


def gather_into_lower(mesh: fzero.Mesh, travel: torch.dtype | None) -> torch.Tensor:
    shard = torch.randn(5, generator=torch.Generator().manual_seed(mesh.rank), dtype=torch.float32)
    out = torch.empty(5 * mesh.size, dtype=torch.bfloat16)
    return fzero._comm.all_gather(shard, mesh, dtype=travel, out=out)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("travel", [None, torch.float16])
def test_an_all_gather_into_a_lower_dtype_gathers_each_shards_cast(
    n: int, travel: torch.dtype | None
) -> None:
    """Stage 3's fp32 masters gathered into bf16 buffers: every rank receives each rank's
    shard cast to bf16, as torch casts it (at one rank and on gloo by the copy into place,
    otherwise by a cast before it travels); with a travel dtype, cast to it straight from
    the masters and then to bf16, as stages 1-2 gather their updated masters."""
    want = []
    for r in range(n):
        x = torch.randn(5, generator=torch.Generator().manual_seed(r))
        want.append((x if travel is None else x.to(travel)).to(torch.bfloat16))
    for got in run(n, gather_into_lower, travel):
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.cat(want))
