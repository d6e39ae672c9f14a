"""import_dcp: an FSDP2 checkpoint resumed at another world size, stage, layout, offloaded
or in mixed precision, each rank reading only its ranges; bad checkpoints refused on every
rank."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.state.test_offload import fresh
from tests.support import errors_on_every_rank, map_every_allocation, peak_rss_rise, run

F64 = torch.float64
HYPER = {"lr": 0.05, "weight_decay": 0.1}
SAVED_WORLD, STEPS, PER_RANK = 2, 3, 6  # FSDP2 steps twice on 2 ranks; fzero once more


class Net(nn.Module):
    """Odd shapes (rows split inside a row by 3 ranks), a persistent buffer that scales
    the output and a non-persistent one, as a Hugging Face model's rotary table."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7, dtype=F64)
        self.b = nn.Linear(7, 3, dtype=F64)
        self.register_buffer("scale", torch.full((3,), 2.0, dtype=F64))
        self.register_buffer("table", torch.arange(3, dtype=F64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale + self.table


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = SAVED_WORLD * 3 * PER_RANK  # divisible by 1, 2 and 3 ranks
    x = torch.randn(STEPS, n, 5, generator=gen, dtype=F64)
    return x, torch.randn(STEPS, n, 3, generator=gen, dtype=F64)


def loss_of(net: nn.Module, p: Any, b: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(functional_call(net, (p, b), (x,)), y)


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three steps of one-process torch.optim.AdamW over the whole batch; the starting
    and final parameters."""
    x, y = data()
    torch.manual_seed(4)
    net = Net()
    start = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), **HYPER)
    for k in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k]), y[k]).backward()
        opt.step()
    return start, {k: v.detach() for k, v in net.named_parameters()}


def fsdp2_save(mesh: fzero.Mesh, directory: str) -> None:
    """FSDP2 trains the first two steps on its ranks and saves weights and AdamW state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x, y = data()
    torch.manual_seed(4)
    net = Net()
    fully_shard(net.a, mesh=init_device_mesh("cpu", (mesh.size,)))
    fully_shard(net, mesh=init_device_mesh("cpu", (mesh.size,)))
    opt = torch.optim.AdamW(net.parameters(), **HYPER)
    per = x.shape[1] // mesh.size
    lo, hi = mesh.rank * per, (mesh.rank + 1) * per
    for k in range(STEPS - 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k, lo:hi]), y[k, lo:hi]).backward()
        opt.step()
    dcp.save({**net.state_dict(), "optim": get_optimizer_state_dict(net, opt)},
             checkpoint_id=directory)  # fmt: skip


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = str(tmp_path_factory.mktemp("fsdp2") / "ckpt")
    run(SAVED_WORLD, fsdp2_save, directory)
    return directory


def resume(mesh: fzero.Mesh, directory: str, stage: int, options: dict[str, Any]) -> Any:
    """fzero imports FSDP2's checkpoint on its own ranks and steps the last step."""
    x, y = data()
    net = Net()  # other values: the import replaces the weights and the persistent buffer
    with torch.no_grad():
        net.scale.fill_(-1.0)
    adamw = fzero.optim.adamw(**HYPER)
    meta = {k: torch.empty_like(v, device="meta") for k, v in net.named_parameters()}
    if options.get("offload") == "disk":
        options = {**options, "offload": fzero.Offload("disk", directory=options["spill"])}
    elif options.get("offload") == "host":
        options = {**options, "offload": fzero.Offload("host", 0.5)}
    options.pop("spill", None)
    state = fzero.checkpoint.import_dcp(
        directory, adamw, mesh, meta, stage=stage, buffers=dict(net.named_buffers()), **options
    )
    assert state.step == STEPS - 1
    step = fzero.sharded_step(lambda p, b, batch: (loss_of(net, p, b, *batch), b), adamw, mesh,
                              stage=stage)  # fmt: skip
    per = x.shape[1] // mesh.size
    lo, hi = mesh.rank * per, (mesh.rank + 1) * per
    state, _ = step(state, (x[-1, lo:hi], y[-1, lo:hi]))
    params = fzero.gather_params(state.params, mesh) if stage == 3 else state.params
    return {k: v.detach().clone() for k, v in params.items()}, state.buffers


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world", "stage", "options"),
    [
        (3, 3, {}),
        (3, 3, {"offload": "disk"}),
        (3, 1, {"offload": "host", "layout": "tensor"}),
        (3, 2, {"units": ["a"]}),
        (1, 0, {}),
        (2, 3, {"offload": "host"}),
        (4, 3, {"shard_size": 2, "offload": "disk"}),  # HSDP: two groups of two
    ],
)
def test_an_fsdp2_run_resumes_at_any_world_size_and_stage_as_torch(
    fsdp2_checkpoint: str, tmp_path: Path, world: int, stage: int, options: dict[str, Any]
) -> None:
    start, want = reference()
    options = {**options, "spill": str(tmp_path / "spill")}
    shard_size = options.pop("shard_size", None)
    sim = fzero.Simulation(world, collective_timeout=30, timeout=120, shard_size=shard_size)
    for got, buffers in sim.run(resume, fsdp2_checkpoint, stage, options):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)  # training moved them
        assert torch.equal(buffers["scale"], torch.full((3,), 2.0, dtype=F64))  # saved
        assert torch.equal(buffers["table"], torch.arange(3, dtype=F64))  # kept


def mixed(mesh: fzero.Mesh, directory: str) -> Any:
    net = Net()
    meta = {k: torch.empty_like(v, device="meta") for k, v in net.named_parameters()}
    precision = fzero.Precision(param_dtype=torch.float32)
    state = fzero.checkpoint.import_dcp(
        directory, fzero.optim.adamw(**HYPER), mesh, meta, stage=3, precision=precision,
        loss_scale=fzero.DynamicLossScale(init_scale=2.0**10),
    )  # fmt: skip
    params = fzero.gather_params(state.params, mesh)
    masters = fzero.master_params(state, mesh)
    return params, masters, float(state.scaler.scale)


@pytest.mark.multiprocess
def test_an_fsdp2_checkpoint_becomes_the_masters_of_a_mixed_precision_state(
    fsdp2_checkpoint: str,
) -> None:
    """FSDP2's sharded parameters are the fp32 masters beside its MixedPrecisionPolicy:
    imported under a Precision they stay the masters, and the parameters are their cast."""
    import torch.distributed.checkpoint as dcp

    net = Net()
    saved = {k: torch.empty_like(v) for k, v in net.named_parameters()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(saved, checkpoint_id=fsdp2_checkpoint, no_dist=True)
    for params, masters, scale in run(3, mixed, fsdp2_checkpoint):
        for k, v in saved.items():
            assert torch.equal(masters[k], v), k
            assert params[k].dtype == torch.float32 and torch.equal(params[k], v.float()), k
        assert scale == 2.0**10


def big_checkpoint(directory: str) -> int:
    """A DCP checkpoint of four 2 M-element fp32 weights and AdamW moments, as one process
    writes it; returns its bytes of tensors."""
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    names = [f"w{i}" for i in range(4)]
    sd: dict[str, Any] = {n: torch.randn(2048, 1024, generator=gen) for n in names}
    state = {n: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2048, 1024, generator=gen),
                 "exp_avg_sq": torch.rand(2048, 1024, generator=gen)} for n in names}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**sd, "optim": {"state": state}}, checkpoint_id=directory, no_dist=True)
    return 3 * 4 * 2048 * 1024 * 4


def import_memory(mesh: fzero.Mesh, directory: str, spill: str) -> dict[str, int]:
    """The peak resident rise of importing the big checkpoint at stage 3 (the second
    import: the first loads the code), on the device and offloaded to disk."""
    map_every_allocation()
    like = {f"w{i}": torch.empty(2048, 1024, device="meta") for i in range(4)}
    opt = fzero.optim.adamw(lr=1e-3)
    out = {}
    for tier in ("", "", "disk", "disk"):
        offload = fzero.Offload("disk", directory=spill) if tier else None
        with peak_rss_rise() as m:
            state = fzero.checkpoint.import_dcp(directory, opt, mesh, like, stage=3,
                                                units=list(like), offload=offload)  # fmt: skip
        out[tier or "device"] = m["rise"]
        assert state.step == 3
        del state
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_reads_only_what_it_keeps(tmp_path: Path) -> None:
    """Measured, resident: at stage 3 on 2 ranks a rank's import rises by its half of the
    weights and moments, and the reads in flight (torch's DCP reader loads a saved chunk,
    here a whole 8 MiB tensor, before it cuts the rows asked for): not by the whole
    checkpoint, as when every rank read it whole (151 MiB a rank measured before), nor by
    read blocks left to the cyclic collector (83-92 MiB). Offloaded to disk, by its
    weights and the reads in flight: the moments go to their files a unit at a time."""
    whole = big_checkpoint(str(tmp_path / "ckpt"))
    tensor = 2048 * 1024 * 4
    for m in fresh(import_memory, str(tmp_path / "ckpt"), str(tmp_path / "spill")):
        assert m["device"] <= whole // 2 + 3 * tensor, m  # measured: 64 MiB of 72
        assert m["disk"] <= whole // 6 + 3 * tensor, m  # measured: 32 MiB of 40


def bad_import(mesh: fzero.Mesh, directory: str, other: str, what: str) -> Any:
    net = Net()
    like: dict[str, Any] = {
        k: torch.empty_like(v, device="meta") for k, v in net.named_parameters()
    }
    buffers = None
    if what == "missing":
        like["c.weight"] = torch.empty(3, device="meta")
    elif what == "shape":
        like["a.weight"] = torch.empty(7, 4, device="meta")
    elif what == "different":
        directory = other if mesh.rank == 1 else directory
    elif what == "buffer":
        buffers = {"scale": net.scale, "table": torch.empty(3, device="meta")}
    key = "optimizer" if what == "key" else "optim"  # torchtitan's key, where FSDP2's was used
    return fzero.checkpoint.import_dcp(
        directory,
        fzero.optim.adamw(**HYPER),
        mesh,
        like,
        stage=3,
        optimizer_key=key,
        buffers=buffers,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("missing", "has no weight 'c.weight'"),
        ("shape", r"weight 'a.weight' is saved as \(7, 5\), the model's is \(7, 4\)"),
        ("different", "the ranks see different checkpoints"),
        ("buffer", "buffer 'table' is not in the checkpoint and is given on the meta device"),
        # Before the check, the optimizer silently started afresh: zero moments, step 0.
        (
            "key",
            r"no optimizer state under optimizer_key='optimizer' \(it holds keys other "
            r"than the weights under \['optim', 'scale'\]\)",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_on_every_rank(
    fsdp2_checkpoint: str, tmp_path: Path, what: str, message: str
) -> None:
    import re

    other = str(tmp_path / "other")
    run(1, fsdp2_other, other)
    errors = errors_on_every_rank(2, lambda mesh: bad_import(mesh, fsdp2_checkpoint, other, what))
    for error in errors:
        assert error.startswith("CheckpointError") and re.search(message, error), errors
        assert "import_dcp" in error, errors


def weights_only(mesh: fzero.Mesh, directory: str) -> Any:
    like = {k: torch.empty_like(v, device="meta") for k, v in Net().named_parameters()}
    state = fzero.checkpoint.import_dcp(
        directory, fzero.optim.adamw(**HYPER), mesh, like, stage=1, optimizer_key=None
    )
    return state.params, int(state.opt_state.count)


@pytest.mark.multiprocess
def test_a_weights_only_checkpoint_imports_with_no_optimizer_key(tmp_path: Path) -> None:
    directory = str(tmp_path / "weights")
    run(1, fsdp2_other, directory)
    torch.manual_seed(9)
    want = dict(Net().named_parameters())
    for params, count in run(2, weights_only, directory):
        assert count == 0
        fzero.assert_trees_close(params, want, rtol=0, atol=0)
    with pytest.raises(
        fzero.checkpoint.CheckpointError,
        match=r"no optimizer state under optimizer_key=.optim. \(it holds keys other than "
        r"the weights under \[.scale.\]\)",
    ):
        run(1, lambda mesh: fzero.checkpoint.import_dcp(
            directory, fzero.optim.adamw(**HYPER), mesh, want, stage=1))  # fmt: skip


def fsdp2_other(mesh: fzero.Mesh, directory: str) -> None:
    """Another checkpoint of the same model: one process's weights, no optimizer state."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(9)
    dcp.save(Net().state_dict(), checkpoint_id=directory)


def frozen_bias(mesh: fzero.Mesh, directory: str) -> Any:
    """torch steps a Linear whose bias is frozen and saves; fzero imports the model's own
    parameters (the bias's requires_grad False) and steps on."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    x, y = data()
    torch.manual_seed(1)
    net = nn.Linear(5, 3, dtype=F64)
    net.bias.requires_grad_(False)
    if mesh.rank == 0:
        opt = torch.optim.AdamW([net.weight], **HYPER)
        torch.nn.functional.mse_loss(net(x[0]), y[0][:, :3]).backward()
        opt.step()
        sd = {**net.state_dict(), "optim": get_optimizer_state_dict(net, opt)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(sd, checkpoint_id=directory, no_dist=True)
    fzero._comm.all_gather_object(None, mesh)  # a barrier: rank 0 has written it
    adamw = fzero.optim.adamw(**HYPER)
    state = fzero.checkpoint.import_dcp(directory, adamw, mesh, dict(net.named_parameters()),
                                        stage=3)  # fmt: skip
    step = fzero.sharded_step(
        lambda p, b: torch.nn.functional.mse_loss(functional_call(net, p, (b[0],)), b[1]),
        adamw, mesh, stage=3,
    )  # fmt: skip
    per = x.shape[1] // mesh.size
    rows = slice(mesh.rank * per, (mesh.rank + 1) * per)
    state, _ = step(state, (x[1, rows], y[1, rows, :3]))
    return state.layout.frozen, fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
def test_a_parameter_the_model_freezes_stays_frozen_through_the_import(tmp_path: Path) -> None:
    """The frozen flags come from `params_like`'s requires_grad, as in `shard_state`: a
    frozen bias (no optimizer state in the checkpoint) is not trained with zero moments."""
    x, y = data()
    torch.manual_seed(1)
    net = nn.Linear(5, 3, dtype=F64)
    net.bias.requires_grad_(False)
    bias = net.bias.detach().clone()
    opt = torch.optim.AdamW([net.weight], **HYPER)
    for k in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k]), y[k][:, :3]).backward()
        opt.step()
    want = {k: v.detach() for k, v in net.named_parameters()}
    for frozen, got in run(2, frozen_bias, str(tmp_path / "ckpt")):
        assert frozen == (True, False)  # leaves in path order: bias, weight
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert torch.equal(got["bias"], bias)


def torchtitan_save_and_import(mesh: fzero.Mesh, directory: str) -> Any:
    """FSDP2 steps once and saves as torchtitan does (the optimizer's state dict flattened,
    under "optimizer"); fzero imports it; returns the imported moments (rank 0) and
    FSDP2's own, whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    fully_shard(net, mesh=init_device_mesh("cpu", (mesh.size,)))
    opt = torch.optim.AdamW(net.parameters(), **HYPER)
    net(torch.randn(3, 5, dtype=F64)).sum().backward()
    opt.step()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    dcp.save({**net.state_dict(), "optimizer": get_optimizer_state_dict(net, opt, options=flat)},
             checkpoint_id=directory)  # fmt: skip
    theirs = {
        k: {m: v.full_tensor() for m, v in s.items() if m != "step"}
        for k, s in get_optimizer_state_dict(net, opt)["state"].items()
    }
    like = {k: torch.empty(v.shape, dtype=F64, device="meta") for k, v in net.named_parameters()}
    state = fzero.checkpoint.import_dcp(directory, fzero.optim.adamw(**HYPER), mesh, like,
                                        stage=3, optimizer_key="optimizer")  # fmt: skip
    ours = fzero.checkpoint.export_torch(state, None, mesh)
    return state.step, theirs, ours


@pytest.mark.multiprocess
def test_a_torchtitan_checkpoint_with_its_flattened_optimizer_state_imports(
    tmp_path: Path,
) -> None:
    results = run(2, torchtitan_save_and_import, str(tmp_path / "ckpt"))
    step, theirs, (_, optim_sd) = results[0]  # export_torch returns the dicts on rank 0
    assert step == 1 and all(r[0] == 1 for r in results)
    names = list(theirs)  # the parameters in the model's order, as export_torch numbers them
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim_sd["state"][i][moment], theirs[name][moment]), (name, moment)
