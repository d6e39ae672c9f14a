"""A hooked unit whose output is a view of its own parameters, used after its forward.

A learned positional table returned as `self.pe[:n]`, a class token expanded: at stage 3
with resharding the unit's gathered buffers are freed as its forward ends. Off the CPU
(where gathered buffers are not pooled) freeing is `resize_(0)`, and the parent read
freed memory: a rank died with signal 11. Forced here by taking the device's path on the
CPU: `Pool.pools` says False, as it does for every non-CPU buffer.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from transformers.modeling_outputs import BaseModelOutput

import fzero
import fzero._engine._pool as pool
from tests.support import run

pytestmark = pytest.mark.multiprocess


class PosEmb(nn.Module):
    def __init__(self, wrapped: bool) -> None:
        super().__init__()
        self.pe = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
        self.wrapped = wrapped

    def forward(self, i: int) -> Any:
        out = self.pe[i : i + 1]  # a view of the gathered parameter
        return BaseModelOutput(last_hidden_state=out) if self.wrapped else out


class Net(nn.Module):
    def __init__(self, wrapped: bool = False) -> None:
        super().__init__()
        self.pos = PosEmb(wrapped)
        self.head = nn.Linear(4, 4, dtype=torch.float64)
        self.layers = nn.ModuleList(nn.Linear(4, 4, dtype=torch.float64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pos(2)  # used after other units' forwards
        p = p.last_hidden_state if isinstance(p, BaseModelOutput) else p
        x = self.head(x)  # the second member of a unit ("pos", "head"): after pos's end
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + p


LAYERS = [f"layers.{i}" for i in range(4)]
SHAPES = {
    "a unit of its own": ["pos", "head", *LAYERS],
    "a unit's first member": [("pos", "head"), *LAYERS],
    "a ModelOutput": ["pos", "head", *LAYERS],
}


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3)]


def reference(net: Net) -> dict[str, torch.Tensor]:
    net = copy.deepcopy(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    for x in batches():
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    return {k: v.detach() for k, v in net.named_parameters()}


def train(mesh: fzero.Mesh, net: Net, units: list[Any]) -> dict[str, Any]:
    pool.Pool.pools = lambda self, buf: False  # the device's path: buffers freed, not pooled
    opt = fzero.optim.adamw(lr=0.05)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    state = fzero.shard_state(params, opt, mesh, stage=3, units=units)

    def loss_fn(p: Any, x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (x,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, units=units, module=net)
    for x in batches():
        state, _ = step(state, x[3 * mesh.rank : 3 * mesh.rank + 3])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_units_output_aliasing_its_freed_parameters_trains_like_torch(shape: str) -> None:
    # A unit's first member's output, and one inside a ModelOutput (a leaf of fzero's
    # trees), were missed by the first fix.
    torch.manual_seed(0)
    net = Net(wrapped=shape == "a ModelOutput")
    want = reference(net)
    for got in run(2, train, net, SHAPES[shape]):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert not torch.equal(got["pos.pe"], net.pos.pe.detach())
