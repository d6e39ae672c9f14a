"""A save refuses an optimizer state that does not line up with the layout it describes.

Checkpoints name each optimizer-state entry by the pieces the optimizer was initialised
with; a subtree shaped otherwise is taken for global state (a step count), which rank 0
alone writes. Such a state — another layout's, or one initialised over other leaves —
used to be written without a word: per-parameter moments saved as globals, every other
rank's lost, and the checkpoint unloadable. Now the save raises on every rank, names the
entry and the rank, and leaves no files behind.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
from fzero import checkpoint as ck
from tests.support import make_params, mlp_loss, run

F64 = torch.float64
PARAMS = make_params([3, 4, 2], F64, 5)
BY_LAYER = ["layers.0", "layers.1"]


def _stepped(mesh: fzero.Mesh, stage: int, **kw: Any) -> fzero.ShardedState:
    opt = fzero.optim.adam(0.01)
    state = fzero.shard_state(PARAMS, opt, mesh, stage=stage, **kw)
    x = torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(mesh.rank))
    batch = (x, torch.zeros(4, 2, dtype=F64))
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage, units=kw.get("units"))
    return step(state, batch)[0]


def _save_error(mesh: fzero.Mesh, state: fzero.ShardedState, path: str) -> str:
    try:
        ck.save(state, path, mesh)
    except ck.CheckpointError as exc:
        return str(exc)
    return "no error"


def _export_error(mesh: fzero.Mesh, state: fzero.ShardedState) -> str:
    try:
        ck.export_torch(state, None, mesh)
    except ck.CheckpointError as exc:
        return str(exc)
    return "no error"


def another_layouts_state(mesh: fzero.Mesh, stage: int, path: str) -> tuple[str, str, list[str]]:
    """A state whose optimizer state was made for units the layout does not have."""
    state = _stepped(mesh, stage)
    other = _stepped(mesh, stage, units=BY_LAYER)
    wrong = dataclasses.replace(state, opt_state=other.opt_state)
    said = _save_error(mesh, wrong, path), _export_error(mesh, wrong)
    ck.save(state, path, mesh)  # the state as made saves, and loads
    ck.load(path, mesh, fzero.optim.adam(0.01), PARAMS, stage=stage)
    return *said, sorted(os.listdir(path))


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_another_layouts_optimizer_state_is_refused_on_every_rank(
    stage: int, tmp_path: Path
) -> None:
    out = run(2, another_layouts_state, stage, str(tmp_path))
    for rank, (save, export, _) in enumerate(out):
        for said in (save, export):
            assert "does not line up" in said, (rank, said)
            assert "'mu." in said and "rank 1" in said, said
    # The refused save left nothing; the good one is the only checkpoint.
    assert len([n for n in out[0][2] if not n.startswith("LATEST")]) == 1, out[0][2]


def frozen_leaf_state(mesh: fzero.Mesh, path: str) -> str:
    """Stage 0: moments kept for a leaf the state holds frozen."""
    state = _stepped(mesh, 0, frozen=["scale"])
    other = _stepped(mesh, 0)
    return _save_error(mesh, dataclasses.replace(state, opt_state=other.opt_state), path)


@pytest.mark.multiprocess
def test_moments_of_leaves_outside_the_layout_are_refused(tmp_path: Path) -> None:
    said = run(2, frozen_leaf_state, str(tmp_path))
    assert said[0] == said[1], said
    assert "does not line up" in said[0] and "'mu.layers.0.w'" in said[0], said[0]
    assert not [n for n in os.listdir(tmp_path) if not n.startswith(".")], os.listdir(tmp_path)
