"""Checkpoints of a model whose parameters have several dtypes, trained in mixed precision.

A bf16 model keeping some modules in fp32 (Hugging Face's `_keep_in_fp32_modules`, MoE
routers) has masters in two dtypes under `Precision(param_dtype=bf16)`: each leaf is
saved in its own master's dtype, and comes back bitwise at another world size and stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
from fzero import checkpoint as ck
from tests.support import run

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
@pytest.mark.parametrize("stage", [1, 2])
def test_a_resumed_gather_dtype_rounds_the_loaded_masters_once(tmp_path: Path, stage: int) -> None:
    """A load of a model whose leaves have two dtypes under `master_dtype` failed (the
    leaves to check lay on two devices), and then rounded a bf16 leaf's float32 master to
    bf16 and through float16, where every gather after an update rounds it once."""
    for off in run(2, _seen_after_a_resume, str(tmp_path / "ckpt"), stage):
        assert off == []
