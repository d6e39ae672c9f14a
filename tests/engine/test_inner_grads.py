"""A loss that differentiates inside itself trains as torch trains it: sharpness-aware
minimization (SAM: the gradient at perturbed parameters) by its parameters, a gradient
penalty by its input. Where a unit's parameters are placeholders (`module=`'s hooked
units outside their forward), asking autograd for their gradient is refused naming the
leaf: torch only said "One of the differentiated Tensors does not require grad"."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero.testing
from tests.support import errors_on_every_rank

F64 = torch.float64


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net().double()


def _sam(model: nn.Module, how: str = "grad") -> Any:
    """SAM's loss: the loss at the parameters moved along their gradient (`how`: taken with
    torch.autograd.grad, or accumulated by torch.autograd.backward into `.grad`)."""

    def loss_fn(p: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :3], batch[:, 3:]
        first = (functional_call(model, p, (x,)) - y).square().mean()
        names = list(p)
        if how == "grad":
            grads = torch.autograd.grad(first, [p[n] for n in names])
        else:
            inputs = [p[n] for n in names]
            torch.autograd.backward(first, inputs=inputs)
            grads = [t.grad for t in inputs]
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        moved = {n: p[n] + 0.05 * g / norm for n, g in zip(names, grads)}
        return (functional_call(model, moved, (x,)) - y).square().mean()

    return loss_fn


def _batches(width: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(4, width, generator=g, dtype=F64) for _ in range(2)] for _ in range(3)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sam_trains_as_torch_at_every_stage() -> None:
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    fzero.testing.assert_stages_equivalent(
        _sam(model), params, _batches(4), (torch.optim.SGD, {"lr": 0.1}), module=model
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_gradient_penalty_trains_as_torch_with_units() -> None:
    model = _model()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        u = functional_call(model, p, (x,))
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return u.square().mean() + (du.norm(dim=1) - 1).square().mean()

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    fzero.testing.assert_stages_equivalent(
        loss_fn, params, _batches(3), (torch.optim.AdamW, {"lr": 1e-2}), module=model,
        units=["inp", "mid", "out"],
    )  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["grad", "backward"])
@pytest.mark.parametrize("stage", [0, 3])
def test_differentiating_by_a_placeholder_is_refused_naming_it(how: str, stage: int) -> None:
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def go(mesh: fzero.Mesh) -> None:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=["inp", "out"])
        step = fzero.sharded_step(_sam(model, how), opt, mesh, stage=stage, module=model)
        step(state, _batches(4)[0][mesh.rank])

    for rank, message in enumerate(errors_on_every_rank(2, go)):
        assert message.startswith(f"ValueError: rank {rank}: the loss asked autograd "), message
        assert "parameter 'inp.weight' of the just-in-time unit 'inp'" in message, message
        assert f"(torch.autograd.{how})" in message and "leave those units out" in message
