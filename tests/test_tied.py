"""Tied weights (a GPT's embedding and output projection) at every stage, uneven shards."""

import copy
from typing import Any

import pytest
import torch
from support import run
from torch import nn
from torch.func import functional_call

import fzero


class TiedLM(nn.Module):
    """Embedding, two blocks, and an output projection that shares the embedding's weight."""

    def __init__(self, vocab: int = 7, d: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter, two uses

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


def make() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = TiedLM().double()
    tokens = torch.randint(7, (3, 3 * 2, 4), generator=torch.Generator().manual_seed(1))
    return model, tokens


def loss(model: nn.Module, params: dict, tokens: torch.Tensor) -> torch.Tensor:
    logits = functional_call(model, params, (tokens[:, :-1],))  # tie_weights=True re-ties head
    return nn.functional.cross_entropy(logits.reshape(-1, 7), tokens[:, 1:].reshape(-1))


def reference() -> dict[str, torch.Tensor]:
    model, tokens = make()
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    for t in range(tokens.shape[0]):
        opt.zero_grad()
        logits = model(tokens[t][:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 7), tokens[t][:, 1:].reshape(-1)).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train(mesh: fzero.Mesh, stage: int, hooked: bool) -> Any:
    model, tokens = make()
    # named_parameters lists the shared weight once, as "tok.weight"
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adamw(lr=0.05)
    units = ["blocks.0", "blocks.1"] if hooked else None
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    step = fzero.sharded_step(
        lambda p, b: loss(model, p, b), opt, mesh, stage=stage, module=model if hooked else None
    )
    for t in range(tokens.shape[0]):
        state, _ = step(state, tokens[t][2 * mesh.rank : 2 * mesh.rank + 2])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("hooked", [False, True])
def test_tied_weights_sum_both_uses_like_torch(stage: int, hooked: bool) -> None:
    expected = reference()
    assert "head.weight" not in expected  # the reference, too, holds the tied weight once
    for params in run(3, train, stage, hooked):  # 3 ranks: shards split the weight unevenly
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
