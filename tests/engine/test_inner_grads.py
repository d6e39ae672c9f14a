"""A loss that differentiates inside itself trains as torch trains it: sharpness-aware
minimization (SAM: the gradient at perturbed parameters) and MAML's inner step by its
parameters, a gradient penalty by its input. Where a unit's parameters are placeholders
(`module=`'s hooked units outside their forward), asking autograd for their gradient is
refused naming the leaf: torch only said "One of the differentiated Tensors does not
require grad"."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero.testing
from tests.support import errors_on_every_rank, run

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


def _maml(model: nn.Module) -> Any:
    """MAML's loss: one inner step on the root's parameters (entered up front) with
    create_graph=True, then the loss at the moved parameters, hooked units entered again."""

    def loss_fn(p: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :3], batch[:, 3:]
        inner = (functional_call(model, p, (x[:2],)) - y[:2]).square().mean()
        names = [n for n in p if n.startswith("mid.")]
        grads = torch.autograd.grad(inner, [p[n] for n in names], create_graph=True)
        fast = {**p, **{n: p[n] - 0.1 * g for n, g in zip(names, grads)}}
        return (functional_call(model, fast, (x[2:],)) - y[2:]).square().mean()

    return loss_fn


@pytest.mark.slow
@pytest.mark.multiprocess
def test_maml_trains_as_torch_with_resharded_units() -> None:
    # The inner backward runs inside the loss, before the second forward enters the units
    # again: at stage 3 the step's own backward then asked for the second entries'
    # parameters, which the inner backward's re-gather order had passed ("no rank's
    # forward saved for it").
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    fzero.testing.assert_stages_equivalent(
        _maml(model), params, _batches(4), (torch.optim.AdamW, {"lr": 1e-2}), module=model,
        units=["inp", "out"],
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [True, False])
def test_maml_trains_as_torch_under_hpz(prefetch: bool) -> None:
    # hpZ gathers again from the slices the forward kept, which the inner backward's
    # re-gathers used up: the step's backward re-gathered those entries once more, from
    # nothing (IndexError); without prefetch, even once they were reduced. An entry is
    # gathered again once a micro-batch.
    model = _model()
    loss_fn = _maml(model)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    data = torch.randn(3, 4, 4, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    tensors = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = torch.optim.AdamW(list(tensors.values()), lr=1e-2)
    for t in range(3):  # torch: the mean of the four ranks' losses
        opt.zero_grad()
        torch.stack([loss_fn(tensors, data[t, r]) for r in range(4)]).mean().backward()
        opt.step()

    def go(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        o = fzero.optim.adamw(lr=1e-2)
        state = fzero.shard_state(params, o, mesh, stage=3, units=["inp", "out"])
        step = fzero.sharded_step(
            loss_fn, o, mesh, stage=3, module=model, reshard_after_forward=2, prefetch=prefetch
        )
        for t in range(3):
            state, _ = step(state, data[t, mesh.rank])
        return fzero.gather_params(state.params, mesh)

    want = {k: v.detach() for k, v in tensors.items()}
    for got in run(4, go):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert not torch.equal(want["inp.weight"], params["inp.weight"])
