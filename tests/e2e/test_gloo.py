"""Tier 2: parity and failure modes on spawned ranks over real torch.distributed (gloo)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fzero
from tests.engine import test_remat, test_tied, test_units
from tests.gloo_pool import GlooPool, GlooPoolError
from tests.state import test_frozen, test_precision
from tests.step import test_accumulate, test_buffers, test_clip, test_weights
from tests.support import (
    OPTIMIZERS,
    Case,
    cases,
    make_params,
    tolerance,
    train_fzero,
    train_reference,
)

pytestmark = pytest.mark.multiprocess

# Every function a pool runs is defined at module level: spawned ranks unpickle it by
# reference, importing this module by name from the parent's sys.path.

WORLD_SIZES = [2, 4]
STAGES = [0, 1, 2, 3]
LAYOUTS = ["flat", "tensor"]
# support.OPTIMIZERS minus torch_adamw: torch_rmsprop already covers the from_torch
# adapter, and every grid point costs a round trip on both world sizes.
PARITY_OPTIMIZERS = ["sgd", "momentum", "nesterov", "adam", "adamw", "torch_rmsprop"]
assert set(PARITY_OPTIMIZERS) <= set(OPTIMIZERS)
GRID = list(itertools.product(STAGES, LAYOUTS, PARITY_OPTIMIZERS))


class _Slot:
    """One world size's pool, respawned on demand after a failure killed it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.pool: GlooPool | None = None
        self.spawned = 0  # how many pools this slot has started

    def live(self) -> GlooPool:
        if self.pool is None or not self.pool.alive:
            self.pool = GlooPool(self.world_size, collective_timeout=30.0, call_timeout=120.0)
            self.spawned += 1
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def slot(request: pytest.FixtureRequest) -> Iterator[_Slot]:
    # Module scope: ranks are spawned once per world size for the whole module (pytest
    # runs all of one world size's tests, then tears that pool down before the next).
    s = _Slot(request.param)
    yield s
    s.close()


@pytest.fixture
def pool(slot: _Slot) -> GlooPool:
    """A live pool of the module's current world size (respawned if a test killed it)."""
    return slot.live()


# Hypothesis warns about function-scoped fixtures because they are not reset between
# examples; `pool` is only a getter for the module's pool, which examples share on purpose.
FEW_EXAMPLES = settings(
    max_examples=4,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _grid_case(world_size: int, stage: int, layout: str, optimizer: str) -> Case:
    """A deterministic case per grid point, cycling through odd shapes (1-wide layers too)."""
    index = GRID.index((stage, layout, optimizer))
    dims = [[3, 5, 2], [1, 4, 1, 3], [6, 1, 5], [2, 7, 3, 1]][index % 4]
    g = torch.Generator().manual_seed(1000 + index)
    steps, micro = 3, 2
    xs = torch.randn(steps, world_size * micro, dims[0], generator=g, dtype=torch.float64)
    ys = torch.randn(steps, world_size * micro, dims[-1], generator=g, dtype=torch.float64)
    params = make_params(dims, torch.float64, seed=index)
    return Case(params, xs, ys, world_size, optimizer, stage, layout)


def _assert_matches_reference(results: list[Any], case: Case, what: str) -> None:
    expected = train_reference(case)
    for rank, (params, _) in enumerate(results):
        fzero.assert_trees_close(
            params, expected, **tolerance(torch.float64), what=f"{what}, rank {rank}"
        )


# --- failures first: the pool they kill is respawned for the tests that follow ---------


class RankBoom(LookupError):
    """Raised on purpose on one rank; a distinct type shows types survive the trip."""


def _raise_on_last_rank(mesh: fzero.Mesh) -> int:
    if mesh.rank == mesh.size - 1:
        raise RankBoom(f"boom from rank {mesh.rank}")
    # The other ranks wait in a collective the failing rank never joins: the caller must
    # not wait for them (their collective timeout is 30 s).
    dist.barrier()
    return mesh.rank


def _rank(mesh: fzero.Mesh) -> int:
    return mesh.rank


@pytest.mark.slow
def test_a_rank_raising_reaches_the_caller_and_the_pool_is_respawned(slot: _Slot) -> None:
    pool = slot.live()
    last = pool.world_size - 1
    start = time.monotonic()
    with pytest.raises(RankBoom, match=f"boom from rank {last}") as info:
        pool.run(_raise_on_last_rank)
    assert time.monotonic() - start < 15.0, "the caller waited for the peers' timeout"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"rank {last} of {pool.world_size}" in notes
    assert "_raise_on_last_rank" in notes  # the remote traceback travelled too
    # The pool is dead (its ranks may be stuck mid-collective) and says so.
    assert not pool.alive
    with pytest.raises(GlooPoolError, match="dead"):
        pool.run(_rank)
    # The fixture's slot spawns a fresh pool that works.
    spawned = slot.spawned
    fresh = slot.live()
    assert fresh is not pool and slot.spawned == spawned + 1
    assert fresh.run(_rank) == list(range(pool.world_size))


def _shard_with_a_misshaped_leaf(mesh: fzero.Mesh, case: Case) -> tuple[str, str]:
    params = case.params
    if mesh.rank == mesh.size - 1:
        w = params["layers"][0]["w"]
        params = {
            **params,
            "layers": [
                {**params["layers"][0], "w": w.new_zeros(w.shape[0], w.shape[1] + 1)},
                *params["layers"][1:],
            ],
        }
    try:
        fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=case.stage)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def test_shard_state_rejects_a_misshaped_leaf_on_every_rank(pool: GlooPool) -> None:
    case = _grid_case(pool.world_size, 3, "flat", "sgd")
    errors = pool.run(_shard_with_a_misshaped_leaf, case)
    last = pool.world_size - 1
    for rank, (kind, message) in enumerate(errors):
        assert kind == "ValueError", f"rank {rank}: {kind} {message}"
        assert "layers.0.w" in message and f"rank {last}" in message, f"rank {rank}: {message}"
    # Every rank left the check in step: the same pool still trains correctly.
    _assert_matches_reference(pool.run(train_fzero, case), case, "after a rejected shard_state")


def _train_from_rank_dependent_init(mesh: fzero.Mesh, case: Case) -> tuple[Any, list[float]]:
    # As if every rank seeded its model differently: only rank 0 keeps case.params.
    if mesh.rank != 0:
        dims = [case.params["layers"][0]["w"].shape[0]]
        dims += [layer["w"].shape[1] for layer in case.params["layers"]]
        params = make_params(dims, torch.float64, seed=10_000 + mesh.rank)
        case = dataclasses.replace(case, params=params)
    return train_fzero(mesh, case)


@pytest.mark.parametrize("stage", STAGES)
def test_ranks_with_different_initial_values_train_rank_0s(pool: GlooPool, stage: int) -> None:
    case = _grid_case(pool.world_size, stage, "flat", "adam")
    results = pool.run(_train_from_rank_dependent_init, case)
    _assert_matches_reference(results, case, f"stage {stage} from rank 0's init")


# --- parity with one process training on the whole batch ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "layout", "optimizer"), GRID)
def test_every_stage_layout_and_optimizer_matches_single_process(
    pool: GlooPool, stage: int, layout: str, optimizer: str
) -> None:
    case = _grid_case(pool.world_size, stage, layout, optimizer)
    _assert_matches_reference(
        pool.run(train_fzero, case), case, f"stage {stage} {layout} {optimizer}"
    )


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("reshard", [True, False])
def test_units_with_module_hooks_match_single_process(
    pool: GlooPool, stage: int, reshard: bool
) -> None:
    # One layer called twice, one checkpointed, one never called: the just-in-time path.
    case = test_units.make_case([3, 4, 4, 4, 2], pool.world_size, seed=5, twice=1, remat=2)
    units = [f"layers.{i}" for i in range(4)] + ["unused"]
    expected = test_units.reference(case)
    options = {"module": case["model"], "reshard_after_forward": reshard}
    for params, _, _ in pool.run(test_units.train, case, units, stage, **options):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")


@FEW_EXAMPLES
@given(data=st.data())
def test_drawn_unit_splits_with_module_hooks_match_single_process(
    pool: GlooPool, data: st.DataObject
) -> None:
    dims = data.draw(st.lists(st.integers(1, 5), min_size=2, max_size=4), label="dims")
    units = data.draw(test_units.unit_splits(len(dims) - 1), label="units")
    stage = data.draw(st.sampled_from(STAGES), label="stage")
    reshard, prefetch = data.draw(st.booleans()), data.draw(st.booleans())
    case = test_units.make_case(dims, pool.world_size, seed=len(dims))
    expected = test_units.reference(case)
    options = {"module": case["model"], "reshard_after_forward": reshard, "prefetch": prefetch}
    for params, _, _ in pool.run(test_units.train, case, units, stage, **options):
        what = f"stage {stage} units {units} {options}"
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=what)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_training_loop_features_on_real_gloo(pool: GlooPool, stage: int) -> None:
    # Issue-5 features on real ranks: the global clipping norm (a scalar all-reduce) with a
    # decay mask, local accumulation, frozen leaves, tied weights, remat, synced buffers.
    n = pool.world_size
    g = torch.Generator().manual_seed(stage)
    case = Case(
        make_params([3, 4, 2], torch.float64, stage),
        torch.randn(2, 3 * n, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 3 * n, 2, generator=g, dtype=torch.float64),
        world_size=n,
        optimizer="adamw",
        stage=stage,
        layout="flat",
    )
    expected, norms = test_clip.reference(case, "adamw")
    for params, got in pool.run(test_clip.train, case, "adamw", "predicate"):
        assert got == pytest.approx(norms, rel=1e-12)
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64))

    case.xs = torch.randn(2, n * test_accumulate.K, 3, generator=g, dtype=torch.float64)
    case.ys = torch.randn(2, n * test_accumulate.K, 2, generator=g, dtype=torch.float64)
    expected = train_reference(case)
    for params, _ in pool.run(test_accumulate.train, case, "local"):
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64))

    frozen_case = test_units.make_case([3, 4, 4, 2], n, seed=9)
    expected = test_frozen.reference(frozen_case)
    for params, *_ in pool.run(test_frozen.train, frozen_case, stage, "prefixes", stage >= 2):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)

    expected = test_tied.reference(n)
    for params in pool.run(test_tied.train, stage, stage >= 2):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)

    expected = test_remat.reference(n)
    for params, *_ in pool.run(test_remat.train, "inside", stage):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)

    expected, buffers = test_buffers.reference("mean", n)
    for rank, (params, got) in enumerate(pool.run(test_buffers.train, stage, "mean")):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        fzero.assert_trees_close(got, buffers[rank], rtol=1e-12, atol=1e-14)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_and_loss_scaling_on_real_gloo(pool: GlooPool, stage: int) -> None:
    """bfloat16 and float16 (with a loss scaler) over float32 masters, reduced in float32,
    then an inf in the last rank's batch: every rank skips that step, and training still
    matches one process doing the same casts with torch.amp.GradScaler. Tolerance: bitwise
    on 2 ranks; float32 summation order on 4 (see test_precision)."""
    n = pool.world_size
    atol = 0.0 if n <= 2 else 1e-5
    xs, ys = test_precision.data(n, 3)
    for pdt in (torch.bfloat16, torch.float16):
        scale = pdt == torch.float16
        ref = test_precision.reference(xs, ys, pdt, torch.float32, scale=scale)
        kw = {"pdt": pdt, "rdt": torch.float32, "scale": scale, "hooks": stage == 3}
        for got in pool.run(test_precision.train, xs, ys, stage, **kw):
            test_precision.close(got["masters"], ref["masters"], rtol=0, atol=atol)
    xs, ys = test_precision.data(n, 5, inf_at=(1, n - 1))
    ref = test_precision.reference(xs, ys, torch.float16, torch.float32, scale=True)
    for states in pool.run(test_precision.probe, xs, ys, stage):
        assert [s["step"] for s in states] == [0, 1, 1, 2, 3, 4]
        test_precision.close(states[-1]["masters"], ref["masters"], rtol=0, atol=atol)


@FEW_EXAMPLES
@given(data=st.data())
def test_random_trees_match_single_process(pool: GlooPool, data: st.DataObject) -> None:
    # Explicit optimizers: other test modules may add entries to support.OPTIMIZERS in
    # this process that the freshly imported support module on the ranks does not have.
    strategy = cases(
        world_sizes=st.just(pool.world_size), optimizers=st.sampled_from(PARITY_OPTIMIZERS)
    )
    case = data.draw(strategy)
    _assert_matches_reference(
        pool.run(train_fzero, case), case, f"stage {case.stage} {case.layout} {case.optimizer}"
    )


# --- a rank that dies, a call that overruns: raised, never hung (these kill the pool) -----


def _exit_on_last_rank(mesh: fzero.Mesh) -> int:
    if mesh.rank == mesh.size - 1:
        os._exit(7)  # no exception, no reply: the process is simply gone
    dist.barrier()
    return mesh.rank


def _sleep_on_rank_0(mesh: fzero.Mesh, seconds: float) -> int:
    if mesh.rank == 0:
        time.sleep(seconds)
    return mesh.rank


@pytest.mark.slow
def test_a_stuck_or_dying_rank_raises_instead_of_hanging(slot: _Slot) -> None:
    # Both kill the pool, so each size's last test checks one of them and no respawn
    # (~4 s of CPU per rank) follows: a stuck rank on 2 ranks, a dying rank on 4.
    pool = slot.live()
    if slot.world_size == 2:
        pool.run(_rank)  # a first call imports this module on the ranks: keep it out of the limit
        pool.call_timeout = 3.0
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
            pool.run(_sleep_on_rank_0, 60.0)
        assert time.monotonic() - start < 15.0
    else:
        with pytest.raises(GlooPoolError, match=rf"rank {slot.world_size - 1} died \(exit 7\)"):
            pool.run(_exit_on_last_rank)
    assert not pool.alive


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_rank_out_of_data_one_step_early_on_real_gloo(pool: GlooPool, stage: int) -> None:
    """Token-weighted losses; the last rank has no batch on the last step and calls
    step(state, None): no hang, and every rank ends where one process on all the tokens
    does. Just-in-time units, so that rank follows last step's gathers at stage 3."""
    n = pool.world_size
    sizes = [[[2] for _ in range(n)] for _ in range(3)]
    sizes[-1][-1] = [0]
    params = make_params(test_weights.DIMS, torch.float64, 4)
    data = test_weights.make_data(sizes, seed=5)
    expected = test_weights.reference(params, data, "pair", "adam")
    results = pool.run(test_weights.train, params, data, "pair", "adam", stage, None, True)
    for got, losses, warned in results:
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
        assert losses == results[0][1] and warned == 0
