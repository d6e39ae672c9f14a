"""A meta-device model's construction replayed around a file's tensors (`from_file`'s
`missing=from_module(...)`): the missing leaves must be the eager model's, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import fzero
from tests.support import run

pytestmark = pytest.mark.multiprocess


class AttentionThenHead(nn.Module):
    """MultiheadAttention draws xavier in `_reset_parameters` (no `reset_parameters`),
    before the head's construction draws: a replay that passes over it shifts the head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2)
        self.head = nn.Linear(4, 3)


def _head_from_file(mesh: fzero.Mesh, file: str) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = AttentionThenHead()
    missing = fzero.init.from_module(model, seed=0)
    state = fzero.shard_state(
        dict(model.named_parameters()),
        fzero.optim.sgd(lr=0.1),
        mesh,
        stage=3,
        init=fzero.init.from_file(file, missing=missing),
    )
    return {k: v.clone() for k, v in fzero.gather_params(state.params, mesh).items()}


def test_a_module_passed_over_draws_what_its_private_reset_drew(tmp_path: Path) -> None:
    """The attention is in the file; its `_reset_parameters` runs on scratch tensors all
    the same, so the head after it draws what it drew eagerly (it was 0.9 off: the
    attention was passed over without a draw; found by a second reader)."""
    torch.manual_seed(0)
    eager = AttentionThenHead()
    want = {k: v.detach() for k, v in eager.named_parameters()}
    file = str(tmp_path / "attn.safetensors")
    save_file({k: v for k, v in want.items() if k.startswith("attn.")}, file)
    for got in run(2, _head_from_file, file):
        for k, v in want.items():
            assert torch.equal(got[k], v), k
