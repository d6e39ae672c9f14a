"""Offload to host and disk: the same training as on the device, bitwise, and torch's.

Every numerical test compares with one process of `torch.optim` over the whole batch, and
with the same fzero configuration without offload (the issue's bitwise promise: offload
moves where the arithmetic runs, never what it computes).
"""

from pathlib import Path
from typing import Any

import optree
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import fzero
from fzero._core import leaf_paths
from tests.state.test_precision import (
    BF16,
    FP16,
    FP32,
    UNITS,
    Net,
    data,
    make_loss,
    reference,
)
from tests.support import (
    make_params,
    map_every_allocation,
    mlp_loss,
    peak_rss_rise,
    run,
    with_fused_calls,
    with_fused_kinds,
    with_fused_updates,
)

MAX_NORM = 0.4
DIMS = [4, 7, 5, 3]
LAYER_UNITS = ["layers.0", "layers.1", "layers.2"]


def batches(steps: int, n: int, micro: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, n * micro, DIMS[0], generator=g, dtype=torch.float64)
    ys = torch.randn(steps, n * micro, DIMS[-1], generator=g, dtype=torch.float64)
    return xs, ys


def optimizer(fused: bool | None = None, clip: bool = True) -> fzero.optim.Optimizer:
    adamw = fzero.optim.adamw(lr=0.05, weight_decay=0.1, fused=fused)
    return fzero.optim.chain(fzero.optim.clip_by_global_norm(MAX_NORM), adamw) if clip else adamw


def torch_reference(
    params: Any, xs: torch.Tensor, ys: torch.Tensor, frozen: str, clip: bool = True
) -> Any:
    """torch.optim.AdamW with clip_grad_norm_, one process, the concatenated batch."""
    leaves, treedef = fzero._core._tree.tree_flatten(params)
    paths = fzero._core._tree.leaf_paths(params)
    tensors = [
        x.detach().clone().requires_grad_(not p.startswith(frozen)) for x, p in zip(leaves, paths)
    ]
    live = [t for t in tensors if t.requires_grad]
    opt = torch.optim.AdamW(live, lr=0.05, weight_decay=0.1, foreach=False)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        mlp_loss(fzero._core._tree.tree_unflatten(treedef, tensors), (xs[t], ys[t])).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(live, MAX_NORM, foreach=False)
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def train(
    mesh: fzero.Mesh,
    params: Any,
    xs: torch.Tensor,
    ys: torch.Tensor,
    stage: int,
    layout: str,
    offload: fzero.Offload | None,
    accumulate: str | None,
    frozen: str,
    fused: bool | None = None,
    clip: bool = True,
    compiled: str | bool = False,
) -> Any:
    opt = optimizer(fused, clip)
    kw: dict[str, Any] = dict(stage=stage, units=LAYER_UNITS)
    state = fzero.shard_state(
        params, opt, mesh, layout=layout, frozen=[frozen], offload=offload, **kw
    )
    step = fzero.sharded_step(mlp_loss, opt, mesh, accumulate=accumulate, compile=compiled, **kw)
    n = xs.shape[1] // mesh.size
    for t in range(xs.shape[0]):
        x, y = (
            xs[t, mesh.rank * n : (mesh.rank + 1) * n],
            ys[t, mesh.rank * n : (mesh.rank + 1) * n],
        )
        batch: Any = (x, y) if accumulate is None else list(zip(x.chunk(2), y.chunk(2)))
        state, _ = step(state, batch)
    return fzero.master_params(state, mesh), fzero.memory_report(state)


@settings(max_examples=12)
@example(  # a rank that owns no tensor: it still joins the clipping norm's all-reduce
    n=3,
    stage=1,
    layout="tensor",
    tier="host",
    fraction=1.0,
    accumulate=None,
    frozen="layers.1.b",
    params=False,
)
@example(  # the parameter shards on the host too: there, they are the masters
    n=2,
    stage=3,
    layout="flat",
    tier="host",
    fraction=0.5,
    accumulate="sharded",
    frozen="shift",
    params=True,
)
@example(  # ... and beside a state on disk, a copy on the host
    n=3, stage=3, layout="tensor", tier="disk", fraction=1.0, accumulate="local",
    frozen="layers.1.b", params=True,
)  # fmt: skip
@given(
    n=st.integers(1, 3),
    stage=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["flat", "tensor"]),
    tier=st.sampled_from(["host", "disk"]),
    fraction=st.sampled_from([1.0, 0.5, 0.2]),
    accumulate=st.sampled_from([None, "sharded", "local"]),
    frozen=st.sampled_from(["layers.1.b", "shift"]),
    params=st.booleans(),
)
def test_offloaded_training_is_the_device_training_and_torchs(
    tmp_path_factory: Any,
    n: int,
    stage: int,
    layout: str,
    tier: str,
    fraction: float,
    accumulate: str | None,
    frozen: str,
    params: bool,
) -> None:
    """Float64, clipping first in the chain, a frozen leaf, AdamW with decay, the
    parameter shards on the host too or not (stage 3): the masters after 3 steps equal
    torch.optim's (1e-10) and, bitwise, fzero's without offload."""
    directory = str(tmp_path_factory.mktemp("offload")) if tier == "disk" else None
    params_off = params and stage == 3
    offload = fzero.Offload(tier, fraction, directory, params=params_off)
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(3, n, 2)
    want = torch_reference(params, xs, ys, frozen)
    plain = run(n, train, params, xs, ys, stage, layout, None, accumulate, frozen)
    got = run(n, train, params, xs, ys, stage, layout, offload, accumulate, frozen)
    for (masters, report), (same, before) in zip(got, plain):
        fzero.assert_trees_close(masters, same, rtol=0, atol=0)
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert report.host + report.disk > 0
        assert (report.disk > 0) == (tier == "disk")
        # On the host tier the host shards are the masters: the state holds fewer bytes
        # (a rank owning a tensor of an offloaded bucket: every rank at 2, with "flat").
        if params_off and tier == "host" and (n == 2 or layout == "flat"):
            assert report.params < before.params
    # Beside a disk state they are a copy on the host (some rank owns a tensor of them).
    if params_off and tier == "disk":
        assert any(report.host > 0 for _, report in got)
    moved = fzero._core._tree.max_abs_diff(got[0][0], params)
    assert moved > 1e-3
    frozen_leaf = dict(
        zip(fzero._core._tree.leaf_paths(params), fzero._core._tree.tree_flatten(params)[0])
    )
    assert torch.equal(
        dict(
            zip(
                fzero._core._tree.leaf_paths(got[0][0]),
                fzero._core._tree.tree_flatten(got[0][0])[0],
            )
        )[frozen],
        frozen_leaf[frozen],
    )
    if directory is not None:
        assert list(Path(directory).iterdir()) == []  # the files live only while mapped


@pytest.mark.multiprocess
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("clip", [True, False])
def test_a_fused_optimizer_steps_an_offloaded_state_as_torch(clip: bool, large: bool) -> None:
    """`adamw(fused=True)`: the host's update fused, small offloaded buckets' shards in
    torch's fused list kernel, large ones a compiled kernel each (every piece made large
    here, `large`), also on the host thread that steps units during the backward
    (without clipping); float64 against torch.optim, parameters moved."""
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(3, 2, 2)
    want = torch_reference(params, xs, ys, "shift", clip)
    offload = fzero.Offload("host", 1.0)
    args = (params, xs, ys, 3, "flat", offload, None, "shift", True, clip)
    for (masters, report), kernels, lists in run(2, with_fused_kinds, large, train, *args):
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert report.host > 0
        # A call at least per step, of the one kind.
        if large:
            assert kernels >= 3 and lists == 0, (kernels, lists)
        else:
            assert lists >= 3 and kernels == 0, (kernels, lists)
    assert fzero._core._tree.max_abs_diff(masters, params) > 1e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "tier", "accumulate", "clip", "apart"),
    [
        (1, "disk", "local", True, False), (2, "host", None, False, False),
        (3, "host", "sharded", True, False), (3, "host", None, True, True),
        (3, "disk", "local", False, True),
    ],
)  # fmt: skip
def test_a_compiled_step_updates_an_offloaded_state(
    tmp_path: Path, stage: int, tier: str, accumulate: str | None, clip: bool, apart: bool
) -> None:
    """`sharded_step(compile=...)` with `offload=`: the graph's gradient, then the
    offloaded update unit by unit after the backward (compiled, none during it), fzero's
    AdamW fused on the host; float64 against torch.optim, a frozen leaf unchanged. With
    `params=True` (`apart`) the host-held shards enter the graph copied to the device it
    computes on (here the CPU itself)."""
    directory = str(tmp_path) if tier == "disk" else None
    params = make_params(DIMS, torch.float64, 6)
    xs, ys = batches(3, 2, 2)
    want = torch_reference(params, xs, ys, "shift", clip)
    offload = fzero.Offload(tier, 1.0, directory, params=apart)
    args = (params, xs, ys, stage, "flat", offload, accumulate, "shift", None, clip, "aot_eager")
    for (masters, report), calls in run(2, with_fused_updates, train, *args):
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert report.host + report.disk > 0 and calls > 0
        assert torch.equal(masters["shift"], params["shift"])
    assert fzero._core._tree.max_abs_diff(masters, params) > 1e-3


def train_mixed(
    mesh: fzero.Mesh, xs: Any, ys: Any, stage: int, offload: Any, compiled: Any = False
) -> Any:
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=FP16, reduce_dtype=FP32)
    scale = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3)
    opt = fzero.optim.adam(lr=0.01)
    kw: dict[str, Any] = dict(stage=stage, units=UNITS)
    state = fzero.shard_state(
        params, opt, mesh, precision=prec, loss_scale=scale, offload=offload, **kw
    )
    loss_fn = make_loss(model, FP16)
    step = fzero.sharded_step(loss_fn, opt, mesh, module=model, compile=compiled, **kw)
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.master_params(state, mesh), state.step, fzero.gather_params(state.params, mesh)


def train_params_apart(
    mesh: fzero.Mesh,
    xs: Any,
    ys: Any,
    tier: str,
    directory: Any,
    clip: bool,
    compiled: Any = False,
    accumulate: str | None = None,
) -> Any:
    """Stage 3, `Offload(params=True)`, its compute device stood in for by "cpu:0": a
    torch.device unequal to the host shards' "cpu", so every gather copies its host shard
    over, and every gradient is taken for a storage-free stand-in leaf "there" (the paths
    a GPU takes; on the CPU the copies are real copies). Returns the masters and how many
    stand-in leaves and host-shard gathers the steps made (`compiled`: how many shards
    the graph's inputs were copied from, `accumulate` its micro-batches: each rank's
    batch in two)."""
    import dataclasses

    from fzero._engine import _engine, _gatherer
    from fzero._step import _entries, _local

    counts = {"stand-ins": 0, "copied gathers": 0, "copied shards": 0}
    leaf, gather, computing = _engine._leaf, _gatherer.Gatherer._gather, _entries.computing

    def spy_computing(shard: torch.Tensor, apart: Any) -> torch.Tensor:
        counts["copied shards"] += apart is not None and shard.device != apart
        return computing(shard, apart)

    _entries.computing = _local.computing = spy_computing  # type: ignore[attr-defined]

    def spy_leaf(x: torch.Tensor, device: Any) -> torch.Tensor:
        out = leaf(x, device)
        counts["stand-ins"] += out.numel() > 1 and not any(out.stride())
        return out

    def spy_gather(self: Any, i: int, *args: Any) -> Any:
        counts["copied gathers"] += self.shards[i].device != self.device
        return gather(self, i, *args)

    _engine._leaf, _gatherer.Gatherer._gather = spy_leaf, spy_gather  # type: ignore[method-assign]
    opt = optimizer(clip=clip)
    kw: dict[str, Any] = dict(stage=3, units=LAYER_UNITS)
    offload = fzero.Offload(tier, 1.0, directory, params=True)
    params = make_params(DIMS, torch.float64, 5)
    state = fzero.shard_state(params, opt, mesh, offload=offload, frozen=["shift"], **kw)
    apart = dataclasses.replace(state.offload, device=torch.device("cpu", 0))
    state = dataclasses.replace(state, offload=apart)
    step = fzero.sharded_step(mlp_loss, opt, mesh, compile=compiled, accumulate=accumulate, **kw)
    n = xs.shape[1] // mesh.size
    for t in range(xs.shape[0]):
        rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
        batch = (xs[t, rows], ys[t, rows])
        if accumulate:
            batch = [tuple(x[i : i + 1] for x in batch) for i in range(n)]
        state, _ = step(state, batch)
    assert state.offload.device == torch.device("cpu", 0)
    return fzero.master_params(state, mesh), counts


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("clip", [True, False])
def test_parameter_shards_apart_from_the_device_train_as_torch(
    tier: str, clip: bool, tmp_path: Path
) -> None:
    """The host shards gathered through copies to the compute device, gradients for
    stand-in leaves there (both counted), clipping after the backward or without it the
    host thread stepping buckets during it: torch.optim's training (float64), bitwise the
    state on the device."""
    n, steps = 2, 3
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(steps, n, 2)
    want = torch_reference(params, xs, ys, frozen="shift", clip=clip)
    plain = run(n, train, params, xs, ys, 3, "flat", None, None, "shift", None, clip)
    directory = str(tmp_path) if tier == "disk" else None
    got = run(n, train_params_apart, xs, ys, tier, directory, clip)
    for (masters, counts), (same, _) in zip(got, plain):
        fzero.assert_trees_close(masters, same, rtol=0, atol=0)
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert fzero._core._tree.max_abs_diff(masters, params) > 1e-3
        # Three trainable units' buckets a step (the frozen leaf's is on the device).
        assert counts["stand-ins"] == 3 * steps, counts
        assert counts["copied gathers"] >= 3 * steps, counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("accumulate", [None, "local"])
def test_a_compiled_step_computes_with_host_shards_copied_to_the_compute_device(
    accumulate: str | None,
) -> None:
    """Compiled with `Offload(params=True)`, the compute device stood in for by "cpu:0":
    every trainable host shard is copied "there" for the graph (`accumulate="local"`: for
    the step's one gather before the graph), and training is torch.optim's (float64)."""
    n, steps = 2, 3
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(steps, n, 2)
    want = torch_reference(params, xs, ys, frozen="shift", clip=True)
    args = (xs, ys, "host", None, True, "aot_eager", accumulate)
    for masters, counts in run(n, train_params_apart, *args):
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert fzero._core._tree.max_abs_diff(masters, params) > 1e-3
        # Three trainable units' shards a step at least (the frozen leaf's is on the device).
        assert counts["copied shards"] >= 3 * steps, counts
        assert counts["stand-ins"] == counts["copied gathers"] == 0  # no eager engine


@pytest.mark.parametrize("stage, params", [(1, False), (2, False), (3, False), (3, True)])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_mixed_precision_with_a_skipped_step_offloaded(
    stage: int, params: bool, tier: str, tmp_path: Path
) -> None:
    """fp16 compute over fp32 masters offloaded (at stage 3 also with the parameter shards
    on the host, in fp16), an inf on one rank at step 1: the step is skipped everywhere,
    and the masters equal torch's GradScaler loop bitwise."""
    xs, ys = data(2, 5, inf_at=(1, 1))
    ref = reference(xs, ys, FP16, FP32, scale=True)
    assert ref["skipped"] == [False, True, False, False, False]
    directory = str(tmp_path) if tier == "disk" else None
    offload = fzero.Offload(tier, 0.6, directory, params=params)
    for masters, steps, params in run(2, train_mixed, xs, ys, stage, offload):
        assert steps == 4
        for k, m in ref["masters"].items():
            torch.testing.assert_close(masters[k], m, rtol=0, atol=0, msg=k)
            torch.testing.assert_close(params[k], m.to(FP16), rtol=0, atol=0, msg=k)
            assert not torch.equal(masters[k], ref["start"][k]), k


def seen_through_fp16(mesh: fzero.Mesh, xs: Any, ys: Any, offload: Any) -> list[list[str]]:
    """Stage 3, bf16 compute, fp16 travel, offloaded: per step, the leaves the loss saw
    other than the masters rounded straight to fp16, then to bf16."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=BF16, gather_dtype=FP16)
    opt, kw = fzero.optim.adam(lr=0.01), dict(stage=3, units=UNITS)
    state = fzero.shard_state(params, opt, mesh, precision=prec, offload=offload, **kw)
    seen: list[dict[str, torch.Tensor]] = []

    def loss_fn(p: dict, batch: Any) -> torch.Tensor:
        seen.append({k: v.detach().clone() for k, v in p.items()})
        return make_loss(model, BF16)(p, batch)

    step = fzero.sharded_step(loss_fn, opt, mesh, **kw)
    off = []
    for t in range(xs.shape[0]):
        masters = fzero.master_params(state, mesh)
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        want = {k: m.to(FP16).to(BF16) for k, m in masters.items()}
        off.append([k for k in want if not torch.equal(seen[t][k], want[k])])
    assert fzero._core._tree.max_abs_diff(fzero.master_params(state, mesh), params) > 1e-3
    return off


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("tier, params", [("host", False), ("disk", False), ("host", True)])
def test_an_offloaded_stage_3_copy_gathers_through_the_gather_dtype_once(
    tier: str, params: bool, tmp_path: Path
) -> None:
    """The device copy (or host shard) beside an offloaded master was held in bf16 and
    gathered through fp16: master -> bf16 -> fp16 -> bf16, where without offload the
    gather rounds the master to fp16 straight (found by a fuzzer: offloaded training
    parted from the device's)."""
    xs, ys = data(2, 3)
    offload = fzero.Offload(
        tier, directory=str(tmp_path) if tier == "disk" else None, params=params
    )
    for off in run(2, seen_through_fp16, xs, ys, offload):
        assert off == [[], [], []]


def train_accumulating(mesh: fzero.Mesh, xs: Any, ys: Any, offload: Any) -> Any:
    """Stage 3 in bfloat16 over float32 masters, one rank accumulating locally each
    step's micro-batches (the reference's "ranks"); the masters after each step."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt, kw = fzero.optim.adam(lr=0.01), dict(stage=3, units=UNITS)
    state = fzero.shard_state(
        params, opt, mesh, precision=fzero.Precision(param_dtype=BF16), offload=offload, **kw
    )
    step = fzero.sharded_step(make_loss(model, BF16), opt, mesh, accumulate="local", **kw)
    out = []
    for t in range(xs.shape[0]):
        state, _ = step(state, list(zip(xs[t], ys[t])))
        out.append(fzero.master_params(state, mesh))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("tier, params", [("host", False), ("disk", False), ("host", True)])
def test_a_mean_over_three_micro_batches_is_taken_in_the_masters_dtype_offloaded(
    tier: str, params: bool, tmp_path: Path
) -> None:
    """bfloat16 gradients summed locally over three micro-batches are divided by 3 in the
    masters' float32, as on the device (where a stage-3 shard is its master) and as
    torch's loop divides its float32 masters' gradients: before, an offloaded shard's
    device copy divided in bfloat16, one rounding more, and the masters drifted from the
    device's by a bfloat16 ulp from the second step."""
    xs, ys = data(3, 3)
    ref = reference(xs, ys, BF16, BF16, scale=False)
    directory = str(tmp_path) if tier == "disk" else None
    (on_device,) = run(1, train_accumulating, xs, ys, None)
    (offloaded,) = run(1, train_accumulating, xs, ys, fzero.Offload(tier, 1.0, directory, params))
    for t, (mine, theirs) in enumerate(zip(offloaded, on_device)):
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), (t, k)
    # torch sums the micro-batches' bfloat16 gradients in its own order: within rounding.
    fzero.assert_trees_close(offloaded[-1], ref["masters"], rtol=0, atol=2e-3)
    assert fzero._core._tree.max_abs_diff(offloaded[-1], ref["start"]) > 1e-2


@pytest.mark.multiprocess
@pytest.mark.parametrize("apart", [False, True])
def test_a_compiled_mixed_precision_step_offloaded_skips_as_torch(apart: bool) -> None:
    """The same, compiled at stage 3 with 60 % of the state on the host (`apart`: its
    parameter shards too, fp16 copies the graph enters upcast): the skip everywhere, and
    the masters torch's within the fused update's fp32 ulps."""
    xs, ys = data(2, 5, inf_at=(1, 1))
    ref = reference(xs, ys, FP16, FP32, scale=True)
    offload = fzero.Offload("host", 0.6, params=apart)
    for masters, steps, _ in run(2, train_mixed, xs, ys, 3, offload, "aot_eager"):
        assert steps == 4
        for k, m in ref["masters"].items():
            torch.testing.assert_close(masters[k], m, rtol=0, atol=1e-6, msg=k)
            assert not torch.equal(masters[k], ref["start"][k]), k


def save_offloaded_then_resume(
    mesh: fzero.Mesh, path: str, directory: str, params: Any, xs: Any, ys: Any
) -> Any:
    """Two steps offloaded to disk at stage 3 (the parameter shards on the host), a
    checkpoint, then one step from it loaded at stage 2 offloaded to the host, and one
    more loaded with no offload at stage 1."""
    opt = optimizer()
    n = xs.shape[1] // mesh.size
    rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
    state = fzero.shard_state(
        params,
        opt,
        mesh,
        stage=3,
        units=LAYER_UNITS,
        frozen=["shift"],
        offload=fzero.Offload("disk", 1.0, directory, params=True),
    )
    step3 = fzero.sharded_step(mlp_loss, opt, mesh, stage=3)
    for t in range(2):
        state, _ = step3(state, (xs[t, rows], ys[t, rows]))
    fzero.checkpoint.save(state, path, mesh)
    state = fzero.checkpoint.load(path, mesh, opt, params, stage=2, offload=fzero.Offload())
    state, _ = fzero.sharded_step(mlp_loss, opt, mesh, stage=2)(state, (xs[2, rows], ys[2, rows]))
    fzero.checkpoint.save(state, path, mesh)
    state = fzero.checkpoint.load(path, mesh, opt, params, stage=1)
    assert state.offload is None
    state, _ = fzero.sharded_step(mlp_loss, opt, mesh, stage=1)(state, (xs[3, rows], ys[3, rows]))
    return fzero.gather_params(state.params, mesh)


def test_checkpoints_move_between_offloaded_and_device_states(tmp_path: Path) -> None:
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(4, 2, 2)
    want = torch_reference(params, xs, ys, "shift")
    directory = tmp_path / "spill"
    for got in run(
        2, save_offloaded_then_resume, str(tmp_path / "ckpt"), str(directory), params, xs, ys
    ):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert list(directory.iterdir()) == []


def bad(mesh: fzero.Mesh, what: str, path: str) -> Any:
    params = make_params(DIMS, torch.float64, 5)
    opt = fzero.optim.adam(lr=0.1)
    if what == "stage 0":
        return fzero.shard_state(params, opt, mesh, stage=0, offload=fzero.Offload())
    if what == "params at stage 2":
        return fzero.shard_state(params, opt, mesh, stage=2, offload=fzero.Offload(params=True))
    if what in ("pure step", "pure step later"):
        step = fzero.sharded_step(mlp_loss, opt, mesh, stage=1, donate=False)
        x = torch.randn(2, DIMS[0], dtype=torch.float64)
        batch = (x, torch.randn(2, DIMS[-1], dtype=torch.float64))
        if what == "pure step later":  # its first call takes a host state: fine
            step(fzero.shard_state(params, opt, mesh, stage=1, offload=fzero.Offload()), batch)
        state = fzero.shard_state(
            params, opt, mesh, stage=1, offload=fzero.Offload("disk", 1.0, path)
        )
        return step(state, batch)
    one = fzero.Offload() if mesh.rank == 0 else None  # offloaded on rank 0 alone
    if what == "one rank":
        return fzero.shard_state(params, opt, mesh, stage=2, offload=one)
    if what.endswith("on one rank"):
        state = fzero.shard_state(params, opt, mesh, stage=2)
        flat = dict(zip(leaf_paths(params), optree.tree_leaves(params)))
        try:
            if what == "load on one rank":
                fzero.checkpoint.save(state, path, mesh)
                fzero.checkpoint.load(path, mesh, opt, params, stage=2, offload=one)
            elif what == "import on one rank":
                torch_opt = torch.optim.Adam(list(flat.values()))  # never stepped: no state
                fzero.checkpoint.import_torch(
                    flat, torch_opt.state_dict(), opt, mesh, stage=2, offload=one,
                    params_like=params,
                )  # fmt: skip
            else:
                fzero.checkpoint.export_dcp(state, path, mesh)
                fzero.checkpoint.import_dcp(
                    path, opt, mesh, flat, stage=2, offload=one, optimizer_key=None
                )
        except ValueError:  # agreed: nothing pending, the next call works
            fzero.shard_state(params, opt, mesh, stage=2)
            raise
    return fzero.shard_state(params, opt, mesh, stage=2, offload=fzero.Offload("disk", 1.0, path))


def test_bad_offloads_are_refused_on_every_rank(tmp_path: Path) -> None:
    from tests.faults.harness import outcomes, raised_together

    for fraction in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
            fzero.Offload("host", fraction)
    for fraction in ("0.5", True, None):  # a string passed, then failed inside the step
        with pytest.raises(TypeError, match="fraction must be a number"):
            fzero.Offload("host", fraction)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs directory="):
        fzero.Offload("disk")
    with pytest.raises(ValueError, match="one of"):
        fzero.Offload("nvme")
    raised_together(outcomes(2, bad, "stage 0", ""), ValueError, "offload needs stage 1, 2 or 3")
    raised_together(
        outcomes(2, bad, "params at stage 2", ""), ValueError, "Offload(params=True) needs stage 3"
    )
    for pure in ("pure step", "pure step later"):  # the later one was checked at first only
        raised_together(
            outcomes(2, bad, pure, str(tmp_path)), ValueError, "donate=False", "in place"
        )
    # Placing a state is collective: offload= on some ranks alone left them waiting for
    # the others (shard_state), or, loaded, in master_params' gathers its peers never made.
    raised_together(outcomes(2, bad, "one rank", ""), ValueError, "rank 1 did not pass offload=")
    for what, call in (
        ("load", "checkpoint.load"),
        ("import", "checkpoint.import_torch"),
        ("import_dcp", "checkpoint.import_dcp"),
    ):
        outs = outcomes(2, bad, f"{what} on one rank", str(tmp_path / what))
        raised_together(
            outs, ValueError, call, "the ranks differ in passing offload= (rank 0: yes, rank 1: no)"
        )
        assert not any(o.peer for o in outs)  # the next call ran: the job stays usable
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    raised_together(
        outcomes(2, bad, "a file", str(a_file / "spill")), OSError, "Not a directory", "rank 0"
    )


def step_memory(
    mesh: fzero.Mesh, tier: str, directory: str, stage: int, ckpt: str
) -> dict[str, float]:
    """The peak resident memory of a step (the second: the first makes the step's caches)
    above the process's before the state was made, with the state on the host or on
    disk, and the sizes that bound it."""
    map_every_allocation()
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(384, 384) for _ in range(8)])
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    units = [str(i) for i in range(8)]
    opt = fzero.optim.adamw(lr=1e-3)
    offload = fzero.Offload(tier, 1.0, directory if tier == "disk" else None)

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (torch.func.functional_call(net, p, (x,)) ** 2).mean()

    x = torch.randn(4, 384)
    for measured in (False, True):  # the first pass loads the code each part runs
        with peak_rss_rise() as start:
            state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, offload=offload)
        step = fzero.sharded_step(loss, opt, mesh, stage=stage, module=net, units=units)
        state, _ = step(state, x)
        with peak_rss_rise() as m:
            state, _ = step(state, x)
        with peak_rss_rise() as saving:
            fzero.checkpoint.save(state, ckpt, mesh)
        with peak_rss_rise() as loading:
            loaded = fzero.checkpoint.load(ckpt, mesh, opt, params, stage=stage, offload=offload)
        assert loaded.step == state.step
        if not measured:
            del state, step, loaded
    report = fzero.memory_report(state)
    unit = max(b.shard_numel for b in state.layout.buckets) * 4 * 3  # master, m, v
    peak = m["before"] + m["rise"] - start["before"]
    moments = unit * 2 // 3 * len(units)
    return {
        "peak": peak,
        "init": start["rise"],
        "save": saving["rise"],
        "load": loading["rise"],
        "unit": unit,
        "offloaded": report.host + report.disk,
        "moments": moments,
    }


def fresh(fn: Any, *args: Any) -> list[dict[str, float]]:
    """`run(2, fn, *args)` from a new interpreter. Ranks fork from their parent and
    inherit its heap: after a long test session its free chunks, resident already, serve
    the ranks' allocations without their resident size rising, and nothing is measured."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from tests.support import run\n"
        f"from {fn.__module__} import {fn.__name__} as fn\n"
        "print(json.dumps(run(2, fn, *json.loads(sys.argv[1]))))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", [1, 3])
def test_a_disk_offloaded_state_holds_two_units_at_most_in_a_step_an_init_a_save_a_load(
    stage: int, tmp_path: Path
) -> None:
    """Measured, resident: a step with the state on disk peaks at most two units' masters
    and moments above the same step with none of that state resident (the host tier's
    peak less its offloaded bytes), where holding all of it would add eight."""
    host = fresh(step_memory, "host", "", stage, str(tmp_path / "host"))
    disk = fresh(step_memory, "disk", str(tmp_path / "spill"), stage, str(tmp_path / "disk"))
    for h, d in zip(host, disk):
        assert d["offloaded"] >= 8 * d["unit"] * 0.99  # the bound means something
        assert d["peak"] <= h["peak"] - h["offloaded"] + 2 * d["unit"], (h, d)
        # shard_state makes the moments a unit at a time, each written out as it is made:
        # the host tier ends holding all of them, the disk's peak holds two units at most.
        assert d["init"] <= h["init"] - d["moments"] + 2 * d["unit"], (h, d)
        # A save streams an offloaded state through its file, a tensor at a time: the
        # disk's, not resident before, is not after, nor at its peak more than a few
        # units (a bucket's pages read and its copy written, one entry at a time; the
        # host's rise, its state resident already, is the noise of a few allocations).
        assert d["save"] <= h["save"] + 3 * d["unit"], (h, d)
        # A load fills the state where it lives, a piece at a time: the host's ends
        # holding all of it, the disk's two units at most.
        assert d["load"] <= h["load"] - d["moments"] + 2 * d["unit"], (h, d)


def dying(opt: fzero.optim.Optimizer, at: int) -> fzero.optim.Optimizer:
    """`opt`, killing its process (SIGKILL) in its `at`-th in-place update call."""
    import os
    import signal

    calls = [0]

    def update_(grads: Any, state: Any, params: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        assert opt.update_ is not None
        return opt.update_(grads, state, params)

    return opt._replace(update_=update_)


def train_save_and_die(
    mesh: fzero.Mesh, path: str, directory: str, params: Any, xs: Any, ys: Any
) -> None:
    """Stage 2 on disk: two steps, a checkpoint, then rank 1 dies inside the third step's
    update, between two offloaded units (some already written in place, some not)."""
    calls_per_step = 4  # a unit per trainable bucket: the three layers and the root
    # The same optimizer on every rank (the first step compares them), dying on rank 1.
    opt = dying(optimizer(), 2 * calls_per_step + 2 if mesh.rank == 1 else 10**9)
    n = xs.shape[1] // mesh.size
    rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
    offload = fzero.Offload("disk", 1.0, directory)
    state = fzero.shard_state(params, opt, mesh, stage=2, units=LAYER_UNITS, offload=offload)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=2)
    for t in range(3):
        state, _ = step(state, (xs[t, rows], ys[t, rows]))
        if t == 1:
            fzero.checkpoint.save(state, path, mesh)


def resume(mesh: fzero.Mesh, path: str, directory: str, params: Any, xs: Any, ys: Any) -> Any:
    opt = optimizer()
    offload = fzero.Offload("disk", 1.0, directory)
    state = fzero.checkpoint.load(path, mesh, opt, params, stage=2, offload=offload)
    assert state.step == 2
    n = xs.shape[1] // mesh.size
    rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=2)
    for t in range(2, 4):
        state, _ = step(state, (xs[t, rows], ys[t, rows]))
    return fzero.master_params(state, mesh)


def test_a_run_killed_mid_update_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(4, 2, 2)
    want = torch_reference(params, xs, ys, "no frozen leaf")
    spill, ckpt = tmp_path / "spill", str(tmp_path / "ckpt")
    with pytest.raises(fzero.RankFailure, match="rank 1 of 2 died"):
        run(2, train_save_and_die, ckpt, str(spill), params, xs, ys)
    assert list(spill.iterdir()) == []  # nothing left behind by the dead ranks
    for got in run(2, resume, ckpt, str(spill), params, xs, ys):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


def offloaded_report(
    mesh: fzero.Mesh, stage: int, tier: str, directory: str, params_off: bool = False
) -> Any:
    params = make_params([64, 64, 64], torch.float64, 1)
    prec = fzero.Precision(param_dtype=torch.float32) if params_off else None
    where = directory if tier == "disk" else None
    offload = fzero.Offload(tier, 1.0, where, params=params_off)
    opt = fzero.optim.adam()
    return fzero.memory_report(
        fzero.shard_state(params, opt, mesh, stage=stage, precision=prec, offload=offload)
    )


@pytest.mark.parametrize("stage, params", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_memory_report_and_estimate_agree_on_what_leaves_the_device(
    stage: int, params: bool, tier: str, tmp_path: Path
) -> None:
    """Float64 Adam offloaded: 24 bytes a parameter (master, two moments) leave the
    device; it keeps the parameters (replicated, or its shard at stage 3), or with
    `params` (fp32 compute) nothing, its fp32 shards on the host too."""
    psi = 2 * 64 * 64 + 2 * 64 + 2
    n = 2
    param_bytes = 4 if params else 8
    want = fzero.estimate_memory(
        psi,
        n,
        stage,
        param_bytes=param_bytes,
        grad_bytes=8,
        optim_bytes=24,
        offload=tier,
        params_offload=params,
    )
    for report in run(n, offloaded_report, stage, tier, str(tmp_path), params):
        off = report.host + report.disk
        assert off == pytest.approx(want.host + want.disk, abs=(24 + param_bytes) * n)  # padding
        assert (report.disk > 0) == (tier == "disk")
        assert report.on_device == pytest.approx(want.params, abs=param_bytes * n)
        if params:  # nothing but the optimizer's step count (8 bytes) stays
            assert report.on_device == 8


def big_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {
        "w": torch.randn(1500, 1500, generator=g, dtype=torch.float64) * 0.03,
        "b": torch.randn(1500, generator=g, dtype=torch.float64),
        "v": torch.randn(999, generator=g, dtype=torch.float64),
    }


def big_loss(p: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"]).pow(2).mean() + p["v"].pow(2).mean()


def no_decay(path: str) -> bool:
    return path != "b"


def big_optimizer(which: str) -> fzero.optim.Optimizer:
    base = fzero.optim.adamw(lr=0.01)
    return {
        "clipped": fzero.optim.chain(
            fzero.optim.clip_by_global_norm(0.05), fzero.optim.adamw(lr=0.01, mask=no_decay)
        ),
        "fused": fzero.optim.chain(
            fzero.optim.clip_by_global_norm(0.05),
            fzero.optim.adamw(lr=0.01, mask=no_decay, fused=True),
        ),
        "from_torch": fzero.optim.from_torch(torch.optim.AdamW, lr=0.01, foreach=False),
        "out of place": fzero.optim.Optimizer(base.init, base.update),  # no update_
    }[which]


def train_big(mesh: fzero.Mesh, xs: torch.Tensor, offload: Any, which: str = "clipped") -> Any:
    opt = big_optimizer(which)
    state = fzero.shard_state(big_params(), opt, mesh, stage=2, offload=offload)
    step = fzero.sharded_step(big_loss, opt, mesh, stage=2)
    n = xs.shape[1] // mesh.size
    for t in range(xs.shape[0]):
        state, _ = step(state, xs[t, mesh.rank * n : (mesh.rank + 1) * n])
    return fzero.master_params(state, mesh)


def big_reference(xs: torch.Tensor) -> dict[str, torch.Tensor]:
    """`big_optimizer("clipped")`'s training in torch.optim, one process."""
    tensors = {k: v.clone().requires_grad_() for k, v in big_params().items()}
    opt = torch.optim.AdamW(
        [{"params": [tensors["w"], tensors["v"]]}, {"params": [tensors["b"]], "weight_decay": 0}],
        lr=0.01,
        foreach=False,
    )
    for t in range(xs.shape[0]):
        opt.zero_grad()
        big_loss(tensors, xs[t]).backward()
        torch.nn.utils.clip_grad_norm_(list(tensors.values()), 0.05, foreach=False)
        opt.step()
    return {k: v.detach() for k, v in tensors.items()}


def test_a_shard_larger_than_a_block_is_stepped_in_blocks_bitwise(tmp_path: Path) -> None:
    """A 2.25M-element matrix in one unit: each rank's host shard (1.1M elements) steps
    in cache-sized blocks (`_streamed.BLOCK`); a weight-decay mask cuts across them."""
    from fzero._step import _streamed

    assert big_params()["w"].numel() // 2 > _streamed.BLOCK
    xs = torch.randn(2, 4, 1500, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = run(2, train_big, xs, None)[0]
    got = run(2, train_big, xs, fzero.Offload("disk", 1.0, str(tmp_path)))[0]
    fzero.assert_trees_close(got, plain, rtol=0, atol=0)
    fzero.assert_trees_close(got, big_reference(xs), rtol=1e-10, atol=1e-12)
    assert not torch.equal(got["w"], big_params()["w"])


def test_a_fused_optimizer_steps_a_shard_larger_than_a_block_in_one_kernel() -> None:
    """`adamw(fused=True)` offloaded: the host shard, larger than the unfused update's
    cache-sized block, is one kernel call a step (one pass over memory gains nothing
    from blocks), as torch.optim in float64. Rank 0's shard starts with b's 1500
    undecayed elements: cut off to torch's list kernel (`_base.by_flag`), the decayed
    rest one kernel without a mask; rank 1's is w's alone."""
    from fzero._step import _streamed

    xs = torch.randn(2, 4, 1500, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    offload = fzero.Offload("host", 1.0)
    shard = -(-(sum(v.numel() for v in big_params().values())) // 2)
    assert shard > _streamed.BLOCK
    for rank, (got, calls) in enumerate(run(2, with_fused_calls, train_big, xs, offload, "fused")):
        fzero.assert_trees_close(got, big_reference(xs), rtol=1e-10, atol=1e-12)
        assert calls == [(shard - (1500 if rank == 0 else 0),)] * xs.shape[0]
    assert not torch.equal(got["w"], big_params()["w"])


def train_torch_optimizer(mesh: fzero.Mesh, params: Any, xs: Any, ys: Any, offload: Any) -> Any:
    opt = fzero.optim.from_torch(torch.optim.AdamW, lr=0.05, weight_decay=0.1, foreach=False)
    state = fzero.shard_state(params, opt, mesh, stage=2, units=LAYER_UNITS, offload=offload)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=2)
    n = xs.shape[1] // mesh.size
    for t in range(xs.shape[0]):
        rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
        state, _ = step(state, (xs[t, rows], ys[t, rows]))
    return fzero.master_params(state, mesh)


def test_a_torch_optimizer_offloads_to_the_host_and_is_refused_on_disk(tmp_path: Path) -> None:
    """from_torch makes its state on the first update: the host tier keeps it where it
    is made (bitwise the on-device run); the disk tier cannot size its file, and says so
    on every rank."""
    from tests.faults.harness import outcomes, raised_together

    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(3, 2, 2)
    plain = run(2, train_torch_optimizer, params, xs, ys, None)[0]
    host = run(2, train_torch_optimizer, params, xs, ys, fzero.Offload("host", 0.5))[0]
    fzero.assert_trees_close(host, plain, rtol=0, atol=0)
    assert fzero._core._tree.max_abs_diff(host, params) > 1e-3
    disk = fzero.Offload("disk", 1.0, str(tmp_path))
    outs = outcomes(2, train_torch_optimizer, params, xs, ys, disk)
    raised_together(outs, ValueError, "first update", "Offload(to='host')")


def export_and_forward(mesh: fzero.Mesh, offload: Any, path: str) -> Any:
    params = make_params(DIMS, torch.float64, 5)
    xs, ys = batches(2, mesh.size, 2)
    opt = fzero.optim.adamw(lr=0.05)
    prec = fzero.Precision(param_dtype=torch.float32)
    kw: dict[str, Any] = dict(stage=3, units=LAYER_UNITS)
    state = fzero.shard_state(params, opt, mesh, precision=prec, offload=offload, **kw)
    step = fzero.sharded_step(mlp_loss, opt, mesh, **kw)
    n = xs.shape[1] // mesh.size
    for t in range(2):
        rows = slice(mesh.rank * n, (mesh.rank + 1) * n)
        state, _ = step(state, (xs[t, rows].float(), ys[t, rows].float()))
    exported = fzero.checkpoint.export_torch(state, None, mesh)
    fzero.checkpoint.export_safetensors(state, path, mesh)
    loss = fzero.sharded_forward(mlp_loss, mesh)(state, (xs[0].float(), ys[0].float()))
    return exported, loss


@pytest.mark.parametrize("params", [False, True])
def test_exports_and_forwards_read_an_offloaded_state_as_any_other(
    params: bool, tmp_path: Path
) -> None:
    """fp32 compute over float64 masters, half of them on disk (and their parameter
    shards on the host, or not): the consolidated torch export (weights and AdamW's
    state), the safetensors file and an evaluation equal the on-device state's, bitwise."""
    import safetensors.torch

    plain = run(2, export_and_forward, None, str(tmp_path / "a.safetensors"))[0]
    offload = fzero.Offload("disk", 0.5, str(tmp_path / "spill"), params=params)
    got = run(2, export_and_forward, offload, str(tmp_path / "b.safetensors"))[0]
    fzero.assert_trees_close(got[0], plain[0], rtol=0, atol=0)
    assert torch.equal(got[1], plain[1])
    a = safetensors.torch.load_file(str(tmp_path / "a.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "b.safetensors"))
    fzero.assert_trees_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["from_torch", "out of place"])
def test_large_host_pieces_of_other_optimizers_train_bitwise(which: str) -> None:
    """Shards over a block, stepped by optimizers the blocks cannot serve (a state made
    on the first update; no in-place update): stepped whole, and bitwise the on-device
    run (three steps, so a state dropped after each would show)."""
    xs = torch.randn(3, 4, 1500, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = run(2, train_big, xs, None, which)[0]
    got = run(2, train_big, xs, fzero.Offload("host"), which)[0]
    fzero.assert_trees_close(got, plain, rtol=0, atol=0)
    assert not torch.equal(got["w"], big_params()["w"])


def train_bf16_masked(mesh: fzero.Mesh, offload: Any) -> Any:
    params = {k: v.to(torch.bfloat16) for k, v in big_params().items()}
    opt = fzero.optim.adamw(lr=0.01, weight_decay=0.33, mask=no_decay)  # 1 - lr * wd: no bf16
    state = fzero.shard_state(params, opt, mesh, stage=1, offload=offload)
    step = fzero.sharded_step(lambda p, x: big_loss(p, x).float(), opt, mesh, stage=1)
    x = torch.randn(4, 1500, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for _ in range(2):
        state, _ = step(state, x)
    return fzero.master_params(state, mesh)


def test_bf16_parameters_with_a_decay_mask_offloaded_in_blocks_bitwise() -> None:
    """Masters at the parameters' bf16, a mask cutting a shard (a 0/1 tensor) while its
    blocks inside one leaf get a flag: the decay rounds alike either way (as torch's
    `p.mul_(1 - lr * wd)`)."""
    plain = run(1, train_bf16_masked, None)[0]
    got = run(1, train_bf16_masked, fzero.Offload("host"))[0]
    fzero.assert_trees_close(got, plain, rtol=0, atol=0)
    assert not torch.equal(got["w"], big_params()["w"].to(torch.bfloat16))


def nan_step(mesh: fzero.Mesh, offload: Any) -> Any:
    params = make_params(DIMS, torch.float64, 5)
    opt = optimizer()
    kw: dict[str, Any] = dict(stage=1, layout="tensor", units=LAYER_UNITS)
    state = fzero.shard_state(params, opt, mesh, offload=offload, **kw)
    step = fzero.sharded_step(mlp_loss, opt, mesh, **kw)
    x = torch.randn(2, DIMS[0], dtype=torch.float64)
    x[0, 0] = float("nan") if mesh.rank == 0 else 0.0
    state, _ = step(state, (x, torch.randn(2, DIMS[-1], dtype=torch.float64)))
    return fzero.master_params(state, mesh)


def test_a_nan_gradient_carries_on_as_on_the_device() -> None:
    """No loss scaler: a NaN gradient makes NaN masters, offloaded as on the device; the
    clipping norm, NaN in every unit alike, is not taken for a unit-dependent state (three
    ranks, one of which owns no tensor)."""
    plain = run(3, nan_step, None)[0]
    got = run(3, nan_step, fzero.Offload("host"))[0]
    for a, b in zip(
        fzero._core._tree.tree_flatten(got)[0], fzero._core._tree.tree_flatten(plain)[0]
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert any(torch.isnan(x).any() for x in fzero._core._tree.tree_flatten(got)[0])


def mixed_dtypes_round_trip(mesh: fzero.Mesh, path: str, directory: str) -> Any:
    g = torch.Generator().manual_seed(6)
    params = {
        "a": torch.randn(7, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(5, generator=g, dtype=torch.float32),
        "empty": torch.zeros(0, dtype=torch.float32),
    }
    opt = fzero.optim.adam(lr=0.1)
    offload = fzero.Offload("disk", 1.0, directory)
    kw: dict[str, Any] = dict(stage=3, layout="tensor")
    state = fzero.shard_state(params, opt, mesh, offload=offload, **kw)

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (p["a"].sum(0) * x).sum() + p["b"].double().pow(2).sum() + p["empty"].sum()

    step = fzero.sharded_step(loss, opt, mesh, **kw)
    state, _ = step(state, torch.ones(3, dtype=torch.float64))
    fzero.checkpoint.save(state, path, mesh)
    loaded = fzero.checkpoint.load(path, mesh, opt, params, offload=offload, **kw)
    return fzero.gather_params(state.params, mesh), fzero.gather_params(loaded.params, mesh)


def test_a_model_of_several_dtypes_and_an_empty_leaf_offloads_to_disk_and_saves(
    tmp_path: Path,
) -> None:
    """Masters at each bucket's own dtype (float64 and float32) and a 0-element piece (the
    tensor layout, two ranks): made, stepped, saved and loaded from disk."""
    for before, after in run(2, mixed_dtypes_round_trip, str(tmp_path / "ck"), str(tmp_path / "s")):
        fzero.assert_trees_close(after, before, rtol=0, atol=0)
        assert not torch.equal(before["b"], mixed_b())


def mixed_b() -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    torch.randn(7, 3, generator=g, dtype=torch.float64)
    return torch.randn(5, generator=g, dtype=torch.float32)
