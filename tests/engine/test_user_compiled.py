"""A model or loss the user compiled trains in an eager step as torch trains it: `block.compile()`
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
from fzero._core import tree_flatten, tree_unflatten
from tests.support import make_params, run

F64 = torch.float64
# torch 2.13's dynamo reads `.grad` of a compiled function's non-leaf tensor inputs and
# warns, in a plain torch loop too (no fzero): its own access.
pytestmark = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")


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


def _gathered_loss(p: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    for i in range(len(p["layers"])):
        layer = fzero.gathered(p, f"layers.{i}")
        x = torch.tanh(x @ layer["w"] + layer["b"])
    return (x - y).square().mean()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_compiled_loss_asking_for_units_trains_as_torch(stage: int) -> None:
    # A pure loss compiled by the user, run by an eager step that enters its units just in
    # time: `fzero.gathered` reached the eager engine through dynamo (which traced its
    # collectives) or found the step's placeholders and handed them back, so the loss
    # failed on them. It now reaches the engine behind a graph break.
    params = make_params([3, 5, 4, 2], F64, seed=0)
    units = ["layers.0", "layers.1", "layers.2"]
    g = torch.Generator().manual_seed(1)
    xs, ys = (
        torch.randn(3, 8, 3, generator=g, dtype=F64),
        torch.randn(3, 8, 2, generator=g, dtype=F64),
    )
    loss_fn = torch.compile(_gathered_loss, backend="aot_eager")

    def go(mesh: fzero.Mesh) -> dict:
        opt = fzero.optim.adam(lr=1e-2)
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, just_in_time=True)
        half = slice(4 * mesh.rank, 4 * mesh.rank + 4)
        for t in range(3):
            state, _ = step(state, (xs[t, half], ys[t, half]))
        return fzero.gather_params(state.params, mesh) if stage == 3 else state.params

    leaves, treedef = tree_flatten(params)
    tensors = [x.clone().requires_grad_() for x in leaves]
    opt = torch.optim.Adam(tensors, lr=1e-2)
    for t in range(3):  # torch on the concatenated batch, the loss uncompiled
        opt.zero_grad()
        _gathered_loss(tree_unflatten(treedef, tensors), (xs[t], ys[t])).backward()
        opt.step()
    want = tree_unflatten(treedef, [x.detach() for x in tensors])
    for got in run(2, go):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.equal(want["layers"][0]["w"], params["layers"][0]["w"])
