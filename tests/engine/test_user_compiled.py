"""A model the user compiled trains in an eager step as torch trains it: `block.compile()`
compiles the block's hooks with its forward, so dynamo met the step's unit hooks (which
issue collectives) and failed inside fzero's process-group code; they are opaque to it
now, and it breaks its graph around them. `torch.compile(block)` in a `ModuleList`
already worked: its hooks run outside the compiled call."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero.testing

F64 = torch.float64


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l(x)) + x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _in_place(model: _Net) -> tuple[nn.Module, list[str]]:
    for b in model.blocks:
        b.compile(backend="aot_eager")
    return model, [f"blocks.{i}" for i in range(3)]


def _wrapped(model: _Net) -> tuple[nn.Module, list[str]]:
    for i, b in enumerate(model.blocks):
        model.blocks[i] = torch.compile(b, backend="aot_eager")
    return model, [f"blocks.{i}" for i in range(3)]


def _whole(model: _Net) -> tuple[nn.Module, list[str]]:
    return torch.compile(model, backend="aot_eager"), ["_orig_mod.blocks.0", "_orig_mod.out"]


# torch 2.13's dynamo reads `.grad` of a compiled block's non-leaf input and warns, in a
# plain torch loop too (no fzero): its own access.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", [_in_place, _wrapped, _whole], ids=["in_place", "wrapped", "whole"])
def test_a_compiled_model_trains_as_torch_trains_it(
    how: Callable[[_Net], tuple[nn.Module, list[str]]],
) -> None:
    torch.manual_seed(0)
    model, units = how(_Net().double())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randn(4, 3, generator=g, dtype=F64) for _ in range(2)] for _ in range(2)]

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    fzero.testing.assert_stages_equivalent(
        loss_fn, params, batches, (torch.optim.AdamW, {"lr": 1e-2}), module=model, units=units,
        stages=(0, 3),
    )  # fmt: skip
