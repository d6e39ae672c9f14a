"""Compiled steps of models of other widths sharing one loss function that breaks the graph.

In pieces, the loss's frames after a break are dynamo's to share between the step
functions: seeing shards of a new size there, it traces them with symbolic sizes, which
the traced reduction's choice of collective (by the bytes it moves) read as `nbytes`,
and the second model's step failed inside dynamo.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch

import fzero
from tests.support import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
WIDTHS = (4, 6)


def params_of(width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(width)
    dims = [3, width, width, 2]
    return {
        f"layers.{i}.{k}": torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5
        for i, (a, b) in enumerate(itertools.pairwise(dims))
        for k, shape in (("w", (a, b)), ("b", (b,)))
    }


def forward(p: dict[str, torch.Tensor], x: torch.Tensor, jit: bool) -> torch.Tensor:
    for i in range(3):
        layer = fzero.gathered(p, f"layers.{i}") if jit else p
        w, b = (layer["w"], layer["b"]) if jit else (p[f"layers.{i}.w"], p[f"layers.{i}.b"])
        x = torch.tanh(x @ w + b)
        if jit:
            torch._dynamo.graph_break()  # a log line, say
    return x


def loss_fn(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    x, y = batch
    return (forward(p, x, True) - y).square().mean()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g))
        for _ in range(2)
    ]


def reference(width: int) -> dict[str, torch.Tensor]:
    p = {k: v.clone().requires_grad_() for k, v in params_of(width).items()}
    opt = torch.optim.AdamW(p.values(), lr=1e-2)
    for x, y in batches():
        opt.zero_grad()
        (forward(p, x, False) - y.double()).square().mean().backward()
        opt.step()
    return {k: v.detach() for k, v in p.items()}


def train_both(mesh: fzero.Mesh) -> list[dict[str, torch.Tensor]]:
    out = []
    for width in WIDTHS:
        opt = fzero.optim.adamw(lr=1e-2)
        units = [f"layers.{i}" for i in range(3)]
        state = fzero.shard_state(params_of(width), opt, mesh, stage=3, units=units)
        step = fzero.sharded_step(
            loss_fn, opt, mesh, stage=3, units=units, just_in_time=True, compile="aot_eager"
        )
        with warnings.catch_warnings():  # "compiled in pieces"
            warnings.simplefilter("ignore", RuntimeWarning)
            for x, y in batches():
                rows = slice(2 * mesh.rank, 2 * mesh.rank + 2)
                state, _ = step(state, (x[rows], y[rows].double()))
        out.append(fzero.gather_params(state.params, mesh))
    return out


def test_two_widths_train_through_one_loss_in_pieces_like_torch_optim() -> None:
    for per_rank in run(2, train_both):
        for width, got in zip(WIDTHS, per_rank):
            fzero.assert_trees_close(got, reference(width), rtol=1e-10, atol=1e-12)
            assert not torch.equal(got["layers.0.w"], params_of(width)["layers.0.w"])
