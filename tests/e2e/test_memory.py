"""Bytes each rank keeps per stage, measured on the real tensors, against the ZeRO formula."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from fzero._core._tree import tree_nbytes
from tests.support import (
    least_live,
    make_params,
    map_every_allocation,
    mlp_loss,
    peak_rss_rise,
    run,
)

N = 4
PARAMS = make_params([64, 96, 80, 10], torch.float32, seed=0)
PSI = sum(x.numel() for x in fzero._core._tree.tree_flatten(PARAMS)[0])
BATCH = (torch.randn(8, 64), torch.randn(8, 10))


def measure(mesh: fzero.Mesh, stage: int) -> dict[str, int]:
    opt = fzero.optim.adam(lr=1e-3)
    # The allocator's record, not fzero's accounting.
    state, live = least_live(lambda: fzero.shard_state(PARAMS, opt, mesh, stage=stage))
    state, _ = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)(state, BATCH)
    report = fzero.memory_report(state)
    # The gradient a stage keeps is what its reduction hands the update: the full
    # all-reduced tree (stages 0-1) or this rank's reduce-scattered shard (stages 2-3).
    _, grads = fzero.value_and_grad(mlp_loss, fzero.gather_params(state.params, mesh), BATCH)
    if stage < 2:
        kept_grads = fzero.all_reduce_grads(grads, mesh)
    else:
        kept_grads = fzero.reduce_scatter_grads(grads, state.layout, mesh)
    return {
        "params": report.params,
        "grads": tree_nbytes(kept_grads),
        "opt_state": report.opt_state,
        "count": tree_nbytes(state.opt_state.count),
        "allocated": live,  # what shard_state left alive
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_bytes_match_the_formula(stage: int) -> None:
    # fp32 Adam: 4-byte params and grads, 8 bytes of moments per parameter.
    want = fzero.estimate_memory(PSI, N, stage, param_bytes=4, grad_bytes=4, optim_bytes=8)
    pad = 4 * N  # fewer than N padding elements of 4 bytes per flat buffer (one bucket here)
    for got in run(N, measure, stage):
        assert want.params <= got["params"] < want.params + pad
        assert want.grads <= got["grads"] < want.grads + pad
        moments = got["opt_state"] - got["count"]  # the step counter is 8 bytes, not per-parameter
        assert want.opt_state <= moments < want.opt_state + 2 * pad
        # Measured on the allocator: what shard_state leaves alive is the formula's
        # parameters and moments, but for the step counter and, now and then, a few KB
        # that are not fzero's tensors (measured: +8 B, once +2.2 KB). A second copy of
        # any part (at stage 3 the parameter shard, 4 x 14810 / 4 B = 14.8 KB) fails it.
        kept = want.params + want.opt_state
        assert kept <= got["allocated"] < kept + kept // 50 + 8192, (got["allocated"], kept)


def test_estimate_memory_is_the_zero_paper_table() -> None:
    # ZeRO, section 5: Psi = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    psi = 7.5e9
    totals = [fzero.estimate_memory(psi, 64, s).total / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], rel=0.01)


def test_memory_report_counts_shared_storage_once() -> None:
    flat = torch.zeros(10)
    tree = {"a": flat[:4], "b": flat[4:]}
    assert tree_nbytes(tree) == 40
    assert tree_nbytes({"a": torch.zeros(3), "b": torch.zeros(3)}) == 24


@pytest.mark.multiprocess
def test_memory_report_counts_the_buffers_and_the_scaler() -> None:
    # A rotary table or a causal mask is a state's too: the report left buffers out.
    def fn(mesh: fzero.Mesh) -> Any:
        buffers = {"mask": torch.ones(256, 256), "steps": torch.zeros((), dtype=torch.int64)}
        state = fzero.shard_state(
            PARAMS,
            fzero.optim.sgd(),
            mesh,
            stage=3,
            buffers=buffers,
            precision=fzero.Precision(param_dtype=torch.float16),
            loss_scale=fzero.DynamicLossScale(),
        )
        scaler = state.scaler.scale.nbytes + state.scaler.growth_tracker.nbytes
        return fzero.memory_report(state), 256 * 256 * 4 + 8 + scaler

    for report, want in run(2, fn):
        assert report.buffers == want
        assert report.total == report.params + report.opt_state + want


@pytest.mark.multiprocess
def test_stage_3_keeps_a_quarter_of_the_parameters_at_four_ranks() -> None:
    def fn(mesh: fzero.Mesh) -> Any:
        return [
            fzero.memory_report(fzero.shard_state(PARAMS, fzero.optim.sgd(), mesh, stage=s)).params
            for s in (0, 3)
        ]

    for full, sharded in run(N, fn):
        assert full == 4 * PSI + 4 * (-PSI % N) and sharded * N == full


# --- what a step allocates on top of the state, measured on the process ------------------

WIDTH, DEPTH = 1024, 16  # the MLP of issue 16: B = 16 x (1024^2 + 1024) x 4 bytes = 67 MB


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _step_rise(mesh: fzero.Mesh, stage: int, entry: str) -> list[float]:
    """Over three warm steps, in units of B (the model's fp32 bytes): the peak resident
    bytes each allocates above the state it starts from, and what the step function
    keeps between calls (resident bytes before each step above those before the first)."""
    map_every_allocation()
    torch.manual_seed(0)
    model = _MLP()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model_bytes = sum(v.numel() * 4 for v in params.values())

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    def pure_loss(p: dict, batch: tuple) -> torch.Tensor:  # no module: the JAX way
        x, y = batch
        for i in range(DEPTH):
            layer = fzero.gathered(p, f"layers.{i}")
            x = torch.tanh(torch.nn.functional.linear(x, layer["weight"], layer["bias"]))
        return ((x - y) ** 2).mean()

    # What any process keeps once it has trained (autograd's, the BLAS's buffers: 0.6 B
    # on one host) set up first by a step of plain torch, so that what is measured
    # below is fzero's.
    warm = {k: v.clone().requires_grad_() for k, v in params.items()}
    plain = torch.optim.Adam(warm.values())
    loss_fn(warm, (torch.randn(4, WIDTH), torch.randn(4, WIDTH))).backward()
    plain.step()
    del warm, plain
    opt = fzero.optim.adam(lr=1e-3)
    units = [f"layers.{i}" for i in range(DEPTH)]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    del params
    compiled = entry.startswith("compiled")
    hooked = entry in ("module", "compiled, module")
    step = fzero.sharded_step(
        loss_fn if hooked or entry == "upfront" else pure_loss,
        opt,
        mesh,
        stage=stage,
        module=model if hooked else None,
        just_in_time=not hooked and (entry == "gathered" or compiled),
        reshard_after_forward=entry != "compiled, kept",
        compile="aot_eager" if compiled else False,
    )
    g = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g))
    with peak_rss_rise() as first:
        state, _ = step(state, batch)  # warm: whatever a first step sets up once
    if compiled:
        # The compiler's own memory (its graphs, generated code, caches: 1.8 B of this
        # 16-unit MLP's, and no tensor) is the first step's: counted from after it.
        with peak_rss_rise() as first:
            pass
    rises, kept = [], []
    for _ in range(3):
        with peak_rss_rise() as m:
            state, _ = step(state, batch)
        rises.append(m["rise"] / model_bytes)
        kept.append((m["before"] - first["before"]) / model_bytes)
    return rises, kept


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["module", "gathered", "compiled", "compiled, module"])
@pytest.mark.parametrize("stage", [2, 3])
def test_per_unit_steps_allocate_a_few_units_beyond_the_shard_gradient(
    stage: int, entry: str
) -> None:
    """Measured on the rank processes (resident memory, every large allocation its own
    mapping): on 2 ranks a step of a 16-unit MLP allocates the rank's shard gradient (B/2)
    plus a few units (B/16 each) of full parameters and gradients in flight. Gathering
    every unit before the forward (no module hooks, no just-in-time entry) keeps all full
    gradients alive until the backward ends, and at stage 3 all full parameters too: at
    least one B more, which the same bound must reject (or it could not fail). Units
    enter through module hooks, or through fzero.gathered in a loss over the bare dict,
    eagerly or compiled ("compiled": the gathers inside the traced graph where the loss
    asks, each recomputed for its backward; "compiled, module": where each submodule
    runs, its hooks traced; kept from the forward instead, as the
    compiler otherwise would, every full parameter stays: the second control).
    What the step function keeps between calls (`fzero._engine._pool`: a few units' buffers)
    stays within eight units."""
    bound = 0.5 + 5 / DEPTH  # shard gradient + 5 units (gathered, prefetched, gradients)
    for rises, kept in run(2, _step_rise, stage, entry):
        assert max(rises) <= bound, f"stage {stage}, {entry}: {rises} x B > {bound}"
        # Between steps the pool keeps the few units' buffers it reuses (`fzero._engine._pool`:
        # gathered, prefetched, kept last, bursts), not one per unit, and no gradient
        # (what any process keeps once it has trained is set up before, by plain torch).
        rest = 8 / DEPTH
        assert max(kept) <= rest, f"stage {stage}, {entry}: kept {kept} x B > {rest}"
    if entry == "module":  # the control, once per stage
        for rises, _ in run(2, _step_rise, stage, "upfront"):
            assert min(rises) > bound + 0.15, f"stage {stage}, up front: {rises} x B"
    if entry == "compiled" and stage == 3:
        for rises, _ in run(2, _step_rise, stage, "compiled, kept"):
            assert min(rises) > bound + 0.15, f"compiled, gathers kept: {rises} x B"


def _cyclic_garbage(mesh: fzero.Mesh, stage: int, entry: str) -> int:
    """Objects a warm step leaves in reference cycles (freed only by the cyclic GC)."""
    import gc

    from tests.engine.test_gathered import gathered_mlp_loss
    from tests.support import make_params

    params = make_params([3, 4, 4, 2], torch.float64, seed=0)
    opt = fzero.optim.adam(lr=0.01)
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    step = fzero.sharded_step(
        gathered_mlp_loss if entry == "gathered" else mlp_loss,
        opt,
        mesh,
        stage=stage,
        just_in_time=entry == "gathered",
    )
    batch = (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64))
    state, _ = step(state, batch)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        state, _ = step(state, batch)
        found = gc.collect()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["upfront", "gathered"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_leaves_no_reference_cycles(stage: int, entry: str) -> None:
    # A step pauses the cyclic collector while it runs, so whatever it frees must go by
    # reference counting: a cycle through a step's engine kept the previous step's shard
    # gradients (0.5 B at stage 2) alive until the next full collection.
    for found in run(2, _cyclic_garbage, stage, entry):
        assert found == 0, f"stage {stage}, {entry}: {found} objects in reference cycles"
