"""A first step names the trainable leaves no rank's loss used (fzero steps them with a
zero gradient where torch.optim skips a `.grad` of None), on every rank, once; never a
leaf some rank used, a frozen one, or one a unit handed out without its gradient."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import run

F64 = torch.float64


class Net(nn.Module):
    """`head` runs on every rank, `side` on rank 0 only, `pooler` never (a pooler under a
    loss on the hidden states); `still` is never used but frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4, dtype=F64)
        self.head = nn.Linear(4, 2, dtype=F64)
        self.side = nn.Linear(4, 2, dtype=F64)
        self.pooler = nn.Linear(4, 4, dtype=F64)
        self.still = nn.Linear(4, 4, dtype=F64)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + self.side(h) if rank == 0 else out


def said(mesh: fzero.Mesh, stage: int, entry: str, accumulate: str | None) -> list[list[str]]:
    """The warnings each of two steps gave on this rank."""
    torch.manual_seed(0)
    net = Net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    units = ["body", "head", "pooler", "still"]  # `side` in the root, read on rank 0 only
    opt = fzero.optim.adamw(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, frozen=["still"])

    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (x, mesh.rank)).square().mean()

    kw: dict[str, Any] = {"module": net} if entry == "hooks" else {}
    step = fzero.sharded_step(loss, opt, mesh, stage=stage, units=units, accumulate=accumulate,
                              **kw)  # fmt: skip
    out = []
    for _ in range(2):
        x = torch.randn(2, 3, 4, dtype=F64)
        batch = list(x) if accumulate else x[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = step(state, batch)
        out.append([str(w.message) for w in caught if "no rank's loss used" in str(w.message)])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world", "stage", "entry", "accumulate"),
    [
        (2, 0, "front", None),
        (2, 1, "hooks", None),
        (2, 2, "front", "sharded"),
        (2, 3, "hooks", None),
        (2, 3, "front", "local"),
        (1, 0, "front", None),  # one rank: gradients by leaf
    ],
)
def test_a_first_step_names_the_leaves_no_loss_used(
    world: int, stage: int, entry: str, accumulate: str | None
) -> None:
    for rank, (first, second) in enumerate(run(world, said, stage, entry, accumulate)):
        assert len(first) == 1 and second == [], (first, second)
        assert f"rank {rank}: no rank's loss used 2 trainable parameter(s)" in first[0]
        assert "['pooler.bias', 'pooler.weight']" in first[0], first[0]  # not side, still


def compiled_said(mesh: fzero.Mesh) -> list[str]:
    net = Net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=0)
    step = fzero.sharded_step(
        lambda p, x: functional_call(net, p, (x, 1)).square().mean(), opt, mesh, stage=0,
        compile="aot_eager",
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(state, torch.randn(3, 4, dtype=F64))
    return [str(w.message) for w in caught if "no rank's loss used" in str(w.message)]


@pytest.mark.multiprocess
def test_a_compiled_step_does_not_say_it() -> None:
    """The graph hands no gradient over leaf by leaf: a compiled step cannot tell (said in
    docs/training.md), and says nothing rather than something wrong."""
    assert run(1, compiled_said) == [[]]


def empty_first(mesh: fzero.Mesh) -> list[list[str]]:
    """A first step with no data anywhere (no gradient reached anything), then one with."""
    net = Net()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=2, frozen=["still"])

    def loss(p: Any, x: torch.Tensor) -> tuple[torch.Tensor, int]:  # a token-weighted pair
        return functional_call(net, p, (x, mesh.rank)).square().sum(), x.shape[0]

    step = fzero.sharded_step(loss, opt, mesh, stage=2)
    out = []
    for n in (0, 3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = step(state, torch.randn(n, 4, dtype=F64))
        out.append([str(w.message) for w in caught if "no rank's loss used" in str(w.message)])
    return out


@pytest.mark.multiprocess
def test_a_first_step_without_data_anywhere_waits_for_one_with() -> None:
    for first, second in run(2, empty_first):
        assert first == [] and len(second) == 1, (first, second)
        assert "['pooler.bias', 'pooler.weight']" in second[0]
