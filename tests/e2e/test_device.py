"""Device-following on a machine without a GPU: states live where their parameters do.

A GPU run fails (NCCL rejects CPU tensors) or slows (each `.item()` waits for the GPU)
wherever fzero makes a tensor without saying where. With torch's default device set to
"meta" while the parameters stay on the CPU, any such tensor lands on the meta device and
the step fails at once: the CPU stands in for the GPU, meta for torch's default. Values
that belong on the host (agreement checks, the step count) say `device="cpu"`.
"""

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fzero
from tests.state.test_precision import FP16, UNITS, Net, data, make_loss, reference
from tests.support import Case, errors_on_every_rank, make_params, run, tolerance

MAX_NORM = 0.3


def pair_loss(params: dict[str, Any], batch: Any) -> tuple[torch.Tensor, int]:
    """mlp_loss as (sum of squared errors, elements): the weighted-loss path."""
    x, y = batch
    h = x
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    out = h * params["scale"] + params["shift"]
    return ((out - y) ** 2).sum(), y.numel()


def torch_reference(case: Case) -> dict[str, Any]:
    """torch.optim.Adam with clip_grad_norm_ on one process over the concatenated batch."""
    leaves, treedef = fzero._core._tree.tree_flatten(case.params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.Adam(tensors, lr=0.05, foreach=False)
    for t in range(case.xs.shape[0]):
        opt.zero_grad()
        total, count = pair_loss(
            fzero._core._tree.tree_unflatten(treedef, tensors), (case.xs[t], case.ys[t])
        )
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(tensors, MAX_NORM, foreach=False)
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def make_case() -> Case:
    g = torch.Generator().manual_seed(7)
    xs = torch.randn(3, 8, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(3, 8, 2, generator=g, dtype=torch.float64)
    return Case(make_params([3, 5, 4, 2], torch.float64, 7), xs, ys, world_size=2)


def train_on_meta_default(
    mesh: fzero.Mesh, case: Case, stage: int, ckpt: str, offload: Any = None
) -> Any:
    """Clipping, loss scaling, weighted losses, accumulation and a checkpoint round trip,
    with torch's default device "meta" from shard_state to the gathered result (and the
    optimizer's state offloaded, if `offload`)."""
    opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(MAX_NORM), fzero.optim.adam(lr=0.05))
    units = ["layers.0", "layers.1", "layers.2"]
    scale = fzero.DynamicLossScale(init_scale=2.0**4, growth_interval=2)
    kw = dict(stage=stage, units=units)
    with torch.device("meta"):
        state = fzero.shard_state(case.params, opt, mesh, loss_scale=scale, offload=offload, **kw)
        step = fzero.sharded_step(pair_loss, opt, mesh, accumulate="sharded", **kw)
        for t in range(case.xs.shape[0]):
            x, y = case.micro_batch(t, mesh.rank)
            state, loss = step(state, list(zip(x.chunk(2), y.chunk(2))))
            if t == 0:  # resume from a checkpoint, at once
                fzero.checkpoint.save(state, ckpt, mesh)
                state = fzero.checkpoint.load(ckpt, mesh, opt, case.params, offload=offload, **kw)
                assert (state.offload is None) == (offload is None)
        params = fzero.gather_params(state.params, mesh)
    leaves = fzero._core._tree.tree_flatten((state, loss, params))[0]
    devices = {str(x.device) for x in leaves if isinstance(x, torch.Tensor)}
    return params, devices, float(state.scaler.scale)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_makes_every_tensor_where_the_parameters_are(stage: int, tmp_path: Any) -> None:
    case = make_case()
    want = torch_reference(case)
    for params, devices, scale in run(2, train_on_meta_default, case, stage, str(tmp_path)):
        assert devices == {"cpu"}
        assert scale == 2.0**5  # grew once in three clean steps: the scaler really ran
        fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))
        moved = fzero._core._tree.max_abs_diff(params, case.params)
        assert moved > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage, params", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_offloaded_step_makes_every_tensor_where_it_says(
    stage: int, params: bool, tier: str, tmp_path: Any
) -> None:
    """The CPU standing in for a GPU, meta for torch's default: the offloaded update (and
    with `params`, the gathers from host shards) makes no tensor without naming its
    device (the host's, or the parameters')."""
    case = make_case()
    want = torch_reference(case)
    directory = str(tmp_path / "spill") if tier == "disk" else None
    offload = fzero.Offload(tier, 0.7, directory, params=params)
    ckpt = str(tmp_path / "ckpt")
    for params, devices, scale in run(2, train_on_meta_default, case, stage, ckpt, offload):
        assert devices == {"cpu"}
        assert scale == 2.0**5
        fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))
        assert fzero._core._tree.max_abs_diff(params, case.params) > 1e-3


def train_mixed_on_meta_default(mesh: fzero.Mesh, xs: Any, ys: Any, stage: int) -> Any:
    torch.manual_seed(0)
    model = Net()  # made before the default device changes, as a user's model would be
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=FP16, reduce_dtype=torch.float32)
    scale = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3)
    opt = fzero.optim.adam(lr=0.01)
    with torch.device("meta"):
        state = fzero.shard_state(
            params, opt, mesh, stage=stage, units=UNITS, precision=prec, loss_scale=scale
        )
        step = fzero.sharded_step(
            make_loss(model, FP16), opt, mesh, stage=stage, units=UNITS, module=model
        )
        for t in range(xs.shape[0]):
            state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        return fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_with_module_hooks_follows_the_parameters(stage: int) -> None:
    xs, ys = data(2, 4)
    want = reference(xs, ys, FP16, torch.float32, scale=True)["masters"]
    got = run(2, train_mixed_on_meta_default, xs, ys, stage)[0]
    torch.manual_seed(0)
    initial = dict(Net().named_parameters())
    for k, m in want.items():
        torch.testing.assert_close(got[k], m, rtol=0, atol=0, msg=k)
        assert not torch.equal(got[k], initial[k].detach()), k


def save_then_load_on(mesh: fzero.Mesh, path: str, device: Any) -> dict[str, str]:
    torch.manual_seed(1)
    params = make_params([3, 4, 2], torch.float32, 1)
    opt = fzero.optim.adamw(lr=0.01)
    scale = fzero.DynamicLossScale()
    buffers = {"running": torch.ones(3)}
    state = fzero.shard_state(params, opt, mesh, stage=3, buffers=buffers, loss_scale=scale)
    fzero.checkpoint.save(state, path, mesh)
    loaded = fzero.checkpoint.load(path, mesh, opt, params, stage=1, device=device)
    paths = fzero._core._tree.leaf_paths(loaded)
    leaves = fzero._core._tree.tree_flatten(loaded)[0]
    return {p: str(x.device) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)}


@pytest.mark.multiprocess
def test_a_checkpoint_loads_onto_the_device_asked_for(tmp_path: Any) -> None:
    on_meta = run(2, save_then_load_on, str(tmp_path / "a"), "meta")[0]
    on_mesh = run(2, save_then_load_on, str(tmp_path / "b"), None)[0]
    assert set(on_mesh.values()) == {"cpu"}  # the mesh's device, over gloo
    # Every tensor on the device, but the step count: torch.optim keeps "step" on the
    # host too, since every update reads it.
    assert {p for p, d in on_meta.items() if d != "meta"} == {"opt_state.0"}  # the count
    assert {"params", "buffers", "scaler"} <= {p.split(".")[0] for p in on_meta}


def test_the_scaler_and_clipping_never_read_their_tensors() -> None:
    # A read of a meta tensor raises: these run without one, so on a GPU without a sync.
    state = fzero.DynamicLossScale(init_scale=4.0, growth_interval=2).init("meta")
    for found_inf in (False, False, True, False):
        state = state.next(found_inf)
    assert state.scale.device.type == "meta" and state.growth_tracker.dtype == torch.int32
    clip = fzero.optim.clip_by_global_norm(1.0)
    grads = {"w": torch.ones(3, device="meta")}
    clipped, clip_state = clip.update(grads, clip.init(grads), grads)
    assert clipped["w"].device.type == "meta" and clip_state.norm.device.type == "meta"


def on_a_mixed_backend_group(mesh: fzero.Mesh, case: Case) -> Any:
    group = dist.new_group(list(range(mesh.size)), backend="cpu:gloo")
    sub = fzero.ProcessGroupMesh(group)
    fast = []
    collectives = fzero._comm._collectives
    real = collectives._gather_by_broadcast, collectives._reduce_scatter_gloo
    collectives._gather_by_broadcast = lambda *a: fast.append("ag") or real[0](*a)
    collectives._reduce_scatter_gloo = lambda *a: fast.append("rs") or real[1](*a)
    opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(MAX_NORM), fzero.optim.adam(lr=0.05))
    state = fzero.shard_state(case.params, opt, sub, stage=3, units=["layers.0"])
    step = fzero.sharded_step(pair_loss, opt, sub, stage=3, units=["layers.0"])
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, sub.rank))
    facts = (sub.backend, str(sub.device), sub.control.group is sub.group, sorted(set(fast)))
    return fzero.gather_params(state.params, sub), facts


@pytest.mark.multiprocess
def test_a_mixed_backend_group_takes_gloo_s_paths_for_cpu_tensors() -> None:
    # "cpu:gloo" names its backend per device, as "cpu:gloo,cuda:nccl" does: the group's
    # name is not "gloo", but what carries CPU tensors is, so its fast paths apply.
    case = make_case()
    want = torch_reference(case)
    for params, facts in run(2, on_a_mixed_backend_group, case):
        assert facts == ("cpu:gloo", "cpu", True, ["ag", "rs"])
        fzero._core._tree.assert_trees_close(params, want, **tolerance(torch.float64))


@pytest.mark.multiprocess
def test_a_device_the_group_cannot_carry_is_refused_on_every_rank() -> None:
    errors = errors_on_every_rank(2, lambda mesh: fzero.ProcessGroupMesh(device="meta"))
    for e in errors:
        assert e.startswith("ValueError: device='meta'") and "no backend for meta" in e
    if not torch.cuda.is_available():
        errors = errors_on_every_rank(2, lambda mesh: fzero.ProcessGroupMesh(device="cuda"))
        assert (
            errors == ["ValueError: device='cuda': torch sees no CUDA device on this machine"] * 2
        )


INHERITED = "as imported"


def rank_sum(mesh: fzero.Mesh, x: torch.Tensor) -> tuple[torch.Tensor, str]:
    return fzero._comm.all_reduce_sum(x * (mesh.rank + 1), mesh), INHERITED


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_are_spawned_once_this_process_has_initialised_cuda(monkeypatch: Any) -> None:
    # A forked child cannot use CUDA once its parent has; spawned ranks import this module
    # afresh, so they see INHERITED as imported, where forked ones would see the change.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(sys.modules[__name__], "INHERITED", "changed in the parent")
    out = fzero.Simulation(2, collective_timeout=30, timeout=120).run(rank_sum, torch.ones(2))
    assert [(s.tolist(), mark) for s, mark in out] == [([3.0, 3.0], "as imported")] * 2
    with pytest.raises(TypeError, match="picklable"):
        fzero.Simulation(2).run(lambda mesh: mesh.rank)
