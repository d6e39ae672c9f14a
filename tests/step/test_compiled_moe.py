"""A compiled step over a mixture of experts that loops over the experts its tokens hit,
as Hugging Face's Mixtral does eagerly: a loop over a data-dependent `nonzero`, which
dynamo refuses to trace whole (`UserError`) and breaks the graph at without `fullgraph`.

Before, that error ended the step; it now compiles in pieces, as any graph break does,
said once (found by a random run over Hugging Face architectures)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import errors_on_every_rank, run

F64 = torch.float64
D, E, STEPS, WORLD = 6, 4, 3, 2
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


class Experts(nn.Module):
    """Top-1 routing over stacked expert weights, computed for the experts hit only."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, dtype=F64)
        self.w = nn.Parameter(torch.randn(E, D, D, dtype=F64) / D**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.gate(h)
        route = logits.argmax(-1)
        weight = logits.softmax(-1).gather(-1, route[:, None])
        mask = nn.functional.one_hot(route, E)
        out = torch.zeros_like(h)
        for e in (mask.sum(0) > 0).nonzero():  # a data-dependent number of experts
            tokens = torch.where(mask[:, e[0]])[0]
            out = out.index_add(0, tokens, (h[tokens] @ self.w[e[0]]) * weight[tokens])
        return out


def squash(t: torch.Tensor) -> torch.Tensor:
    """Checkpointed below: a function of no module, breaking the graph (left eager)."""
    torch._dynamo.graph_break()
    return torch.tanh(t)


class Net(nn.Module):
    def __init__(self, remat: bool | str) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D, dtype=F64)
        self.moe = Experts()
        self.out = nn.Linear(D, 2, dtype=F64)
        self.remat = remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if self.remat == "plain":  # a checkpoint that reads no parameter
            h = torch.utils.checkpoint.checkpoint(squash, h, use_reentrant=False)
        if self.remat is True:  # as Hugging Face's gradient checkpointing wraps a layer
            moe = torch.utils.checkpoint.checkpoint(self.moe, h, use_reentrant=False)
        else:
            moe = self.moe(h)
        return self.out(h + moe)


def model(remat: bool | str = False) -> Net:
    torch.manual_seed(2)
    return Net(remat)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, 4 * WORLD, 3, generator=gen, dtype=F64)
    return x, torch.randn(STEPS, 4 * WORLD, 2, generator=gen, dtype=F64)


def reference(remat: bool | str = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    net, (x, y) = model(remat), data()
    start = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, foreach=False)
    for k in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k]), y[k]).backward()
        opt.step()
    return start, {k: v.detach() for k, v in net.named_parameters()}


def compiled(
    mesh: fzero.Mesh, stage: int, hooks: bool, remat: bool | str
) -> tuple[dict[str, Any], list[str]]:
    net, (x, y) = model(remat), data()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["moe"])
    step = fzero.sharded_step(
        lambda p, b: torch.nn.functional.mse_loss(functional_call(net, p, (b[0],)), b[1]),
        opt, mesh, stage=stage, module=net if hooks else None, compile="aot_eager",
    )  # fmt: skip
    per = x.shape[1] // mesh.size
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k in range(STEPS):
            lo, hi = mesh.rank * per, (mesh.rank + 1) * per
            state, _ = step(state, (x[k, lo:hi], y[k, lo:hi]))
    said = [str(w.message) for w in seen if "breaks torch.compile's graph" in str(w.message)]
    return dict(fzero.gather_params(state.params, mesh)), said


@pytest.mark.parametrize(
    ("stage", "hooks", "remat"),
    [(0, False, False), (3, True, False), (0, False, True), (3, True, "plain")],
)
def test_a_loop_over_the_experts_hit_compiles_in_pieces_as_one_process(
    stage: int, hooks: bool, remat: bool | str
) -> None:
    """Checkpointed, the checkpoint runs in the Python between the pieces: its recompute
    read the module's own parameters (routing other tokens: torch's "Recomputed values
    ... have different metadata") until a compiled step rebound them as an eager one. A
    checkpoint that reads no parameter recomputes beside hooked units."""
    start, want = reference(remat)
    for got, said in run(WORLD, compiled, stage, hooks, remat):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)
        assert len(said) == 1, said


def test_a_checkpoint_between_pieces_over_a_hooked_unit_is_refused_naming_the_remedy() -> None:
    """module='s hooks enter a unit inside the graph; a checkpoint run between the pieces
    recomputes in the backward, outside any graph, where the unit cannot enter again.
    Before, torch's "Tensor on device meta is not on the expected device" from inside the
    model."""

    def fn(mesh: fzero.Mesh) -> Any:
        return compiled(mesh, 3, True, True)

    for message in errors_on_every_rank(WORLD, fn):
        assert "torch.utils.checkpoint of Experts" in message, message
        assert "fzero.remat" in message
