"""Faults in files: untrusted input refused on every rank, failed writes that leave the
previous file intact and no debris, and initializers that leave memory unwritten."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import struct
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fzero
from tests.faults.harness import TIMEOUT, outcomes, raised_together

# Every case starts rank processes and takes about a second.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

D = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, 2)


def tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().named_parameters()}


def meta_params() -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return {k: v.detach() for k, v in Net().named_parameters()}


def _load(mesh: fzero.Mesh, path: str, stage: int) -> dict[str, torch.Tensor]:
    opt = fzero.optim.sgd(lr=0.1)
    init = fzero.init.from_file(path)
    state = fzero.shard_state(meta_params(), opt, mesh, stage=stage, init=init)
    return fzero.gather_params(state.params, mesh)


# -- untrusted files -------------------------------------------------------------------------
def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path: Path, header: dict[str, Any], data: bytes) -> None:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _corrupt(path: Path, how: str) -> None:
    header, data = _header(path)
    if how == "dtype disagrees with its span":
        header["a.weight"]["dtype"] = "F64"  # F32 bytes read as F64: half the span
    elif how == "overlapping tensors":
        header["b.bias"]["data_offsets"] = list(header["a.bias"]["data_offsets"])
        header["a.weight"]["data_offsets"][1] += 0
    elif how == "truncated":
        data = data[: len(data) // 2]
    elif how == "span outside the file":
        end = len(data) + 64
        header["b.bias"]["data_offsets"] = [end - 8, end]
    elif how == "garbage header":
        path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
        return
    elif how == "metadata not strings":
        header["__metadata__"] = {"step": 5}
    _rewrite(path, header, data)


CORRUPTIONS = [
    "dtype disagrees with its span",
    "overlapping tensors",
    "truncated",
    "span outside the file",
    "garbage header",
    "metadata not strings",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_corrupted_safetensors_file_is_refused_on_every_rank(tmp_path: Path, how: str) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors(), str(path))
    _corrupt(path, how)
    with pytest.raises(Exception):  # noqa: B017 - the library refuses it too
        safetensors.torch.load_file(str(path))
    outs = outcomes(2, _load, str(path), 3)
    raised_together(outs, ValueError, str(path))


def _load_own_copy(mesh: fzero.Mesh, directory: str) -> Any:
    return _load(mesh, os.path.join(directory, f"copy-{mesh.rank}.safetensors"), 3)


def test_ranks_reading_copies_with_other_values_raise_naming_the_file(tmp_path: Path) -> None:
    for r in range(3):
        values = tensors()
        if r == 2:
            values["b.weight"][0, 0] += 1.0  # same names, shapes and sizes; one value differs
        safetensors.torch.save_file(values, str(tmp_path / f"copy-{r}.safetensors"))
    outs = outcomes(3, _load_own_copy, str(tmp_path))
    raised_together(outs, ValueError, "rank 2 read a file with other contents")


def test_ranks_reading_identical_copies_load_the_files_values(tmp_path: Path) -> None:
    for r in range(2):
        safetensors.torch.save_file(tensors(), str(tmp_path / f"copy-{r}.safetensors"))
    outs = outcomes(2, _load_own_copy, str(tmp_path))
    for o in outs:
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, tensors(), rtol=0, atol=0)


def test_a_torch_file_holding_code_is_refused_without_running_it(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    marker = tmp_path / "ran"
    torch.save({"a.weight": _Payload(str(marker))}, path)
    outs = outcomes(2, _load, str(path), 1)
    raised_together(outs, ValueError)
    assert not marker.exists()


def test_a_torch_file_whose_tensors_are_compressed_is_refused(tmp_path: Path) -> None:
    # torch.load reads a re-zipped (deflated) file; read at torch.save's offsets, it was
    # every value wrong, without an error.
    import zipfile

    saved, packed = tmp_path / "saved.pt", tmp_path / "model.pt"
    torch.save(tensors(), saved)
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    loaded = torch.load(packed, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors().items())  # torch reads it
    outs = outcomes(2, _load, str(packed), 1)
    raised_together(outs, ValueError, "model.pt: its tensors are compressed")


def test_a_torch_file_of_the_other_byte_order_is_refused(tmp_path: Path) -> None:
    # Its bytes would be read unswapped; torch's own meta-device load of it crashed the
    # rank (signal 11), found by a second reader.
    import zipfile

    saved, marked = tmp_path / "saved.pt", tmp_path / "model.pt"
    torch.save(tensors(), saved)
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(marked, "w") as dst:
        for info in src.infolist():
            big = info.filename.endswith("/byteorder")
            dst.writestr(info, b"big" if big else src.read(info))
    outs = outcomes(2, _load, str(marked), 3)
    raised_together(outs, ValueError, "model.pt: a torch.save file written on a big-endian")


@pytest.mark.parametrize(
    ("saved", "said"),
    [
        ("legacy", "model.pt: a torch.save file in the legacy format"),
        ("training", "but its 'state_dict' is a dict (a training checkpoint?"),
    ],
)
def test_torch_files_fzero_cannot_read_say_what_they_are(
    tmp_path: Path, saved: str, said: str
) -> None:
    path = tmp_path / "model.pt"
    if saved == "legacy":
        torch.save(tensors(), path, _use_new_zipfile_serialization=False)
    else:  # Lightning's and most training loops' checkpoints
        torch.save({"state_dict": tensors(), "epoch": 1}, path)
    raised_together(outcomes(2, _load, str(path), 1), ValueError, said)


def test_float8_and_unsigned_safetensors_convert_like_torch(tmp_path: Path) -> None:
    """A file whose tensors are float8 or uint16 (F8_E4M3, F8_E5M2, U16) was refused whole;
    each converts into the float32 leaf as torch's .to() converts it."""
    stored = dict(
        zip(tensors(), (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint8))
    )
    path = tmp_path / "model.safetensors"
    values = {
        k: (v.abs() * 9 if d.is_signed is False else v).to(d)
        for (k, v), d in zip(tensors().items(), stored.values())
    }
    safetensors.torch.save_file(values, str(path))
    for o in outcomes(2, _load, str(path), 3):
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, {k: v.float() for k, v in values.items()}, rtol=0, atol=0)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


# -- writes that fail ------------------------------------------------------------------------
LIMIT = 8 << 10  # bytes a rank may write per file under RLIMIT_FSIZE in the failing rank


def _limited() -> None:
    """Writes past LIMIT bytes in any file fail with EFBIG (no signal): a disk too small."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))


def _big_state(mesh: fzero.Mesh, stage: int) -> Any:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))  # ~17 KB of float32 weights
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adam(lr=0.1)
    return fzero.shard_state(params, opt, mesh, stage=stage, units=["0", "1"]), params


def _write_twice(mesh: fzero.Mesh, kind: str, target: str, stage: int) -> Any:
    """A good write, then the same write on a full disk (rank 0's writes fail)."""
    state, _ = _big_state(mesh, stage)
    write = {
        "save": lambda: fzero.checkpoint.save(state, target, mesh),
        "export_safetensors": lambda: fzero.checkpoint.export_safetensors(state, target, mesh),
        "export_torch": lambda: fzero.checkpoint.export_torch(state, target, mesh),
    }[kind]
    write()
    if mesh.rank == 0:
        _limited()
    write()


WRITES = ["save", "export_safetensors", "export_torch"]


def _filling_up(after: int) -> None:
    """The disk fills after `after` more tensor writes of a streamed export (its file is
    sized up front, sparse, as on a filesystem with room for the skeleton only)."""
    real, calls = os.pwrite, [0]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    os.pwrite = pwrite  # this rank's process only (ranks are forked)


def _export_twice_filling_up(mesh: fzero.Mesh, kind: str, target: str) -> Any:
    state, _ = _big_state(mesh, 3)
    export = getattr(fzero.checkpoint, kind)
    export(state, target, mesh)
    if mesh.rank == 0:
        _filling_up(after=1)
    export(state, target, mesh)


@pytest.mark.parametrize("kind", ["export_safetensors", "export_torch"])
def test_a_disk_filling_up_mid_export_raises_on_every_rank_after_the_gathers(
    tmp_path: Path, kind: str
) -> None:
    target = str(tmp_path / "model.out")
    outs = outcomes(3, _export_twice_filling_up, kind, target)
    raised_together(outs, OSError, "No space left on device", target, "rank 0 of 3")
    assert [p.name for p in tmp_path.iterdir()] == ["model.out"]
    want, _ = _expected_params()
    if kind == "export_safetensors":
        fzero.assert_trees_close(safetensors.torch.load_file(target), want, rtol=0, atol=0)
    else:
        model = torch.load(target, weights_only=True)["model"]
        fzero.assert_trees_close(model, want, rtol=0, atol=0)


def _pretrained_twice_failing(mesh: fzero.Mesh, target: str) -> Any:
    """A sharded `export_pretrained`, then one of other values whose second file's fsync
    fails on rank 0 (the disk filling as the data reaches it)."""
    state, _ = _big_state(mesh, 3)
    fzero.checkpoint.export_pretrained(state, target, mesh, max_shard_size=5000)
    state, _ = fzero.sharded_step(
        lambda p, b: sum(x.sum() for x in p.values()), fzero.optim.adam(lr=0.1), mesh, stage=3
    )(state, 0)
    if mesh.rank == 0:
        real, calls = os.fsync, [0]

        def fsync(fd: int) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd)

        os.fsync = fsync  # this rank's process only (ranks are forked)
    fzero.checkpoint.export_pretrained(state, target, mesh, max_shard_size=5000)


def test_a_failed_sharded_export_leaves_every_file_of_the_previous_one(tmp_path: Path) -> None:
    # Each file was renamed into place as it was done: a failure at the second left the
    # first file new beside the old others, an export of mixed weights under the old index.
    target = str(tmp_path / "model")
    outs = outcomes(2, _pretrained_twice_failing, target)
    raised_together(outs, OSError, "No space left on device", "checkpoint.export_pretrained")
    files = sorted(p.name for p in Path(target).iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 2, files
    assert not [f for f in files if ".tmp-" in f], files
    index = json.loads((Path(target) / "model.safetensors.index.json").read_text())
    got = {
        name: safetensors.torch.load_file(str(Path(target) / f))[name]
        for name, f in index["weight_map"].items()
    }
    want, _ = _expected_params()  # the first export's: the untrained parameters
    fzero.assert_trees_close(got, want, rtol=0, atol=0)


def _pretrained_twice_killed(mesh: fzero.Mesh, target: str, at: str) -> Any:
    """A sharded `export_pretrained`, then one of trained values during which rank 0 is
    killed (the OOM killer, a preemption) just after the rename of its first `at` file."""
    state, _ = _big_state(mesh, 3)
    fzero.checkpoint.export_pretrained(state, target, mesh, max_shard_size=5000)
    state, _ = fzero.sharded_step(
        lambda p, b: sum(x.sum() for x in p.values()), fzero.optim.adam(lr=0.1), mesh, stage=3
    )(state, 0)
    trained = fzero.gather_params(state.params, mesh)
    if mesh.rank == 0:
        real = os.replace

        def replace(src: str, dst: str) -> None:
            real(src, dst)
            if os.fspath(dst).endswith(at):
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace  # this rank's process only (ranks are forked)
        torch.save(trained, f"{target}.trained.pt")
    fzero.checkpoint.export_pretrained(state, target, mesh, max_shard_size=5000)


def _read_export(target: str) -> dict[str, torch.Tensor]:
    """The tensors a loader finds, as `from_pretrained` looks: the single file first."""
    single = Path(target) / "model.safetensors"
    if single.exists():
        return safetensors.torch.load_file(str(single))
    index = json.loads((Path(target) / "model.safetensors.index.json").read_text())
    return {
        name: safetensors.torch.load_file(str(Path(target) / f))[name]
        for name, f in index["weight_map"].items()
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(("at", "which"), [(".safetensors", "first"), (".index.json", "second")])
def test_an_export_killed_midway_leaves_one_whole_export(
    tmp_path: Path, at: str, which: str
) -> None:
    # save_pretrained's way, files replaced one by one under the same names, left the old
    # index naming a new first file beside old others: a loadable mix, no error.
    target = str(tmp_path / "model")
    simulation = fzero.Simulation(2, collective_timeout=TIMEOUT, timeout=90)
    with pytest.raises(fzero.RankFailure, match="rank 0 of 2 died"):
        simulation.run(_pretrained_twice_killed, target, at)
    untrained, _ = _expected_params()
    trained = torch.load(f"{target}.trained.pt", weights_only=True)
    assert not torch.equal(trained["0.weight"], untrained["0.weight"])
    want = untrained if which == "first" else trained
    fzero.assert_trees_close(_read_export(target), want, rtol=0, atol=0)
    # The next export over it succeeds and leaves its own files only.
    simulation.run(_pretrained_again, target)
    files = sorted(p.name for p in Path(target).iterdir())
    index = json.loads((Path(target) / "model.safetensors.index.json").read_text())
    assert files == sorted({"model.safetensors.index.json", *index["weight_map"].values()})
    fzero.assert_trees_close(_read_export(target), untrained, rtol=0, atol=0)


def _pretrained_again(mesh: fzero.Mesh, target: str) -> None:
    state, _ = _big_state(mesh, 3)
    fzero.checkpoint.export_pretrained(state, target, mesh, max_shard_size=5000)


def _save_interrupted_on_rank_1(mesh: fzero.Mesh, target: str) -> bool | None:
    """A good save, then one that a Ctrl-C stops on rank 1 as it writes its file."""
    state, _ = _big_state(mesh, 1)
    fzero.checkpoint.save(state, target, mesh)
    if mesh.rank == 1:

        def interrupted(*args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt

        fzero.checkpoint._disk.write_tensors = interrupted  # this rank's process only
    try:
        fzero.checkpoint.save(state, target, mesh)
    except (KeyboardInterrupt, fzero.PeerError) as exc:  # rank 1's own, rank 0's a peer's
        return isinstance(exc, fzero.PeerError)
    return None


def test_a_save_a_peer_interrupts_leaves_no_temporary_directory(tmp_path: Path) -> None:
    # Rank 0 removed the save's temporary directory only on a CheckpointError; a peer's
    # interrupt reached it as a PeerError of KeyboardInterrupt, and the directory stayed.
    target = str(tmp_path / "ckpt")
    simulation = fzero.Simulation(2, collective_timeout=TIMEOUT, timeout=90)
    assert simulation.run(_save_interrupted_on_rank_1, target) == [True, False]
    assert [p.name for p in Path(target).iterdir() if ".tmp-" in p.name] == []
    want, _ = _expected_params()
    state = fzero.simulate(1, lambda mesh: _resume(mesh, target))[0]
    fzero.assert_trees_close(state, want, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", WRITES)
def test_a_full_disk_raises_the_os_error_on_every_rank_and_keeps_the_previous_file(
    tmp_path: Path, kind: str, stage: int
) -> None:
    target = str(tmp_path / ("ckpt" if kind == "save" else "model.out"))
    outs = outcomes(2, _write_twice, kind, target, stage)
    raised_together(outs, OSError, "File too large", target)
    assert all(o.isinstance(fzero.checkpoint.CheckpointError) for o in outs)
    # The previous file or checkpoint is as it was, and loads; nothing else is left.
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    want, _ = _expected_params()
    if kind == "save":
        state = fzero.simulate(1, lambda mesh: _resume(mesh, target))[0]
        fzero.assert_trees_close(state, want, rtol=0, atol=0)
    elif kind == "export_safetensors":
        fzero.assert_trees_close(safetensors.torch.load_file(target), want, rtol=0, atol=0)
    else:
        fzero.assert_trees_close(
            torch.load(target, weights_only=True)["model"], want, rtol=0, atol=0
        )


def _expected_params() -> tuple[dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    return {k: v.detach().clone() for k, v in net.named_parameters()}, net


def _resume(mesh: fzero.Mesh, path: str) -> dict[str, torch.Tensor]:
    _, net = _expected_params()
    like = {k: v.detach() for k, v in net.named_parameters()}
    state = fzero.checkpoint.load(path, mesh, fzero.optim.adam(lr=0.1), like, stage=1)
    return fzero.gather_params(state.params, mesh)


def _bad_metadata(mesh: fzero.Mesh, target: str) -> None:
    state, _ = _big_state(mesh, 3)
    fzero.checkpoint.export_safetensors(state, target, mesh, metadata={"step": 5})  # type: ignore[dict-item]


def test_metadata_that_is_not_strings_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    target = tmp_path / "model.safetensors"
    outs = outcomes(2, _bad_metadata, str(target))
    raised_together(outs, ValueError, "'step': 5", "strings")
    assert list(tmp_path.iterdir()) == []


# -- initializers that leave memory unwritten -------------------------------------------------
class Half(nn.Module):
    """Its reset writes only the first half of its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight[:2].normal_()


def _partial_init(mesh: fzero.Mesh) -> None:
    with torch.device("meta"):
        m = Half()
    params = {k: v.detach() for k, v in m.named_parameters()}
    fzero.shard_state(params, fzero.optim.sgd(0.1), mesh, stage=3, init=fzero.init.from_module(m))


def test_an_initializer_that_writes_part_of_a_tensor_raises_naming_the_module() -> None:
    outs = outcomes(2, _partial_init)
    raised_together(outs, ValueError, "'weight'", "Half", "8 of the 16 elements")


def _out_of_memory_in_a_gather(mesh: fzero.Mesh, target: str) -> None:
    state, _ = _big_state(mesh, 3)
    if mesh.rank == 0:
        real, calls = fzero._comm.all_gather, [0]

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError("out of memory gathering unit '1'")
            return real(*args, **kwargs)

        fzero._comm.all_gather = all_gather  # this rank's process only
    fzero.checkpoint.export_safetensors(state, target, mesh)


def test_an_error_inside_an_exports_gathers_reaches_every_rank_at_once(tmp_path: Path) -> None:
    outs = outcomes(2, _out_of_memory_in_a_gather, str(tmp_path / "model.safetensors"))
    raised_together(outs, MemoryError, "out of memory gathering")
    assert list(tmp_path.iterdir()) == []


class Masked(nn.Module):
    """An integer buffer whose init writes zeros (a causal mask): not "unwritten"."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.register_buffer("mask", torch.empty(4, 4, dtype=torch.uint8))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.normal_()
            self.mask.copy_(torch.ones(4, 4, dtype=torch.uint8).tril())


def _masked(mesh: fzero.Mesh) -> torch.Tensor:
    with torch.device("meta"):
        m = Masked()
    params = {k: v.detach() for k, v in m.named_parameters()}
    buffers = {k: v.detach() for k, v in m.named_buffers()}
    init = fzero.init.from_module(m)
    state = fzero.shard_state(
        params, fzero.optim.sgd(0.1), mesh, stage=3, init=init, buffers=buffers
    )
    return state.buffers["mask"]


def test_an_integer_buffer_an_init_fills_with_zeros_is_accepted() -> None:
    for o in outcomes(2, _masked):
        assert o.error is None, o.message
        assert torch.equal(o.value, torch.ones(4, 4, dtype=torch.uint8).tril())
