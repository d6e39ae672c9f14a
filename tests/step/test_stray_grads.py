"""A loss that reads `module=`'s own parameters, not the tensors the step hands it, is
refused on every rank, naming the leaf: before the check, such a gradient was dropped and
training went on without it (an L2 term over `model.parameters()` 4.7e-2 off torch after
three AdamW steps, at every stage; `model(x)` called directly trained nothing at all)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import errors_on_every_rank, run

F64 = torch.float64


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 8)
        self.l2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net().double()


def _refused(
    model: _Net, loss_fn: Any, world_size: int, stage: int, units: Any = None, **kw: Any
) -> list[str]:
    """Each rank's error from one step of `loss_fn` (which must raise on every rank)."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def go(mesh: fzero.Mesh) -> None:
        opt = fzero.optim.adamw(lr=1e-2)
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model, **kw)
        g = torch.Generator().manual_seed(mesh.rank)
        step(state, torch.randn(4, 3, generator=g, dtype=F64))

    return errors_on_every_rank(world_size, go)


def _names(messages: list[str], leaf: str) -> None:
    for rank, message in enumerate(messages):
        assert message.startswith(f"ValueError: rank {rank}: the loss's gradient reached "), message
        assert f"module='s own parameter {leaf!r}" in message, message
        assert "functional_call(module, params" in message, message


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world_size", "stage", "units"),
    [(1, 0, None), (2, 0, None), (2, 1, None), (2, 2, ["l1", "l2"]), (2, 3, None), (2, 3, ["l1"])],
)
def test_an_l2_term_over_the_modules_parameters_is_refused(
    world_size: int, stage: int, units: list[str] | None
) -> None:
    # One rank: the step differentiates leaf by leaf (no units); two: through units.
    model = _model()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x,))
        return out.square().mean() + 0.1 * sum(q.square().sum() for q in model.parameters())

    _names(_refused(model, loss_fn, world_size, stage, units=units), "l1.bias")
    assert all(p.grad is None for p in model.parameters())  # nothing written into .grad


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world_size", "stage"), [(1, 0), (2, 0), (2, 3)])
def test_a_loss_calling_the_module_itself_is_refused(world_size: int, stage: int) -> None:
    # The root's parameters are the module's own; no hooked unit binds them.
    model = _model()
    _names(_refused(model, lambda p, x: model(x).square().mean(), world_size, stage), "l1.bias")


@pytest.mark.multiprocess
def test_one_attribute_read_is_named() -> None:
    model = _model()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean() + model.l2.weight.abs().sum()

    _names(_refused(model, loss_fn, 2, 3, units=["l1", "l2"]), "l2.weight")


@pytest.mark.multiprocess
def test_a_compiled_step_refuses_it_too() -> None:
    model = _model()

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x,))
        return out.square().mean() + 0.1 * model.l1.bias.square().sum()

    _names(_refused(model, loss_fn, 2, 0, compile="aot_eager"), "l1.bias")


@pytest.mark.multiprocess
def test_parameters_the_module_does_not_train_may_be_read() -> None:
    # A frozen leaf's value is the module's, so reading it there is the same training;
    # the step trains as torch does with the other leaves.
    model = _model()
    model.l1.weight.requires_grad_(False)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x,))
        return out.square().mean() + 0.1 * model.l1.weight.square().sum()

    params = {
        k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in model.named_parameters()
    }
    g = torch.Generator().manual_seed(1)
    batches = [[torch.randn(4, 3, generator=g, dtype=F64) for _ in range(2)] for _ in range(2)]
    fzero.testing.assert_stages_equivalent(
        loss_fn, params, batches, (torch.optim.AdamW, {"lr": 1e-2}), module=model, stages=(0, 3)
    )


class _Reversible(torch.autograd.Function):
    """A reversible residual's shape (Reformer's `_ReversibleFunction`, RevNets): the
    forward keeps no graph, and the backward runs the layer again and calls `.backward()`
    on it, which sends the layer's gradient into its parameters' `.grad`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        ctx.layer = layer
        ctx.save_for_backward(x)
        return x + layer(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            again = x.detach().requires_grad_()
            ctx.layer(again).backward(grad)
        return grad + again.grad, None


class _RevNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 8)
        self.f = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.l2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(_Reversible.apply(self.l1(x), self.f))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world_size", "stage", "units"),
    [(1, 0, None), (2, 0, None), (2, 1, None), (2, 2, ["f"]), (2, 3, None), (2, 3, ["f"])],
)
def test_a_layer_calling_backward_inside_its_backward_is_refused(
    world_size: int, stage: int, units: list[str] | None
) -> None:
    """Before, its parameters trained with a zero gradient where torch trains them (the
    step differentiates the tensors it hands the loss, and this gradient goes to the
    module's own `.grad`, or through an entry made inside the backward)."""
    torch.manual_seed(0)
    model = _RevNet().double()
    x = torch.randn(4, 3, dtype=F64)
    model(x).square().mean().backward()  # torch's own training: the layer gets a gradient
    assert model.f[0].weight.grad.abs().max() > 0
    model.zero_grad(set_to_none=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def go(mesh: fzero.Mesh) -> str:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
        step = fzero.sharded_step(
            lambda p, b: functional_call(model, p, (b,)).square().mean(),
            opt, mesh, stage=stage, module=model,
        )  # fmt: skip
        try:
            step(state, x)
        except (ValueError, RuntimeError) as exc:
            return str(exc)
        return "no error"

    for message in run(world_size, go):
        assert message.startswith("rank "), message
        assert "Reformer" in message, message  # names the cause, on every rank


@pytest.mark.multiprocess
def test_a_deferred_layer_calling_backward_inside_its_backward_names_the_cause() -> None:
    """Built by `fzero.init.deferred`, the module's own parameters are on the meta device,
    and the layer's backward fails in torch with "Tensor on device meta is not on the
    expected device cpu!", which named neither the layer nor the cure."""

    def go(mesh: fzero.Mesh) -> str:
        model = fzero.init.deferred(_RevNet).double()
        opt = fzero.optim.sgd(lr=0.1)
        params = dict(model.named_parameters())
        state = fzero.shard_state(params, opt, mesh, stage=2, init=fzero.init.from_module(model))
        loss = lambda p, b: functional_call(model, p, (b,)).square().mean()  # noqa: E731
        step = fzero.sharded_step(loss, opt, mesh, stage=2, module=model)
        try:
            step(state, torch.randn(4, 3, dtype=F64))
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    for message in run(2, go):
        assert "meta device (fzero.init.deferred" in message and "Reformer" in message, message
