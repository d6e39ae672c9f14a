"""A model whose parameters have several dtypes, trained in mixed precision: checkpoints,
and its state made in place (`init=`).

A bf16 model keeping some modules in fp32 (Hugging Face's `_keep_in_fp32_modules`, MoE
routers) has masters in two dtypes under `Precision(param_dtype=bf16)`: each leaf is
saved in its own master's dtype, and comes back bitwise at another world size and stage.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
from fzero import checkpoint as ck
from tests.support import differences, run

PREC = fzero.Precision(param_dtype=torch.bfloat16)
UNITS = ["a", "b"]
FROZEN = ["c"]


def original() -> dict[str, torch.Tensor]:
    """bf16 block "a", fp32 block "b" (the kept-in-fp32 module), a frozen fp32 leaf "c"."""
    g = torch.Generator().manual_seed(3)
    return {
        "a.w": torch.randn(4, 3, generator=g).bfloat16(),
        "a.b": torch.randn(3, generator=g).bfloat16(),
        "b.w": torch.randn(3, 2, generator=g),
        "c.w": torch.randn(2, generator=g),
    }


def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x.to(p["a.w"].dtype) @ p["a.w"] + p["a.b"])
    return ((h.float() @ p["b.w"].float()) * p["c.w"].float()).pow(2).mean()


def train_and_save(mesh: fzero.Mesh, path: str, stage: int) -> Any:
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(
        original(), opt, mesh, stage=stage, units=UNITS, frozen=FROZEN, precision=PREC
    )
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(8, 4, generator=g)
        state, _ = step(state, x[mesh.rank * 4 // mesh.size : (mesh.rank + 1) * 4 // mesh.size])
    ck.save(state, path, mesh)
    exported = ck.export_torch(state, None, mesh)  # rank 0's, None elsewhere
    return fzero.master_params(state, mesh), exported and exported[0]


def load(mesh: fzero.Mesh, path: str, stage: int) -> Any:
    opt = fzero.optim.adamw(lr=0.05)
    state = ck.load(path, mesh, opt, original(), stage=stage, precision=PREC)
    return fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("saved_at", "loaded_at"), [(0, 3), (1, 2), (2, 0), (3, 1)])
def test_each_leaf_is_saved_in_its_masters_dtype_and_loads_bitwise(
    tmp_path: Path, saved_at: int, loaded_at: int
) -> None:
    path = str(tmp_path / "ckpt")
    masters, model = run(2, train_and_save, path, saved_at)[0]
    start = original()
    assert not torch.equal(masters["a.w"], start["a.w"])  # training moved them
    assert not torch.equal(masters["b.w"], start["b.w"])
    want = {"a.w": torch.bfloat16, "a.b": torch.bfloat16, "b.w": torch.float32}
    want["c.w"] = torch.bfloat16  # frozen: held in the compute dtype, no master
    assert {k: v.dtype for k, v in masters.items()} == want
    assert torch.equal(masters["c.w"], start["c.w"].bfloat16())
    saved = {**want, "c.w": torch.float32}  # a frozen leaf cast up to the widest: exact
    for k, v in model.items():  # the export: the masters, each in its own dtype
        assert v.dtype == saved[k] and torch.equal(v, masters[k].to(v.dtype)), k
    for loaded in run(3, load, path, loaded_at):
        for k, v in loaded.items():
            assert v.dtype == want[k] and torch.equal(v, masters[k]), (k, loaded_at)


TRAVEL = fzero.Precision(master_dtype=torch.float32, gather_dtype=torch.float16)


def wider() -> dict[str, torch.Tensor]:
    """`original`'s leaves and dtypes, with enough elements that rounding float32 to bf16
    straight and through float16 differ somewhere (in about 6 % of values)."""
    g = torch.Generator().manual_seed(5)
    return {
        "a.w": torch.randn(16, 32, generator=g).bfloat16(),
        "a.b": torch.randn(32, generator=g).bfloat16(),
        "b.w": torch.randn(32, 2, generator=g),
        "c.w": torch.randn(2, generator=g),
    }


def _seen_after_a_resume(mesh: fzero.Mesh, path: str, stage: int) -> list[str]:
    """The model's own dtypes (no `param_dtype`), float32 masters travelling in float16:
    the leaves the first loss after a load saw other than the loaded masters rounded as a
    gather rounds them (to float16, then to the leaf's dtype)."""
    opt = fzero.optim.adamw(lr=0.05)
    kw: dict[str, Any] = {"stage": stage, "units": UNITS, "frozen": FROZEN}
    state = fzero.shard_state(wider(), opt, mesh, precision=TRAVEL, **kw)
    seen: list[dict[str, torch.Tensor]] = []

    def watched(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        seen.append({k: v.detach().clone() for k, v in p.items()})
        return loss_fn(p, x)

    step = fzero.sharded_step(watched, opt, mesh, stage=stage)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(mesh.rank))
    for _ in range(2):
        state, _ = step(state, x)
    ck.save(state, path, mesh)
    state = ck.load(path, mesh, opt, wider(), precision=TRAVEL, stage=stage)
    masters = fzero.master_params(state, mesh)
    assert not torch.equal(masters["b.w"], wider()["b.w"])  # training moved them
    a = masters["a.w"]
    assert not torch.equal(a.to(torch.float16).bfloat16(), a.bfloat16())  # the test can fail
    seen.clear()
    step(state, x)
    return [
        k
        for k in ("a.w", "a.b", "b.w")
        if not torch.equal(seen[0][k], masters[k].to(torch.float16).to(seen[0][k].dtype))
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_a_resumed_gather_dtype_rounds_the_loaded_masters_once(tmp_path: Path, stage: int) -> None:
    """A load of a model whose leaves have two dtypes under `master_dtype` failed (the
    leaves to check lay on two devices), and then rounded a bf16 leaf's float32 master to
    bf16 and through float16, where every gather after an update rounds it once."""
    for off in run(2, _seen_after_a_resume, str(tmp_path / "ckpt"), stage):
        assert off == []


MASTERS32 = fzero.Precision(master_dtype=torch.float32)
TRAINED = ("a.w", "a.b", "b.w")


def _batches(sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Per step, the ranks' micro-batches (2 rows each), `sizes[t]` ranks at step t."""
    g = torch.Generator().manual_seed(11)
    return [torch.randn(n, 2, 16, generator=g) for n in sizes]


def _one_unit_saved(mesh: fzero.Mesh, path: str, stage: int, xs: list[torch.Tensor]) -> None:
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(
        wider(), opt, mesh, stage=stage, frozen=FROZEN, precision=MASTERS32
    )  # one unit holds the bf16 and the fp32 leaves
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    for x in xs:
        state, _ = step(state, x[mesh.rank])
    ck.save(state, path, mesh)


def _one_unit_moved(mesh: fzero.Mesh, path: str, stage: int, to: str) -> Any:
    """Loaded at `stage` on this mesh, and saved again to `to`: the masters loaded."""
    opt = fzero.optim.adamw(lr=0.05)
    state = ck.load(path, mesh, opt, wider(), stage=stage, precision=MASTERS32)
    ck.save(state, to, mesh)
    return fzero.master_params(state, mesh)


def _one_unit_resumed(mesh: fzero.Mesh, path: str, stage: int, x: torch.Tensor) -> Any:
    opt = fzero.optim.adamw(lr=0.05)
    state = ck.load(path, mesh, opt, wider(), stage=stage, precision=MASTERS32)
    state, _ = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)(state, x[mesh.rank])
    return fzero.master_params(state, mesh), ck.export_torch(state, None, mesh)


def _one_unit_reference(
    xs: list[torch.Tensor], computed: dict[str, torch.dtype] | None = None
) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW on float32 copies of the trained leaves, the loss on each leaf in
    `computed`'s dtype (None: its own), a step's gradient the mean of its micro-batches'."""
    return _torch_run(xs, computed)[0]


def _torch_run(
    xs: list[torch.Tensor], computed: dict[str, torch.dtype] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`_one_unit_reference`'s values, and its optimizer's `state_dict()`."""
    start = wider()
    dtypes = computed or {k: v.dtype for k, v in start.items()}
    masters = {k: start[k].float().requires_grad_() for k in TRAINED}
    opt = torch.optim.AdamW(list(masters.values()), lr=0.05, foreach=False)
    frozen = start["c.w"].to(dtypes["c.w"])
    for x in xs:
        opt.zero_grad()
        p = {**{k: m.to(dtypes[k]) for k, m in masters.items()}, "c.w": frozen}
        sum(loss_fn(p, micro) for micro in x).backward()
        for m in masters.values():
            m.grad /= len(x)
        opt.step()
    return {**{k: m.detach() for k, m in masters.items()}, "c.w": frozen}, opt.state_dict()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("saved_at", "moved_at"), [(0, 3), (1, 2), (2, 1), (3, 3)])
def test_a_unit_of_bf16_and_fp32_leaves_with_fp32_masters_resumes_at_another_world_size(
    tmp_path: Path, saved_at: int, moved_at: int
) -> None:
    """`Precision(master_dtype=fp32)` over a unit holding bf16 and fp32 leaves (a Hugging
    Face block keeping a module in fp32): a save at stages 1-3 dropped masters or wrote
    rank 0's optimizer shards as another's (the saved layout merged the unit's two
    buckets), and every load failed or made a state that could not be read. Two steps on
    two ranks, moved through three ranks at another stage (loaded and saved there), a
    third step on two: bitwise torch.optim's (a mean over three ranks' bf16 gradients
    would round apart from one process's)."""
    first, moved = str(tmp_path / "first"), str(tmp_path / "moved")
    xs = _batches((2, 2, 2))
    run(2, _one_unit_saved, first, saved_at, xs[:2])
    for masters in run(3, _one_unit_moved, first, moved_at, moved):
        assert differences(masters, _one_unit_reference(xs[:2])) == []
    want, start = _one_unit_reference(xs), wider()
    for masters, exported in run(2, _one_unit_resumed, moved, saved_at, xs[2]):
        for k in TRAINED:
            assert masters[k].dtype == torch.float32
            assert (masters[k] - start[k].float()).abs().max() > 0.05  # three steps moved it
        assert differences(masters, want) == []
        if exported is not None:  # rank 0's: the masters, each in its own dtype
            assert all(torch.equal(exported[0][k], masters[k]) for k in TRAINED)


def _made_in_place(mesh: fzero.Mesh, stage: int, precision: fzero.Precision, xs: Any) -> Any:
    values = wider()
    init = fzero.init.by_leaf(lambda path, like: values[path].clone(), seed=0)
    meta = {k: v.to("meta") for k, v in values.items()}
    opt = fzero.optim.adamw(lr=0.05)
    kw: dict[str, Any] = {"stage": stage, "frozen": FROZEN, "precision": precision}
    state = fzero.shard_state(meta, opt, mesh, init=init, **kw)  # one unit, both dtypes
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    for x in xs:
        state, _ = step(state, x[mesh.rank])
    return fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["master_dtype", "param_dtype"])
def test_a_unit_of_bf16_and_fp32_leaves_made_in_place_trains_as_torch_optim(
    stage: int, precision: str
) -> None:
    """`shard_state(init=)` under a precision keeping float32 masters of a bf16 leaf: the
    optimizer state was made in the leaf's bf16 (the step failed at the first update) and,
    at stages 1-3 with `param_dtype`, for buckets the masters did not have."""
    xs = _batches((2, 2))
    if precision == "master_dtype":  # each leaf computes in its own dtype
        prec, computed = MASTERS32, None
    else:  # every leaf in bf16
        prec = fzero.Precision(param_dtype=torch.bfloat16)
        computed = dict.fromkeys(wider(), torch.bfloat16)
    want = _one_unit_reference(xs, computed)
    start = wider()
    for masters in run(2, _made_in_place, stage, prec, xs):
        for k in TRAINED:
            assert (masters[k] - start[k].float()).abs().max() > 0.05  # two steps moved it
        assert differences(masters, want) == [], stage


def _imported(mesh: fzero.Mesh, model: dict, optim: dict, stage: int, x: torch.Tensor) -> Any:
    opt = fzero.optim.adamw(lr=0.05)
    state = ck.import_torch(
        model, optim, opt, mesh, stage=stage, params_like=wider(), frozen=FROZEN,
        precision=MASTERS32, param_names=[list(TRAINED)],
    )  # fmt: skip
    state, _ = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)(state, x[mesh.rank])
    return fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_torch_run_of_fp32_masters_of_bf16_leaves_goes_on_as_fzero(stage: int) -> None:
    """Two steps of torch.optim on fp32 masters of a model with bf16 leaves, imported by
    `import_torch(precision=Precision(master_dtype=fp32))`, a third step by fzero: torch's
    third, bitwise. The import rounded the fp32 values to the model's bf16 first."""
    xs = _batches((2, 2, 2))
    masters, optim = _torch_run(xs[:2])
    model = {k: v.clone() for k, v in masters.items()}
    assert model["a.w"].dtype == torch.float32 and wider()["a.w"].dtype == torch.bfloat16
    want = _one_unit_reference(xs)
    for got in run(2, _imported, model, optim, stage, xs[2]):
        assert (got["a.w"] - wider()["a.w"].float()).abs().max() > 0.05  # three steps moved it
        assert differences(got, want) == [], stage


def _dcp_imported(mesh: fzero.Mesh, directory: str, stage: int, x: torch.Tensor) -> Any:
    opt = fzero.optim.adamw(lr=0.05)
    state = ck.import_dcp(
        directory, opt, mesh, wider(), stage=stage, frozen=FROZEN, precision=MASTERS32
    )
    seen: list[dict[str, torch.dtype]] = []

    def watched(p: dict[str, torch.Tensor], micro: torch.Tensor) -> torch.Tensor:
        seen.append({k: v.dtype for k, v in p.items()})
        return loss_fn(p, micro)

    state, _ = fzero.sharded_step(watched, opt, mesh, stage=stage)(state, x[mesh.rank])
    return fzero.master_params(state, mesh), seen[0]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_dcp_checkpoint_of_fp32_masters_of_bf16_leaves_goes_on_as_fzero(
    tmp_path: Path, stage: int
) -> None:
    """FSDP2's layout of a mixed run: fp32 weights (its masters) and AdamW's state in a
    DCP checkpoint, imported under `Precision(master_dtype=fp32)` for a model
    with bf16 leaves: the loss sees the model's dtypes and the third step is torch's,
    bitwise. The import computed every leaf in the checkpoint's fp32."""
    import torch.distributed.checkpoint as dcp

    xs = _batches((2, 2, 2))
    masters, optim = _torch_run(xs[:2])
    moments = {k: optim["state"][i] for i, k in enumerate(TRAINED)}
    weights = {k: v.float() for k, v in masters.items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {**weights, "optim": {"state": moments}}, checkpoint_id=str(tmp_path), no_dist=True
        )
    want = _one_unit_reference(xs)
    for got, seen in run(2, _dcp_imported, str(tmp_path), stage, xs[2]):
        assert seen == {k: v.dtype for k, v in wider().items()}
        assert differences(got, want) == [], stage


def _no_masters(mesh: fzero.Mesh, path: str, stage: int) -> Any:
    full = {k: v.float() for k, v in wider().items()}
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(full, opt, mesh, stage=stage, frozen=FROZEN)
    ck.save(state, path, mesh)
    keep_none = fzero.Precision(reduce_dtype=torch.float32)  # no masters kept
    state = ck.load(path, mesh, opt, wider(), stage=stage, precision=keep_none)
    assert state.master is None
    return fzero.gather_params(state.params, mesh), full


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_precision_keeping_no_masters_loads_in_the_models_dtypes(
    tmp_path: Path, stage: int
) -> None:
    """An fp32 checkpoint loaded for a model with bf16 leaves under a precision that keeps
    no masters: the parameters in the model's dtypes, as torch's `load_state_dict` casts
    them (they stayed fp32: the model then computed in fp32)."""
    for params, full in run(2, _no_masters, str(tmp_path / "ckpt"), stage):
        for k, v in wider().items():
            assert params[k].dtype == v.dtype and torch.equal(params[k], full[k].to(v.dtype)), k


def _bf16_values_imported(mesh: fzero.Mesh, directory: str, stage: int) -> Any:
    """A bf16 state dict imported without `params_like`, and a bf16 DCP checkpoint for
    a model built on meta in fp32, both under `master_dtype=fp32`: what the loss sees."""
    values = {k: v.bfloat16() for k, v in wider().items() if k != "c.w"}
    opt = fzero.optim.adamw(lr=0.05)
    kw: dict[str, Any] = {"stage": stage, "precision": MASTERS32}
    fresh = {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}  # a torch optimizer's
    from_torch = ck.import_torch(values, fresh, opt, mesh, param_names=[list(values)], **kw)
    meta = {k: torch.empty(v.shape, device="meta") for k, v in values.items()}
    from_dcp = ck.import_dcp(directory, opt, mesh, meta, optimizer_key=None, **kw)
    return [
        (fzero.gather_params(s.params, mesh), fzero.master_params(s, mesh))
        for s in (from_torch, from_dcp)
    ]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_values_imported_under_fp32_masters_compute_in_bf16(
    tmp_path: Path, stage: int
) -> None:
    """Without a narrower `params_like`, the imports compute in the values' bf16 over
    fp32 masters, as before they learnt to keep a wider value as the master (a reader
    found import_torch then computing in fp32 with no masters)."""
    import torch.distributed.checkpoint as dcp

    values = {k: v.bfloat16() for k, v in wider().items() if k != "c.w"}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(values), checkpoint_id=str(tmp_path), no_dist=True)
    for imported in run(2, _bf16_values_imported, str(tmp_path), stage):
        for params, masters in imported:
            for k, v in values.items():
                assert params[k].dtype == torch.bfloat16 and torch.equal(params[k], v), k
                assert masters[k].dtype == torch.float32 and torch.equal(masters[k], v.float())
