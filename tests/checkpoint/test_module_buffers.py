"""Exports given `module=` write its persistent buffers where the state holds none.

A state made without `buffers=` trains with the module's own buffers (the loss reads them
through `functional_call`; BatchNorm updates its running statistics there). What
`module.state_dict()` holds, an export named by the module must hold too: they were left
out, and `from_pretrained` made them afresh without a word.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import fzero
from fzero import checkpoint as ck
from tests.support import errors_on_every_rank, run


def pretrained() -> nn.Module:
    """A model whose BatchNorm statistics are not their initial values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3))
    return model.eval()


def export_all(mesh: fzero.Mesh, out: str) -> dict[str, Any]:
    model = pretrained()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=["0", "2"])
    exported = ck.export_torch(state, None, mesh, module=model)
    ck.export_safetensors(state, f"{out}/model.safetensors", mesh, module=model)
    ck.export_pretrained(state, f"{out}/pretrained", mesh, module=model)
    ck.export_dcp(state, f"{out}/dcp", mesh, module=model)
    return exported[0] if exported else {}


@pytest.mark.multiprocess
def test_every_export_writes_the_modules_buffers_the_state_lacks(tmp_path: Path) -> None:
    model = pretrained()
    want = model.state_dict()
    assert not torch.equal(want["1.running_mean"], torch.zeros(4))  # statistics, not zeros
    torch_dict = run(2, export_all, str(tmp_path))[0]
    from_dcp = {k: torch.empty_like(v) for k, v in want.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(from_dcp, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for got in (
        torch_dict,
        safetensors.torch.load_file(str(tmp_path / "model.safetensors")),
        safetensors.torch.load_file(str(tmp_path / "pretrained" / "model.safetensors")),
        from_dcp,
    ):
        assert set(got) == set(want)
        fzero.assert_trees_close(got, dict(want), rtol=0, atol=0)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    fresh.load_state_dict(torch_dict, strict=True)


def export_deferred(mesh: fzero.Mesh) -> None:
    model = fzero.init.deferred(nn.Sequential, nn.Linear(3, 4), nn.BatchNorm1d(4))
    state = fzero.shard_state(
        dict(model.named_parameters()),
        fzero.optim.sgd(lr=0.1),
        mesh,
        stage=1,  # whose masters an export gathers first
        init=fzero.init.from_module(model),
        precision=fzero.Precision(param_dtype=torch.bfloat16),
    )
    try:
        ck.export_torch(state, None, mesh, module=model)
    except ValueError:  # before any collective: the next call works
        ck.export_torch(state, None, mesh)
        raise


@pytest.mark.multiprocess
def test_a_module_without_buffer_values_asks_for_buffers() -> None:
    for said in errors_on_every_rank(2, export_deferred):
        assert said.startswith("ValueError: module= has persistent buffers"), said
        assert "buffers=dict(model.named_buffers())" in said and "'1.running_mean'" in said
