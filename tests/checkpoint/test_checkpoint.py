"""Checkpoints: resharding N -> M and stage a -> b, exact resume, crashes, bad files, export."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
import fzero.checkpoint._disk
from fzero import checkpoint as ck
from tests.gloo_pool import GlooPool
from tests.support import (
    OPTIMIZERS,
    Case,
    errors_on_every_rank,
    make_optimizer,
    make_params,
    mlp_loss,
    run,
    train_reference,
)

F64 = torch.float64
BATCH = 12  # rows of a global batch: divisible by every world size 1-4
POINTWISE = ["sgd", "momentum", "nesterov", "adam", "adamw", "torch_rmsprop", "torch_adamw"]
TIGHT = {"rtol": 1e-10, "atol": 1e-12}

# Functions the gloo pool runs are module-level: spawned ranks import them by name.


@dataclass
class Job:
    """A training run: initial params, per-step global batches, optimizer, frozen prefixes."""

    params: dict[str, Any]
    xs: torch.Tensor  # (steps, BATCH, d_in)
    ys: torch.Tensor
    optimizer: str
    frozen: list[str] | None = None


def make_job(dims: list[int], steps: int, seed: int, optimizer: str, **kw: Any) -> Job:
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, BATCH, dims[0], generator=g, dtype=F64)
    ys = torch.randn(steps, BATCH, dims[-1], generator=g, dtype=F64)
    return Job(make_params(dims, F64, seed), xs, ys, optimizer, **kw)


def reference(job: Job) -> dict[str, Any]:
    return train_reference(Case(job.params, job.xs, job.ys, 1, job.optimizer))


def train(mesh: fzero.Mesh, job: Job, state: fzero.ShardedState, lo: int, hi: int) -> Any:
    opt = make_optimizer(job.optimizer)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=state.stage)
    m = BATCH // mesh.size
    for t in range(lo, hi):
        rows = slice(mesh.rank * m, (mesh.rank + 1) * m)
        state, _ = step(state, (job.xs[t, rows], job.ys[t, rows]))
    return state


def start(mesh: fzero.Mesh, job: Job, stage: int, layout: str, units: Any) -> Any:
    opt = make_optimizer(job.optimizer)
    return fzero.shard_state(
        job.params, opt, mesh, stage=stage, layout=layout, units=units, frozen=job.frozen
    )


def train_and_save(
    mesh: fzero.Mesh, job: Job, k: int, stage: int, layout: str, units: Any, path: str
) -> Any:
    state = train(mesh, job, start(mesh, job, stage, layout, units), 0, k)
    ck.save(state, path, mesh)
    return ck.export_torch(state, None, mesh)


def load_and_train(
    mesh: fzero.Mesh, job: Job, k: int, stage: int, layout: Any, units: Any, path: str
) -> tuple[Any, Any, Any]:
    opt = make_optimizer(job.optimizer)
    state = ck.load(path, mesh, opt, job.params, stage=stage, layout=layout, units=units)
    assert state.step == k
    exported = ck.export_torch(state, None, mesh)
    state = train(mesh, job, state, k, job.xs.shape[0])
    return exported, fzero.gather_params(state.params, mesh), ck.export_torch(state, None, mesh)


def train_all(mesh: fzero.Mesh, job: Job, stage: int, layout: str, units: Any) -> Any:
    state = train(mesh, job, start(mesh, job, stage, layout, units), 0, job.xs.shape[0])
    return None, fzero.gather_params(state.params, mesh), ck.export_torch(state, None, mesh)


def assert_same_export(actual: Any, expected: Any, what: str) -> None:
    """Bitwise: parameters and every optimizer-state tensor, keys and dtypes included."""
    (ma, oa), (me, oe) = actual, expected
    assert list(ma) == list(me), what
    for key in me:
        assert ma[key].dtype == me[key].dtype and torch.equal(ma[key], me[key]), f"{what}: {key}"
    assert oa["param_groups"] == oe["param_groups"], what
    assert oa["state"].keys() == oe["state"].keys(), what
    for i, se in oe["state"].items():
        sa = oa["state"][i]
        assert sa.keys() == se.keys(), f"{what}: param {i}: {sorted(sa)} vs {sorted(se)}"
        for key in se:
            same = sa[key].dtype == se[key].dtype and torch.equal(sa[key], se[key])
            assert same, f"{what}: state of param {i}, {key!r}"


# --- resharding: any world size, stage, layout and units -----------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@given(
    st.builds(
        make_job,
        st.lists(st.integers(1, 5), min_size=2, max_size=4),
        st.integers(2, 3),
        st.integers(0, 2**16),
        st.sampled_from(POINTWISE),
    ),
    st.data(),
)
def test_load_reshards_to_any_world_size_stage_and_layout(job: Job, data: st.DataObject) -> None:
    n1, n2 = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    s1, s2 = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    layouts = st.sampled_from(["flat", "tensor"])
    l1, l2 = data.draw(layouts), data.draw(layouts)
    u1 = data.draw(st.sampled_from([None, ["layers.0"]]))
    u2 = data.draw(st.sampled_from([None, [], ["layers.0"]]))
    k = data.draw(st.integers(0, job.xs.shape[0] - 1))  # 0: saved before any step
    with tempfile.TemporaryDirectory() as d:
        saved = run(n1, train_and_save, job, k, s1, l1, u1, d)[0]
        results = run(n2, load_and_train, job, k, s2, l2, u2, d)
    what = f"{n1} ranks stage {s1} {l1} -> {n2} ranks stage {s2} {l2}, {job.optimizer}"
    assert_same_export(results[0][0], saved, what)
    expected = reference(job)
    for rank, (_, params, _) in enumerate(results):
        fzero.assert_trees_close(params, expected, **TIGHT, what=f"{what}, rank {rank}")


def load_and_save(mesh: fzero.Mesh, job: Job, src: str, dst: str, stage: int, layout: str) -> Any:
    state = ck.load(
        src, mesh, make_optimizer(job.optimizer), job.params, stage=stage, layout=layout
    )
    ck.save(state, dst, mesh)
    return ck.export_torch(state, None, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_empty_and_0d_leaves_survive_a_chain_of_reshards(tmp_path: Path) -> None:
    job = make_job([2, 3], 3, 31, "torch_adamw")  # from_torch: skips the empty leaf
    job.params["unused"] = torch.zeros(0, 4, dtype=F64)
    first = run(3, train_and_save, job, 1, 0, "flat", None, str(tmp_path / "0"))[0]
    for i, (n, stage, layout) in enumerate([(2, 3, "tensor"), (4, 1, "flat"), (1, 2, "tensor")]):
        src, dst = str(tmp_path / str(i)), str(tmp_path / str(i + 1))
        again = run(n, load_and_save, job, src, dst, stage, layout)[0]
        assert_same_export(again, first, f"hop {i + 1}: {n} ranks stage {stage} {layout}")
    results = run(3, load_and_train, job, 1, 3, "flat", None, str(tmp_path / "3"))
    fzero.assert_trees_close(results[0][1], reference(job), **TIGHT)


def _mixed_dtypes(job: Job) -> Job:
    job.params["shift"] = job.params["shift"].float()  # a second bucket per unit
    return job


RESUME = {
    "2-ranks-stage3-flat-adamw": (2, 3, "flat", make_job([3, 4, 2], 4, 1, "adamw"), None),
    "3-ranks-stage1-tensor-rmsprop": (
        3, 1, "tensor", make_job([2, 5, 3], 4, 2, "torch_rmsprop"), ["layers.1"],
    ),
    "4-ranks-stage2-flat-momentum": (
        4, 2, "flat", make_job([4, 3], 4, 3, "momentum"), ["layers.0"],
    ),
    "1-rank-stage0-adam": (1, 0, "flat", make_job([3, 2, 2], 4, 4, "adam"), None),
    "3-ranks-stage3-tensor-frozen-mixed-dtypes": (
        3, 3, "tensor",
        _mixed_dtypes(make_job([3, 3, 2], 4, 5, "adam", frozen=["scale", "layers.0.b"])),
        ["layers.0"],
    ),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(RESUME))
def test_resume_after_all_ranks_are_gone_is_bitwise_exact(name: str, tmp_path: Path) -> None:
    n, stage, layout, job, units = RESUME[name]
    uninterrupted = run(n, train_all, job, stage, layout, units)
    run(n, train_and_save, job, 2, stage, layout, units, str(tmp_path))  # then the ranks exit
    resumed = run(n, load_and_train, job, 2, stage, None, None, str(tmp_path))
    for rank, ((_, expected, _), (_, actual, _)) in enumerate(zip(uninterrupted, resumed)):
        paths = fzero._core._tree.leaf_paths(expected)
        pairs = zip(
            fzero._core._tree.tree_flatten(expected)[0], fzero._core._tree.tree_flatten(actual)[0]
        )
        for path, (e, a) in zip(paths, pairs):
            assert e.dtype == a.dtype and torch.equal(e, a), f"{name} rank {rank}: {path}"
    # The optimizer state after the remaining steps is bitwise the same too.
    assert_same_export(resumed[0][2], uninterrupted[0][2], name)


def files_read(mesh: fzero.Mesh, job: Job, path: str) -> list[int]:
    seen: list[int] = []
    original = fzero.checkpoint._disk.FileSource._load

    def spy(self: Any, rank: int) -> Any:
        seen.append(rank)
        return original(self, rank)

    fzero.checkpoint._disk.FileSource._load = spy  # in this rank's forked copy only
    ck.load(path, mesh, make_optimizer(job.optimizer), job.params, stage=3)
    return sorted(seen)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stage_3_rank_reads_only_the_shards_its_slice_overlaps(tmp_path: Path) -> None:
    job = make_job([4, 4, 2], 1, 41, "adam")  # 32 elements: 8 per saving rank
    run(4, train_and_save, job, 1, 3, "flat", None, str(tmp_path))
    # Rank 0's file also holds the step count.
    assert run(4, files_read, job, str(tmp_path)) == [[0], [0, 1], [0, 2], [0, 3]]
    assert run(2, files_read, job, str(tmp_path)) == [[0, 1], [0, 2, 3]]


# --- crash safety: a writer SIGKILLed mid-save leaves the previous checkpoint loadable -----


def save_and_die(mesh: fzero.Mesh, job: Job, point: str, victim: int, path: str) -> None:
    def die(where: str, file: str) -> None:
        if where == point:
            if where == "rank-file":  # half a shard on disk, as if the writer died writing it
                with open(file, "r+b") as f:
                    f.truncate(os.path.getsize(file) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

    if mesh.rank == victim:  # this rank's own (forked) copy of the module
        fzero.checkpoint._disk._crash_hook = die
    ck.save(train(mesh, job, start(mesh, job, 3, "flat", None), 0, 3), path, mesh)


def load_and_export(mesh: fzero.Mesh, job: Job, path: str, stage: int = 1) -> Any:
    like = fzero._core._tree.tree_map(lambda x: x.to("meta"), job.params)  # shapes and dtypes only
    state = ck.load(path, mesh, make_optimizer(job.optimizer), like, stage=stage)
    return ck.export_torch(state, None, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    job = make_job([3, 4, 2], 3, 7, "adamw")
    path = str(tmp_path / "ckpt")
    first = run(2, train_and_save, job, 1, 3, "flat", None, path)[0]
    for point, victim in [("rank-file", 1), ("metadata", 0), ("commit", 0)]:
        with pytest.raises(fzero.RankFailure, match=f"rank {victim} of 2 died"):
            run(2, save_and_die, job, point, victim, path)
        assert_same_export(run(3, load_and_export, job, path)[0], first, f"killed at {point}")
    leftovers = sorted(os.listdir(path))
    # Interrupted saves: rank 0 killed leaves its temporary directory; rank 1 killed, rank 0
    # removes it as the failure reaches it (unless the run's end kills it first).
    assert 1 <= sum(n.startswith(".tmp-") for n in leftovers) <= 2, leftovers
    assert sum(n.startswith("v-") for n in leftovers) == 2, leftovers  # one killed before LATEST
    # The next save succeeds, becomes LATEST and clears the debris.
    second = run(2, train_and_save, job, 2, 1, "tensor", None, path)[0]
    assert_same_export(run(1, load_and_export, job, path)[0], second, "after the next save")
    assert sorted(n for n in os.listdir(path) if n != "LATEST") == [_latest(path)]


def _latest(path: str) -> str:
    return Path(path, "LATEST").read_text().strip()


# --- bad files, another model, another optimizer: clear errors ----------------------------

BAD_JOB = make_job([3, 4, 2], 2, 11, "adam")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A good checkpoint: 2 ranks, stage 3, one unit; tests damage copies of it."""
    path = str(tmp_path_factory.mktemp("ckpt") / "good")
    run(2, train_and_save, BAD_JOB, 1, 3, "flat", ["layers.0"], path)
    return path


@pytest.fixture
def version(saved: str, tmp_path: Path) -> Iterator[Path]:
    """A copy of the good checkpoint's committed version."""
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    yield target / _latest(str(target))


def _load_error(path: Any, job: Job = BAD_JOB, **kw: Any) -> str:
    with pytest.raises(ck.CheckpointError) as info:
        run(1, _load, job, str(path), kw)
    return str(info.value)


def _load(mesh: fzero.Mesh, job: Job, path: str, kw: dict[str, Any]) -> Any:
    opt = kw.pop("optimizer", None) or make_optimizer(job.optimizer)
    return ck.load(path, mesh, opt, kw.pop("params_like", job.params), stage=2, **kw)


@pytest.mark.multiprocess
def test_a_truncated_shard_is_named(version: Path) -> None:
    shard = version / "rank-00001-of-00002.pt"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert "rank-00001-of-00002.pt (written by rank 1 of 2) is truncated" in _load_error(version)


@pytest.mark.multiprocess
def test_a_corrupted_shard_is_named(version: Path) -> None:
    shard = version / "rank-00000-of-00002.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    message = _load_error(version.parent)  # through LATEST
    assert "rank-00000-of-00002.pt (written by rank 0 of 2) is corrupted" in message


@pytest.mark.multiprocess
def test_a_missing_shard_is_named(version: Path) -> None:
    (version / "rank-00001-of-00002.pt").unlink()
    message = _load_error(version)
    assert "missing shard file" in message and "rank-00001-of-00002.pt" in message


@pytest.mark.multiprocess
def test_corrupted_metadata_and_a_missing_pointer_are_named(version: Path) -> None:
    meta = version / "metadata.json"
    meta.write_text(meta.read_text().replace('"step": 1', '"step": 7'))
    assert "metadata.json is corrupted (checksum mismatch)" in _load_error(version)
    meta.write_text("{not json")
    assert "metadata.json is corrupted" in _load_error(version)
    (version.parent / "LATEST").unlink()
    assert "(no LATEST file; only an interrupted save)" in _load_error(version.parent)
    assert "not a directory" in _load_error(version.parent / "nowhere")


@pytest.mark.multiprocess
def test_a_directory_of_other_files_says_how_to_read_them(tmp_path: Path) -> None:
    # Each was "no LATEST file; only an interrupted save" before.
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert "read it with checkpoint.import_dcp" in _load_error(tmp_path / "dcp")
    assert "read them with init.from_file or import_torch" in _load_error(tmp_path / "hf")
    assert "(no LATEST file)" in _load_error(tmp_path / "empty")


class _Payload:
    """Unpickling this runs os.mkdir(marker): the code a malicious checkpoint would run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def _forge(directory: Path, name: str, blob: bytes) -> None:
    """Replaces a shard file and re-signs the metadata, as an attacker with write access."""
    (directory / name).write_bytes(blob)
    outer = json.loads((directory / "metadata.json").read_text())
    body = outer["body"]
    for info in body["files"]:
        if info["name"] == name:
            info.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    text = json.dumps(body, sort_keys=True)
    outer = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body}
    (directory / "metadata.json").write_text(json.dumps(outer))


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_a_shard_that_would_run_code_is_refused(version: Path, tmp_path: Path, how: str) -> None:
    marker = str(tmp_path / "pwned")
    payload = {"p0": _Payload(marker)}
    if how == "pickle":
        blob = pickle.dumps(payload)
    else:
        with tempfile.TemporaryFile() as f:
            torch.save(payload, f)
            f.seek(0)
            blob = f.read()
    _forge(version, "rank-00000-of-00002.pt", blob)
    message = _load_error(version)
    assert "refusing to load" in message and "rank-00000-of-00002.pt" in message
    assert not os.path.exists(marker), "the payload ran"


@pytest.mark.multiprocess
def test_another_models_checkpoint_names_the_leaves_that_differ(version: Path) -> None:
    other = make_job([3, 5, 2], 2, 11, "adam")
    message = _load_error(version, other)
    assert "holds a different model: leaf 'layers.0.b' is saved as (4,) torch.float64" in message
    # A layer more or less is named, not the first leaf after it (which both models have:
    # "params_like has leaf 'layers.2.b' where the checkpoint has 'scale'", before).
    deeper = make_job([3, 4, 2, 2], 2, 11, "adam")
    said = "2 leaves params_like has and the checkpoint lacks: ['layers.2.b', 'layers.2.w']"
    assert said in _load_error(version, deeper)
    shallower = make_job([3, 2], 2, 11, "adam")
    said = "2 leaves the checkpoint has and params_like lacks: ['layers.1.b', 'layers.1.w']"
    assert said in _load_error(version, shallower)


@pytest.mark.multiprocess
def test_another_optimizers_state_does_not_fit(version: Path) -> None:
    message = _load_error(version, optimizer=fzero.optim.sgd(lr=0.1, momentum=0.9))
    assert "does not fit this optimizer" in message and "AdamState" in message
    amsgrad = fzero.optim.adam(lr=0.1, amsgrad=True)
    assert "per-parameter ['mu', 'nu', 'nu_max']" in _load_error(version, optimizer=amsgrad)


@pytest.mark.multiprocess
def test_another_torch_optimizers_state_does_not_fit(tmp_path: Path) -> None:
    # A from_torch state is a dict per tensor: before the check, AdamW's loaded into SGD
    # with momentum, whose step read the missing momentum buffer as fresh, and into Adam
    # with amsgrad, whose step raised a bare KeyError.
    job = make_job([3, 4, 2], 2, 13, "torch_adamw")
    run(2, train_and_save, job, 1, 1, "flat", None, str(tmp_path))
    for cls, kw, keeps in [
        (torch.optim.SGD, {"momentum": 0.9}, "['momentum_buffer']"),
        (torch.optim.Adam, {"amsgrad": True}, "'max_exp_avg_sq'"),
    ]:
        message = _load_error(tmp_path, job, optimizer=fzero.optim.from_torch(cls, lr=0.1, **kw))
        assert "saved optimizer state keeps ['exp_avg', 'exp_avg_sq', 'step'] per tensor" in message
        assert keeps in message.partition("this optimizer keeps")[2], message
    adamw = fzero.optim.from_torch(torch.optim.AdamW, lr=0.01)
    run(1, _load, job, str(tmp_path), {"optimizer": adamw})  # its own class fits


@pytest.mark.multiprocess
def test_a_leaf_frozen_when_saved_has_no_state_to_train_from(tmp_path: Path) -> None:
    job = make_job([3, 4, 2], 2, 12, "adam", frozen=["scale"])
    run(2, train_and_save, job, 1, 1, "flat", None, str(tmp_path))
    both = run(3, load_and_export, job, str(tmp_path), 3)[0]  # frozen as saved
    assert len(both[1]["state"]) == len(both[0]) - 1
    assert "'scale' has no saved optimizer state" in _load_error(tmp_path, job, frozen=[])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_per_tensor_state_moves_between_tensor_layouts_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Adafactor's factored moments belong to whole matrices: any world size and stage
    # with layout="tensor" continues exactly; a flat layout is refused, not approximated.
    # Registered for this test only: `cases()` draws from the registry.
    monkeypatch.setitem(OPTIMIZERS, "torch_adafactor", (None, torch.optim.Adafactor, {"lr": 0.01}))
    job = make_job([4, 6, 3], 3, 13, "torch_adafactor")
    run(2, train_and_save, job, 1, 3, "tensor", None, str(tmp_path))
    results = run(3, load_and_train, job, 1, 1, "tensor", None, str(tmp_path))
    for params in (r[1] for r in results):
        fzero.assert_trees_close(params, reference(job), **TIGHT)
    message = _load_error(tmp_path, job, layout="flat")
    assert "_var' " in message and "(load with layout='tensor')" in message


# --- consolidated export to plain torch, and import back ----------------------------------


class Net(nn.Module):
    """`head` is registered first but sorts last: the optimizer's numbering must follow
    registration order (torch's), not optree's sorted flatten order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3)
        self.body = nn.ModuleList([nn.Linear(3, 4), nn.Linear(4, 4)])
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.tanh(layer(x))
        return self.head(x) * self.gain


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


NET_X = torch.randn(5, BATCH, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
NET_Y = torch.randn(5, BATCH, 3, generator=torch.Generator().manual_seed(2), dtype=F64)


def torch_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    _, cls, kwargs = OPTIMIZERS[name]
    return cls(params, foreach=False, **kwargs)


def torch_steps(net: Net, opt: torch.optim.Optimizer, lo: int, hi: int) -> None:
    for t in range(lo, hi):
        opt.zero_grad()
        ((net(NET_X[t]) - NET_Y[t]) ** 2).mean().backward()
        opt.step()


def net_steps(mesh: fzero.Mesh, name: str, net: Net, state: Any, lo: int, hi: int) -> Any:
    def loss_fn(params: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(net, params, (x,)) - y) ** 2).mean()

    step = fzero.sharded_step(loss_fn, make_optimizer(name), mesh, stage=state.stage)
    m = BATCH // mesh.size
    for t in range(lo, hi):
        rows = slice(mesh.rank * m, (mesh.rank + 1) * m)
        state, _ = step(state, (NET_X[t, rows], NET_Y[t, rows]))
    return state


EXPORTS = [
    ("adamw", 2, 3, "flat", None),
    ("adam", 1, 0, "flat", ["body.0.bias"]),
    ("momentum", 3, 1, "tensor", None),
    ("torch_rmsprop", 2, 2, "flat", ["gain"]),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "n", "stage", "layout", "frozen"), EXPORTS)
def test_export_loads_into_torch_and_trains_on_identically(
    name: str, n: int, stage: int, layout: str, frozen: Any, tmp_path: Path
) -> None:
    net = make_net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    _, cls, kwargs = OPTIMIZERS[name]
    hyper = cls([torch.zeros(1)], foreach=False, **kwargs).defaults
    file = str(tmp_path / "consolidated.pt")

    def fz(mesh: fzero.Mesh) -> Any:
        opt = make_optimizer(name)
        units = ["body.0", "head"]
        state = fzero.shard_state(
            params, opt, mesh, stage=stage, layout=layout, units=units, frozen=frozen
        )
        state = net_steps(mesh, name, net, state, 0, 2)
        streamed = ck.export_torch(state, file, mesh, hyperparams=hyper)  # writes, returns None
        out = ck.export_torch(state, None, mesh, hyperparams=hyper)
        state = net_steps(mesh, name, net, state, 2, 5)
        return streamed, out, fzero.gather_params(state.params, mesh)

    results = run(n, fz)
    assert all(r[0] is None and r[1] is None for r in results[1:])
    assert results[0][0] is None
    (model_sd, optim_sd), expected = results[0][1:]
    assert list(model_sd) == [k for k, _ in net.named_parameters()]  # registration order
    on_disk = torch.load(file, weights_only=True)
    assert_same_export((on_disk["model"], on_disk["optimizer"]), (model_sd, optim_sd), "file")
    plain = make_net()
    for p in plain.parameters():
        p.data.zero_()
    plain.load_state_dict(model_sd)  # strict: every key, right shapes
    for key, p in plain.named_parameters():
        p.requires_grad_(key not in (frozen or []))
    opt = torch_optimizer(name, [p for p in plain.parameters() if p.requires_grad])
    opt.load_state_dict(optim_sd)
    torch_steps(plain, opt, 2, 5)
    actual = {k: v.detach() for k, v in plain.named_parameters()}
    fzero.assert_trees_close(actual, expected, **TIGHT, what=f"torch after export, {name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("name", "n", "stage", "layout", "offload"),
    [
        ("adamw", 2, 3, "flat", None),
        ("torch_rmsprop", 3, 1, "tensor", None),
        ("nesterov", 2, 0, "flat", None),
        ("adamw", 3, 2, "flat", "disk"),
        ("torch_rmsprop", 2, 3, "flat", "host"),
    ],
)
def test_import_from_torch_trains_on_like_torch(
    name: str, n: int, stage: int, layout: str, offload: str | None, tmp_path: Path
) -> None:
    net = make_net()
    opt = torch_optimizer(name, net.parameters())
    torch_steps(net, opt, 0, 2)
    model_sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    optim_sd = copy.deepcopy(opt.state_dict())
    torch_steps(net, opt, 2, 5)
    expected = {k: v.detach() for k, v in net.named_parameters()}

    def fz(mesh: fzero.Mesh) -> Any:
        spill = str(tmp_path) if offload == "disk" else None
        where = None if offload is None else fzero.Offload(offload, directory=spill)
        state = ck.import_torch(
            model_sd, optim_sd, make_optimizer(name), mesh, stage=stage, layout=layout,
            offload=where,
        )  # fmt: skip
        back = ck.export_torch(state, None, mesh)
        state = net_steps(mesh, name, make_net(), state, 2, 5)
        return back, fzero.gather_params(state.params, mesh)

    results = run(n, fz)
    (back_model, back_optim), _ = results[0]  # import then export: the same dicts, bitwise
    no_groups = {"param_groups": []}
    assert_same_export(
        (back_model, {**back_optim, **no_groups}), (model_sd, {**optim_sd, **no_groups}), name
    )
    for rank, (_, params) in enumerate(results):
        fzero.assert_trees_close(params, expected, **TIGHT, what=f"{name} rank {rank}")


# --- real torch.distributed: spawned gloo ranks save and load -----------------------------


# fzero's own optimizers only: a spawned rank's first torch.optim constructor imports
# torch._dynamo, seconds per rank on a small machine.
@pytest.fixture(scope="module")
def gloo2() -> Iterator[GlooPool]:
    with GlooPool(2, collective_timeout=30.0, call_timeout=120.0) as pool:
        yield pool


GLOO_CASES = {  # (saver, its stage, loader, its stage, layout): a rank count or "gloo2"
    "gloo-saves": ("gloo2", 3, 3, 1, make_job([3, 4, 2], 3, 21, "adamw")),
    "gloo-loads": (1, 0, "gloo2", 2, make_job([2, 3, 3], 3, 22, "momentum")),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(GLOO_CASES))
def test_gloo_ranks_save_and_load_across_world_sizes(
    gloo2: GlooPool, name: str, tmp_path: Path
) -> None:
    saver, s1, loader, s2, job = GLOO_CASES[name]

    def on(who: Any, *args: Any) -> list[Any]:
        return gloo2.run(*args) if who == "gloo2" else run(who, *args)

    saved = on(saver, train_and_save, job, 1, s1, "flat", None, str(tmp_path))[0]
    results = on(loader, load_and_train, job, 1, s2, "tensor", [], str(tmp_path))
    assert_same_export(results[0][0], saved, name)
    for rank, (_, params, _) in enumerate(results):
        fzero.assert_trees_close(params, reference(job), **TIGHT, what=f"{name} rank {rank}")


def save_and_load_buffers(mesh: fzero.Mesh, path: str, stage: int, like: bool) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, buffers=buffers)

    def loss_fn(p: dict, b: dict, x: torch.Tensor) -> Any:
        out = functional_call(model, {**p, **b}, (x,))
        return out.square().mean(), b

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, buffer_sync="mean")
    state, _ = step(state, torch.randn(5, 3, dtype=torch.float64) + mesh.rank)
    ck.save(state, path, mesh)
    loaded = ck.load(path, mesh, opt, params, stage=stage, buffers_like=buffers if like else None)
    wider = {**buffers, "1.running_mean": torch.zeros(5, dtype=torch.float64)}
    try:  # another model's buffers: refused, not loaded in the checkpoint's shapes
        ck.load(path, mesh, opt, params, stage=stage, buffers_like=wider)
    except ck.CheckpointError as exc:
        return state.buffers, loaded.buffers, str(exc)
    return state.buffers, loaded.buffers, "loaded"


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "like"), [(0, True), (3, False)])
def test_buffers_are_saved_and_loaded(tmp_path: Path, stage: int, like: bool) -> None:
    """BatchNorm's running statistics and batch count come back bitwise, in the given
    structure (or as a dict by path)."""
    for saved, loaded, wider in run(2, save_and_load_buffers, str(tmp_path / "c"), stage, like):
        assert "buffer '1.running_mean' is (4,) in the checkpoint, (5,) in buffers_like" in wider
        assert (
            set(saved)
            == set(loaded)
            == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        )
        assert int(saved["1.num_batches_tracked"]) == 1
        assert all(torch.equal(saved[k], loaded[k]) for k in saved)


def export_mixed(mesh: fzero.Mesh, path: str) -> Any:
    params = {
        "w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)),
        "b": torch.ones(3),
    }
    prec = fzero.Precision(param_dtype=torch.bfloat16)
    state = fzero.shard_state(params, fzero.optim.adam(lr=0.1), mesh, stage=3, precision=prec)
    out = ck.export_torch(state, None, mesh)
    return params, out


@pytest.mark.multiprocess
def test_export_of_a_mixed_precision_state_is_the_float32_masters(tmp_path: Path) -> None:
    params, (model, _) = run(2, export_mixed, str(tmp_path))[0]
    assert all(model[k].dtype == torch.float32 and torch.equal(model[k], params[k]) for k in params)


def chain_round_trip(mesh: fzero.Mesh, path: str) -> Any:
    """A chain of clipping and Adam over exactly two pieces: the state's root, a tuple of
    two states, is the shape of a per-piece subtree of two pieces (it was read as one,
    and saving failed naming a ClipState)."""
    g = torch.Generator().manual_seed(4)
    params = {
        "a": torch.randn(5, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }
    opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(0.1), fzero.optim.adam(lr=0.1))
    state = fzero.shard_state(params, opt, mesh, stage=1, units=["a"])
    assert len(state.layout.buckets) == 2
    step = fzero.sharded_step(
        lambda p, x: p["a"].sum() * x + p["b"].pow(2).sum(), opt, mesh, stage=1
    )
    state, _ = step(state, torch.tensor(2.0, dtype=torch.float64))
    ck.save(state, path, mesh)
    loaded = ck.load(path, mesh, opt, params, stage=1)
    return state.opt_state, loaded.opt_state


def test_a_chain_over_two_pieces_saves_and_loads(tmp_path: Path) -> None:
    saved, loaded = run(1, chain_round_trip, str(tmp_path / "ckpt"))[0]
    fzero.assert_trees_close(loaded, saved, rtol=0, atol=0)
    assert float(saved[0].norm) > 0.1  # the clip's norm travelled, and clipping happened


@pytest.mark.multiprocess
def test_import_torch_takes_a_state_dict_with_buffers_whole() -> None:
    """`model.state_dict()` as it is (BatchNorm's statistics and step counter beside the
    weights) with `buffers=`: the buffers take its values and the rest are the
    parameters; one more step trains as torch does."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5)).double()
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    net(x[0]).square().mean().backward()  # training mode: the statistics move
    opt.step()
    model_sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    optim_sd = copy.deepcopy(opt.state_dict())
    net.eval()
    opt.zero_grad()
    net(x[1]).square().mean().backward()
    opt.step()
    want = {k: v.detach() for k, v in net.named_parameters()}

    def fz(mesh: fzero.Mesh) -> Any:
        adamw = fzero.optim.adamw(lr=0.05)
        state = ck.import_torch(model_sd, optim_sd, adamw, mesh, stage=2,
                                buffers=dict(net.named_buffers()))  # fmt: skip

        def loss(p: Any, b: Any, batch: torch.Tensor) -> Any:
            return torch.func.functional_call(net, (p, b), (batch,)).square().mean(), b

        step = fzero.sharded_step(loss, adamw, mesh, stage=2)
        buffers = dict(state.buffers)
        state, _ = step(state, x[1, 3 * mesh.rank : 3 * mesh.rank + 3])
        return buffers, fzero.gather_params(state.params, mesh)

    for buffers, params in run(2, fz):
        assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
        assert all(torch.equal(buffers[k], model_sd[k]) for k in buffers)
        fzero.assert_trees_close(params, want, **TIGHT, what="after the import")


def _import_into(mesh: fzero.Mesh, sd: dict[str, torch.Tensor], like: dict[str, Any]) -> Any:
    opt = fzero.optim.adamw(lr=0.01)
    empty = {"state": {}, "param_groups": [{"params": list(range(len(like)))}]}
    state = ck.import_torch(sd, empty, opt, mesh, stage=3, params_like=like)
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
def test_import_torch_checks_the_models_shapes_and_casts_to_its_dtypes() -> None:
    # Before, the state took the file's shapes and dtypes: a float32 state dict imported
    # for a float64 model trained in float32, another model's shapes without a word.
    torch.manual_seed(0)
    sd = {k: v.detach() for k, v in nn.Linear(4, 6).state_dict().items()}  # float32
    model = nn.Linear(4, 6).double()
    like = {k: v.detach() for k, v in model.named_parameters()}
    for got in run(2, _import_into, sd, like):
        fzero.assert_trees_close(got, {k: v.double() for k, v in sd.items()}, rtol=0, atol=0)
        assert all(v.dtype == F64 for v in got.values())
    wider = {k: v.detach() for k, v in nn.Linear(4, 8).double().named_parameters()}
    with pytest.raises(ck.CheckpointError, match=r"'bias' is \(6,\), the model's is \(8,\)"):
        run(1, _import_into, sd, wider)


def bf16_model_resumes(mesh: fzero.Mesh, path: str, stage: int) -> Any:
    """A bfloat16 model trained on float32 masters: two steps, a save, a third step; and
    a load given the model's own (bfloat16) parameters, its third step."""
    g = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(4, 3, generator=g).bfloat16(), "b": torch.zeros(3).bfloat16()}
    prec = fzero.Precision(param_dtype=torch.bfloat16, master_dtype=torch.float32)
    opt = fzero.optim.adamw(lr=0.01)
    xs = torch.randn(3, 2 * mesh.size, 4, generator=g)

    def loss_fn(p: Any, x: torch.Tensor) -> torch.Tensor:
        return (x @ p["w"].float() + p["b"].float()).tanh().square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    mine = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    state = fzero.shard_state(params, opt, mesh, stage=stage, precision=prec)
    for t in range(2):
        state, _ = step(state, xs[t, mine])
    ck.save(state, path, mesh)
    on, _ = step(state, xs[2, mine])
    with pytest.raises(ck.CheckpointError, match="Pass the precision it trained with"):
        ck.load(path, mesh, opt, params, stage=stage)
    loaded = ck.load(path, mesh, opt, params, stage=stage, precision=prec)
    again, _ = step(loaded, xs[2, mine])
    first = fzero.master_params(
        fzero.shard_state(params, opt, mesh, stage=stage, precision=prec), mesh
    )
    return fzero.master_params(on, mesh), fzero.master_params(again, mesh), first


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 3])
def test_a_bf16_model_on_float32_masters_loads_with_its_own_parameters(
    tmp_path: Path, stage: int
) -> None:
    # Its checkpoint holds the float32 masters: the model's own bfloat16 parameters were
    # refused as "a different model"; given the precision they load as masters again.
    for on, again, first in run(2, bf16_model_resumes, str(tmp_path / "c"), stage):
        fzero.assert_trees_close(again, on, rtol=0, atol=0)  # bitwise the unbroken run
        assert all(v.dtype == torch.float32 for v in again.values())
        assert not torch.equal(again["w"], first["w"])  # trained


def buffers_under_precision(mesh: fzero.Mesh, path: str) -> Any:
    params = {"w": torch.ones(3, 2)}
    buffers = {"running_mean": torch.arange(3.0)}
    prec = fzero.Precision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    opt = fzero.optim.adamw(lr=0.01)
    made = fzero.shard_state(params, opt, mesh, stage=3, buffers=buffers, precision=prec)
    ck.save(fzero.shard_state(params, opt, mesh, stage=3, buffers=buffers), path, mesh)
    loaded = ck.load(path, mesh, opt, params, stage=3, precision=prec, buffers_like=buffers)
    return made.buffers, loaded.buffers


@pytest.mark.multiprocess
def test_load_casts_buffers_to_the_precisions_buffer_dtype_as_shard_state_does(
    tmp_path: Path,
) -> None:
    made, loaded = run(2, buffers_under_precision, str(tmp_path / "c"))[0]
    assert made["running_mean"].dtype == loaded["running_mean"].dtype == torch.bfloat16
    fzero.assert_trees_close(loaded, made, rtol=0, atol=0)


def load_each_its_own(mesh: fzero.Mesh, job: Job, paths: list[str]) -> Any:
    return ck.load(paths[mesh.rank], mesh, make_optimizer(job.optimizer), job.params, stage=1)


@pytest.mark.multiprocess
def test_ranks_that_resolve_different_versions_are_refused(tmp_path: Path) -> None:
    # A save committing while the ranks read LATEST (here: each rank given its own copy)
    # mixed two checkpoints' shards without a word.
    job = make_job([3, 4, 2], 2, 14, "adam")
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]
    for path in paths:
        run(2, train_and_save, job, 1, 1, "flat", None, path)
    errors = errors_on_every_rank(2, lambda mesh: load_each_its_own(mesh, job, paths))
    assert all("the ranks resolved different versions" in e for e in errors), errors


def import_uneven_steps(mesh: fzero.Mesh, step: int | None) -> int:
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    for t in range(2):
        opt.zero_grad()
        net(torch.ones(1, 3)).sum().backward()
        if t == 1:
            net.bias.grad = None  # torch steps the weight alone: its step is 2, the bias's 1
        opt.step()
    like = {k: v.detach() for k, v in net.named_parameters()}
    fz = fzero.optim.from_torch(torch.optim.AdamW, lr=0.01)
    state = ck.import_torch(
        net.state_dict(),
        opt.state_dict(),
        fz,
        mesh,
        stage=1,
        params_like=like,
        step=step,
        layout="tensor",
    )
    return int(state.step)


@pytest.mark.multiprocess
def test_a_from_torch_import_at_uneven_steps_asks_for_the_step() -> None:
    # Its step count silently became 0: learning-rate schedules restarted.
    with pytest.raises(ck.CheckpointError, match=r"different steps \[1.0, 2.0\]: pass step="):
        run(1, import_uneven_steps, None)
    assert run(1, import_uneven_steps, 2) == [2]


def import_sgd(mesh: fzero.Mesh, step: int | None) -> Any:
    """torch's SGD with momentum, three steps; fzero goes on from its state for two more.
    The parameters, and torch's own after the same five steps."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    xs = torch.randn(5, 4, 3, dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=False)

    def torch_step(t: int) -> None:
        opt.zero_grad()
        net(xs[t]).square().mean().backward()
        opt.step()

    for t in range(3):
        torch_step(t)
    like = {k: v.detach().clone() for k, v in net.named_parameters()}
    fz = fzero.optim.sgd(lr=0.1, momentum=0.9)
    state = ck.import_torch(
        net.state_dict(), opt.state_dict(), fz, mesh, stage=1, params_like=like, step=step
    )
    step_fn = fzero.sharded_step(
        lambda p, x: torch.func.functional_call(net, p, (x,)).square().mean(), fz, mesh, stage=1
    )
    for t in range(3, 5):
        state, _ = step_fn(state, xs[t])
        torch_step(t)
    return fzero.gather_params(state.params, mesh), {
        k: v.detach() for k, v in net.named_parameters()
    }


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_sgd_import_goes_on_with_its_momentum_and_refuses_step_0() -> None:
    """fzero's SGD takes step 0 for its first update, which replaces the momentum buffer
    by the gradient: imported with step=0 the buffers went (a second reader's suspicion,
    confirmed); the docs said step= mattered to schedules only."""
    ((got, want),) = run(1, import_sgd, None)
    fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-14)
    with pytest.raises(ck.CheckpointError, match=r"step=0 with SGD momentum buffers"):
        run(1, import_sgd, 0)
