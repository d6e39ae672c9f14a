"""On a CUDA device: stages 0-3, clipping, loss scaling, checkpoints and memory reports.

These run where torch sees a GPU (`benchmarks/gpu.py` measures there too) and are
skipped, saying so, where it does not: CI has no GPU. World size 1 runs on NCCL in this
process; world size 2 shares the one GPU between two simulated ranks over gloo.
"""

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fzero
from tests.support import Case, make_params, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device here: the GPU tests run on a machine with one",
    ),
]

MAX_NORM = 0.3
CUDA = torch.device("cuda", 0)


def loss_fn(params: dict[str, Any], batch: Any) -> torch.Tensor:
    x, y = batch
    h = x
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return ((h * params["scale"] + params["shift"] - y) ** 2).mean()


def make_case(steps: int = 3, inf_at: int | None = None) -> Case:
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(steps, 8, 4, generator=g, dtype=torch.float64)
    ys = torch.randn(steps, 8, 3, generator=g, dtype=torch.float64)
    if inf_at is not None:
        xs[inf_at, 0, 0] = float("inf")
    return Case(make_params([4, 6, 5, 3], torch.float64, 3), xs, ys, world_size=2)


def reference(case: Case, skip: tuple[int, ...] = (), clip: bool = True) -> dict[str, Any]:
    """torch.optim.Adam with clip_grad_norm_ (`clip`) on one process, on the GPU, whole
    batches."""
    leaves, treedef = fzero._core._tree.tree_flatten(case.params)
    tensors = [x.detach().clone().to(CUDA).requires_grad_() for x in leaves]
    opt = torch.optim.Adam(tensors, lr=0.05, foreach=False)
    for t in range(case.xs.shape[0]):
        if t in skip:
            continue
        opt.zero_grad()
        batch = (case.xs[t].to(CUDA), case.ys[t].to(CUDA))
        loss_fn(fzero._core._tree.tree_unflatten(treedef, tensors), batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(tensors, MAX_NORM, foreach=False)
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def optimizer() -> fzero.optim.Optimizer:
    return fzero.optim.chain(fzero.optim.clip_by_global_norm(MAX_NORM), fzero.optim.adam(lr=0.05))


def on_cuda(tree: Any) -> Any:
    return fzero._core._tree.tree_map(lambda x: x.to(CUDA), tree)


def on_cpu(tree: Any) -> Any:
    return fzero._core._tree.tree_map(lambda x: x.cpu(), tree)


def devices(tree: Any) -> set[str]:
    return {
        x.device.type
        for x in fzero._core._tree.tree_flatten(tree)[0]
        if isinstance(x, torch.Tensor)
    }


def train(mesh: fzero.Mesh, case: Case, stage: int, scale: bool = False) -> Any:
    opt = optimizer()
    units = ["layers.0", "layers.1", "layers.2"]
    loss_scale = fzero.DynamicLossScale(init_scale=2.0**4) if scale else None
    state = fzero.shard_state(
        on_cuda(case.params), opt, mesh, stage=stage, units=units, loss_scale=loss_scale
    )
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units)
    n = case.xs.shape[1] // mesh.size
    for t in range(case.xs.shape[0]):
        rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
        state, loss = step(state, (case.xs[t, rows].to(CUDA), case.ys[t, rows].to(CUDA)))
    assert loss.device.type == "cuda"
    state_devices = devices((state.params, state.master, state.buffers, state.scaler))
    return on_cpu(fzero.gather_params(state.params, mesh)), (state_devices, state.step)


@pytest.fixture
def nccl_mesh(tmp_path: Any) -> Iterator[fzero.Mesh]:
    """A world of one on NCCL, in this process."""
    torch.cuda.set_device(CUDA)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield fzero.ProcessGroupMesh()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stages_match_torch_on_nccl(nccl_mesh: fzero.Mesh, stage: int) -> None:
    assert nccl_mesh.device == CUDA and nccl_mesh.backend == "nccl"
    case = make_case()
    want = on_cpu(reference(case))
    params, (where, _) = train(nccl_mesh, case, stage)
    assert where == {"cuda"}
    fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))
    assert fzero._core._tree.max_abs_diff(params, make_case().params) > 1e-3  # it trained


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_ranks_sharing_the_gpu_over_gloo_match_torch(stage: int) -> None:
    case = make_case()
    sim = fzero.Simulation(2, collective_timeout=60, timeout=300, device="cuda")
    want = on_cpu(reference(case))
    for params, (where, _) in sim.run(train, case, stage):
        assert where == {"cuda"}
        fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))


@pytest.mark.parametrize("stage", [1, 3])
def test_loss_scaling_skips_a_non_finite_step_on_cuda(stage: int) -> None:
    case = make_case(steps=4, inf_at=1)  # rank 0's batch of step 1 holds an inf
    sim = fzero.Simulation(2, collective_timeout=60, timeout=300, device="cuda")
    want = on_cpu(reference(case, skip=(1,)))
    for params, (where, steps) in sim.run(train, case, stage, True):
        assert where == {"cuda"} and steps == 3
        fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))


def steps_without_host_sync(step: Any, state: Any, batches: list[Any]) -> Any:
    """Steps on `batches`: the first builds what later steps reuse, and the rest run
    with torch raising on any synchronizing CUDA call ("error" mode)."""
    state, _ = step(state, batches[0])
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for b in batches[1:]:
            state, _ = step(state, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return state


# Setting the mode warns that it is a prototype; with warnings as errors, that warning
# would raise after the mode is set, leaving it on for every later test.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_never_makes_the_host_wait_for_the_gpu(nccl_mesh: fzero.Mesh, stage: int) -> None:
    # Without a loss scaler (whose inf flag is the one read a step makes), clipping
    # included: torch raises on any synchronizing CUDA call in "error" mode.
    case = make_case()
    opt, units = optimizer(), ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(on_cuda(case.params), opt, nccl_mesh, stage=stage, units=units)
    step = fzero.sharded_step(loss_fn, opt, nccl_mesh, stage=stage, units=units)
    batches = [(case.xs[t].to(CUDA), case.ys[t].to(CUDA)) for t in range(3)]
    state = steps_without_host_sync(step, state, batches)
    assert state.step == 3


@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.parametrize(
    "stage, reshard, bf16",
    [(0, True, False), (1, True, True), (2, True, False), (3, True, False), (3, False, True)],
)
def test_a_module_hooked_step_never_makes_the_host_wait_for_the_gpu(
    nccl_mesh: fzero.Mesh, stage: int, reshard: bool, bf16: bool
) -> None:
    # The path a module's users take: units entered through `module=` hooks (stage 3
    # resharding after the forward, or keeping), bf16 `Precision`, torch's fused AdamW.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 2)
    ).to(CUDA)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    units = ["0", "2", "3"]
    precision = fzero.Precision(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    opt = fzero.optim.from_torch(torch.optim.AdamW, lr=1e-2, fused=True)
    state = fzero.shard_state(params, opt, nccl_mesh, stage=stage, units=units, precision=precision)

    def loss(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        x, y = batch  # the input in the parameters' compute dtype
        out = torch.func.functional_call(model, p, (x.to(torch.bfloat16 if bf16 else x.dtype),))
        return ((out.float() - y) ** 2).mean()

    step = fzero.sharded_step(
        loss,
        opt,
        nccl_mesh,
        stage=stage,
        units=units,
        module=model,
        reshard_after_forward=reshard,
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 8, generator=g).to(CUDA), torch.randn(4, 2, generator=g).to(CUDA))
        for _ in range(3)
    ]
    state = steps_without_host_sync(step, state, batches)
    assert state.step == 3
    moved = fzero._core._tree.max_abs_diff(
        on_cpu(fzero.gather_params(state.params, nccl_mesh)), on_cpu(params)
    )
    assert moved > 1e-3


def test_a_checkpoint_round_trips_on_the_device(nccl_mesh: fzero.Mesh, tmp_path: Any) -> None:
    case = make_case()
    want = on_cpu(reference(case))
    opt = optimizer()
    state = fzero.shard_state(on_cuda(case.params), opt, nccl_mesh, stage=3)
    step = fzero.sharded_step(loss_fn, opt, nccl_mesh, stage=3)
    state, _ = step(state, (case.xs[0].to(CUDA), case.ys[0].to(CUDA)))
    fzero.checkpoint.save(state, str(tmp_path / "ckpt"), nccl_mesh)
    loaded = fzero.checkpoint.load(str(tmp_path / "ckpt"), nccl_mesh, opt, case.params, stage=1)
    assert devices(loaded.params) == {"cuda"} and devices(loaded.opt_state[1].mu) == {"cuda"}
    resumed = fzero.sharded_step(loss_fn, opt, nccl_mesh, stage=1)
    for t in range(1, case.xs.shape[0]):
        loaded, _ = resumed(loaded, (case.xs[t].to(CUDA), case.ys[t].to(CUDA)))
    got = on_cpu(fzero.gather_params(loaded.params, nccl_mesh))
    fzero._core._tree.assert_trees_close(got, want, **tolerance(torch.float64))


def test_memory_report_reads_the_cuda_allocator(nccl_mesh: fzero.Mesh) -> None:
    torch.cuda.reset_peak_memory_stats(CUDA)
    params = on_cuda(make_params([256, 512, 256], torch.float32, 0))
    state = fzero.shard_state(params, fzero.optim.adam(lr=0.01), nccl_mesh, stage=2)
    report = fzero.memory_report(state)
    assert report.device == CUDA and report.params == sum(
        p.numel() * 4 for p in fzero._core._tree.tree_flatten(params)[0]
    )
    assert report.peak_allocated >= report.allocated >= report.total
    assert report.reserved >= report.allocated


def bf16_stage_3_held(
    mesh: fzero.Mesh, opt: fzero.optim.Optimizer, offload: Any = None
) -> tuple[int, int, Any]:
    """Two bf16 stage-3 steps at one rank: the bytes the caching allocator holds after
    them beyond the input parameters, the parameter count, and the state."""
    params = on_cuda(make_params([256, 512, 256], torch.float32, 0))
    psi = sum(p.numel() for p in fzero._core._tree.tree_flatten(params)[0])
    prec = fzero.Precision(torch.bfloat16, reduce_dtype=torch.float32)
    bf16 = torch.bfloat16

    def loss(p: dict[str, Any], batch: Any) -> torch.Tensor:
        x, y = batch
        return loss_fn(p, (x.to(bf16), y.to(bf16))).float()

    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 256, generator=g).to(CUDA), torch.randn(8, 256, generator=g).to(CUDA))
        for _ in range(2)
    ]
    # cuBLAS takes its workspace from the caching allocator at its first use, and keeps
    # it: taken here, before measuring, by the same bf16 forward and backward.
    warm = fzero._core._tree.tree_map(lambda x: x.to(bf16).requires_grad_(), params)
    loss(warm, batches[0]).backward()
    del warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    state = fzero.shard_state(params, opt, mesh, stage=3, precision=prec, offload=offload)
    step = fzero.sharded_step(loss, opt, mesh, stage=3)
    for batch in batches:
        state, _ = step(state, batch)
    del batch
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated(CUDA) - before
    moved = fzero._core._tree.max_abs_diff(on_cpu(fzero.master_params(state, mesh)), on_cpu(params))
    assert moved > 1e-3
    return held, psi, state


def test_stage_3_bf16_state_allocates_12_bytes_a_parameter(nccl_mesh: fzero.Mesh) -> None:
    """What the caching allocator holds for a stage-3 bf16 state after a step, beyond the
    input parameters: the fp32 master shard (which is also what is gathered, cast) and
    AdamW's two fp32 moments, 12 bytes a parameter at one rank. Not 14: no bf16 shard
    beside the master (FSDP2's layout). Gradients and gathered units are freed."""
    opt = fzero.optim.from_torch(torch.optim.AdamW, lr=1e-2, fused=True)
    held, psi, _ = bf16_stage_3_held(nccl_mesh, opt)
    # AdamW's step counts and the allocator's 512-byte rounding: a few KiB at most.
    assert 12 * psi <= held <= 12 * psi + 64 * 1024, (held, psi)


def train_offloaded(
    mesh: fzero.Mesh, case: Case, stage: int, offload: Any, compiled: bool = False
) -> Any:
    opt = optimizer()
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(
        on_cuda(case.params), opt, mesh, stage=stage, units=units, offload=offload
    )
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units, compile=compiled)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, (case.xs[t].to(CUDA), case.ys[t].to(CUDA)))
    return state


@pytest.mark.parametrize("stage, params", [(1, False), (2, False), (3, False), (3, True)])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_stages_match_torch_on_nccl(
    nccl_mesh: fzero.Mesh, stage: int, params: bool, tier: str, tmp_path: Any, monkeypatch: Any
) -> None:
    """The masters and moments on the host (pinned) or on disk, the parameters (with
    `params`, their stage-3 shards on the host too, copied over for each gather) and the
    gradients on the GPU (reduced there: NCCL cannot reduce host memory, and a stage 1-2
    gradient once followed its master to the host): the same training as torch's on the
    GPU (float64)."""
    from fzero._engine import _reductions

    case = make_case()
    want = on_cpu(reference(case))
    directory = str(tmp_path) if tier == "disk" else None
    offload = fzero.Offload(tier, 1.0, directory, params=params)
    placed: list[str] = []
    born = _reductions.Reductions.__init__

    def spy(self: Any, ctx: Any, devices: Any, *args: Any, **kw: Any) -> None:
        placed.extend(d.type for d in devices)
        born(self, ctx, devices, *args, **kw)

    monkeypatch.setattr(_reductions.Reductions, "__init__", spy)
    state = train_offloaded(nccl_mesh, case, stage, offload)
    assert placed and set(placed) == {"cuda"}, placed
    assert devices(state.params) == {"cpu" if params else "cuda"}
    assert devices(state.master) == {"cpu"}
    if tier == "host":
        assert all(x.is_pinned() for x in state.master.buffers if x.numel())
    if params:
        assert all(x.is_pinned() for x in state.params.buffers if x.numel())
    got = on_cpu(fzero.master_params(state, nccl_mesh))
    fzero._core._tree.assert_trees_close(got, want, **tolerance(torch.float64))
    assert fzero._core._tree.max_abs_diff(got, case.params) > 1e-3


def test_an_offloaded_bf16_stage_3_state_holds_2_bytes_a_parameter_on_the_gpu(
    nccl_mesh: fzero.Mesh,
) -> None:
    """Measured by the caching allocator: with the fp32 masters and AdamW's moments on the
    host, the GPU keeps the bf16 parameter shard alone between steps (12 bytes a parameter
    without offload, `test_stage_3_bf16_state_allocates_12_bytes_a_parameter`)."""
    opt = fzero.optim.adamw(lr=1e-2)
    held, psi, state = bf16_stage_3_held(nccl_mesh, opt, fzero.Offload("host"))
    assert 2 * psi <= held <= 2 * psi + 64 * 1024, (held, psi)
    assert fzero.memory_report(state).host >= 12 * psi


def test_a_bf16_stage_3_state_with_its_parameters_on_the_host_holds_nothing_on_the_gpu(
    nccl_mesh: fzero.Mesh,
) -> None:
    """`Offload(params=True)`: the masters, moments and bf16 parameter shards on the host
    (pinned), so between steps the caching allocator holds nothing of the state on the
    GPU (2 bytes a parameter with the shards there); 14 bytes a parameter on the host."""
    opt = fzero.optim.adamw(lr=1e-2)
    held, psi, state = bf16_stage_3_held(nccl_mesh, opt, fzero.Offload("host", params=True))
    assert held <= 64 * 1024, (held, psi)
    assert fzero.memory_report(state).host >= 14 * psi


def train_overlapped(mesh: fzero.Mesh, case: Case, stage: int, offload: Any) -> Any:
    """Adam without clipping over units entered just in time: the masters, and the
    threads that updated."""
    from tests.engine.test_gathered import gathered_mlp_loss
    from tests.state.test_offload_overlap import spied

    threads: list[str] = []
    opt = spied(fzero.optim.adam(lr=0.05), threads)
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(
        on_cuda(case.params), opt, mesh, stage=stage, units=units, offload=offload
    )
    step = fzero.sharded_step(
        gathered_mlp_loss, opt, mesh, stage=stage, units=units, just_in_time=True
    )
    for t in range(case.xs.shape[0]):
        state, _ = step(state, (case.xs[t].to(CUDA), case.ys[t].to(CUDA)))
    return on_cpu(fzero.master_params(state, mesh)), threads


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_buckets_step_during_the_backward_on_nccl(
    nccl_mesh: fzero.Mesh, stage: int, tier: str, tmp_path: Any
) -> None:
    """Without clipping, from the second step the host thread updates offloaded buckets
    while the GPU's backward goes on (gradients to pinned memory on a side stream behind
    events, masters back on the step's stream): bitwise the run that steps them after the
    backward, and torch's training on the GPU (float64)."""
    from tests.state.test_offload_overlap import OFFLOAD_THREAD

    case = make_case()
    want = on_cpu(reference(case, clip=False))
    directory = str(tmp_path) if tier == "disk" else None
    got, threads = train_overlapped(nccl_mesh, case, stage, fzero.Offload(tier, 1.0, directory))
    late = fzero.Offload(tier, 1.0, directory, overlap=False)
    after, late_threads = train_overlapped(nccl_mesh, case, stage, late)
    assert any(name.startswith(OFFLOAD_THREAD) for name in threads), threads
    assert not any(name.startswith(OFFLOAD_THREAD) for name in late_threads), late_threads
    fzero._core._tree.assert_trees_close(got, after, rtol=0, atol=0)
    fzero._core._tree.assert_trees_close(got, want, **tolerance(torch.float64))
    assert fzero._core._tree.max_abs_diff(got, case.params) > 1e-3


def test_a_compiled_step_with_its_parameters_on_the_host_matches_torch_on_nccl(
    nccl_mesh: fzero.Mesh,
) -> None:
    """`Offload(params=True)` compiled: the host-held shards enter the graph copied to
    the GPU at the step's start, and stay on the host between steps (pinned): float64
    against torch's on the GPU."""
    case = make_case()
    want = on_cpu(reference(case))
    state = train_offloaded(nccl_mesh, case, 3, fzero.Offload("host", params=True), True)
    assert devices(state.params) == {"cpu"}
    assert all(x.is_pinned() for x in state.params.buffers if x.numel())
    got = on_cpu(fzero.master_params(state, nccl_mesh))
    fzero._core._tree.assert_trees_close(got, want, **tolerance(torch.float64))
    assert fzero._core._tree.max_abs_diff(got, case.params) > 1e-3


@pytest.mark.parametrize("stage", [0, 3])
def test_a_compiled_step_matches_torch_on_nccl(nccl_mesh: fzero.Mesh, stage: int) -> None:
    """`compile=True` on the GPU (inductor's kernels, the functional collectives on
    NCCL): float64 Adam against torch's on the GPU."""
    case = make_case()
    want = on_cpu(reference(case, clip=False))
    opt = fzero.optim.adam(lr=0.05)
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(on_cuda(case.params), opt, nccl_mesh, stage=stage, units=units)
    step = fzero.sharded_step(loss_fn, opt, nccl_mesh, stage=stage, units=units, compile=True)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, (case.xs[t].to(CUDA), case.ys[t].to(CUDA)))
    got = on_cpu(fzero.gather_params(state.params, nccl_mesh))
    fzero._core._tree.assert_trees_close(got, want, **tolerance(torch.float64))
    assert fzero._core._tree.max_abs_diff(got, case.params) > 1e-3


class _Checkpointed(torch.nn.Module):
    """Blocks checkpointed by torch's own checkpoint, the inner of each nested in the outer
    one's recompute (which autograd runs on its CUDA device thread), reentrant or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(3, 5), torch.nn.Linear(5, 1)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(5, 5) for _ in range(3))
        self.reentrant = reentrant

    def _inner(self, block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(block, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(
                checkpoint(lambda y, b=block: self._inner(b, y) * 1.0, h, use_reentrant=False)
            )
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("stage", [0, 3])
def test_torchs_nested_checkpoints_train_as_torch_on_nccl(
    nccl_mesh: fzero.Mesh, stage: int, reentrant: bool
) -> None:
    from torch.func import functional_call

    torch.manual_seed(0)
    model = _Checkpointed(reentrant).double().to(CUDA)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 4, 3, generator=g, dtype=torch.float64).to(CUDA)
    ys = torch.randn(3, 4, 1, generator=g, dtype=torch.float64).to(CUDA)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    want = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(start[k])

    def loss(p: dict[str, Any], batch: Any) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    fopt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(start, fopt, nccl_mesh, stage=stage)
    step = fzero.sharded_step(loss, fopt, nccl_mesh, stage=stage)
    for x, y in zip(xs, ys):
        state, _ = step(state, (x, y))
    got = on_cpu(fzero.gather_params(state.params, nccl_mesh))
    fzero._core._tree.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
