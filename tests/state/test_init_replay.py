"""A meta-device model's construction replayed around a file's tensors (`from_file`'s
`missing=from_module(...)`): the missing leaves must be the eager model's, bitwise, or
the init is refused, never silently other values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _head_from_file(mesh: fzero.Mesh, file: str, init: dict | None) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = AttentionThenHead()
    missing = fzero.init.from_module(model, seed=0, init=init)
    state = fzero.shard_state(
        dict(model.named_parameters()),
        fzero.optim.sgd(lr=0.1),
        mesh,
        stage=3,
        init=fzero.init.from_file(file, missing=missing),
    )
    return {k: v.clone() for k, v in fzero.gather_params(state.params, mesh).items()}


def test_a_module_passed_over_without_reset_parameters_is_refused_or_replayed(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    eager = AttentionThenHead()
    want = {k: v.detach() for k, v in eager.named_parameters()}
    file = str(tmp_path / "attn.safetensors")
    save_file({k: v for k, v in want.items() if k.startswith("attn.")}, file)

    with pytest.raises(ValueError, match=r"'attn' \(MultiheadAttention\).*'head'.*init=\{'attn'"):
        run(2, _head_from_file, file, None)

    replay: dict[Any, Any] = {"attn": lambda m: m._reset_parameters()}
    for got in run(2, _head_from_file, file, replay):
        for k, v in want.items():
            assert torch.equal(got[k], v), k
