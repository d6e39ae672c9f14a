"""torch.utils.checkpoint inside a user's model: an eager step recomputes with the
parameters its forward used, however the checkpointed function reaches them, reentrant
or not."""

import copy
import functools
import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fzero
from tests.support import run

pytestmark = pytest.mark.multiprocess  # ranks are fzero.simulate's processes

D, STEPS = 5, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _through(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return block(x)


class Holder:
    """Not a module: what a checkpointed function reads through it cannot be seen."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model


def _by_index(holder: Holder, i: int, x: torch.Tensor, act: Any = None) -> torch.Tensor:
    y = holder.model.blocks[i](x)
    return y if act is None else act(y)


class Net(nn.Module):
    """Three blocks, each checkpointed the way `how` says (torch's own calls)."""

    def __init__(self, how: str, reentrant: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, D), nn.Linear(D, 1)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.how, self.reentrant = how, reentrant
        self.act = nn.Identity()
        if how == "composable":
            for block in self.blocks:
                composable_checkpoint(block)  # torch's own, imported before any step

    def _block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[i](x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.how == "sequential":
            h = checkpoint_sequential(self.blocks, 2, h, use_reentrant=self.reentrant)
            return self.out(h)
        for i, block in enumerate(self.blocks):
            if self.how == "none":
                h = block(h)
                continue
            if self.how == "composable":  # its own pre-hook checkpoints its forward
                h = block(h)
                continue
            fn: Any = {
                "module": block,
                "method": functools.partial(self._block, i),
                "closure": lambda y, b=block: b(y),
                "argument": functools.partial(_through, block),
                "hidden": functools.partial(_by_index, Holder(self), i),
                # what it reads, hidden, and a module without parameters, seen
                "hidden, and an activation": functools.partial(_by_index, Holder(self), i),
            }[self.how]
            args = (self.act,) if self.how == "hidden, and an activation" else ()
            h = checkpoint(fn, h, *args, use_reentrant=self.reentrant)
        return self.out(h)


def make(how: str, reentrant: bool = False) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Net(how, reentrant).double()
    xs = torch.randn(STEPS, 4, 3, generator=g, dtype=torch.float64)
    return model, xs, torch.randn(STEPS, 4, 1, generator=g, dtype=torch.float64)


def torch_trained(how: str, reentrant: bool = False) -> dict[str, torch.Tensor]:
    """Plain torch: the model itself trained (checkpointed) by torch.optim.AdamW."""
    model, xs, ys = make(how, reentrant)
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    for t in range(STEPS):
        opt.zero_grad()
        ((model(xs[t]) - ys[t]) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train(
    mesh: fzero.Mesh, how: str, stage: int, module: bool, units: bool, reentrant: bool = False
) -> Any:
    model, xs, ys = make(how, reentrant)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adamw(lr=0.05)
    kw: dict[str, Any] = {"units": fzero.units.by_module(model, Block)} if units else {}
    state = fzero.shard_state(params, opt, mesh, stage=stage, **kw)

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, module=model if module else None, **kw
    )
    rows = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    for t in range(STEPS):
        state, _ = step(state, (xs[t, rows], ys[t, rows]))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["module", "method", "closure", "argument", "sequential"])
def test_torch_checkpoint_trains_as_torch_without_module(stage: int, how: str) -> None:
    # No `module=`, one unit: what the checkpointed function reads is told from it.
    expected = torch_trained(how)
    for params in run(2, train, how, stage, False, False):
        moved = max(
            (params[k] - v).abs().max().item() for k, v in make(how)[0].state_dict().items()
        )
        assert moved > 1e-3
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{how} {stage}")


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("units", [False, True])
@pytest.mark.parametrize("how", ["hidden", "hidden, and an activation"])
def test_a_function_reaching_its_model_otherwise_is_covered_by_module(
    stage: int, units: bool, how: str
) -> None:
    # A function that reads the model through an object that is not a module: `module=`
    # names what it may read, also where a module without parameters is seen.
    expected = torch_trained(how)
    for params in run(2, train, how, stage, True, units):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{stage}")


def test_torch_checkpoint_outside_a_step_is_torchs_own() -> None:
    # After fzero's steps, torch's checkpoint under functional_call behaves as torch's
    # (its recompute reads the module's own parameters): fzero acts only inside a step.
    run(2, train, "module", 0, False, False)
    model, xs, ys = make("module")
    plain = make("none")[0]

    def grads(net: nn.Module) -> dict[str, torch.Tensor]:
        p = {k: v.detach().mul(2).requires_grad_() for k, v in model.named_parameters()}
        ((functional_call(net, p, (xs[0],)) - ys[0]) ** 2).mean().backward()
        return {k: v.grad for k, v in p.items()}

    stale, right = grads(model), grads(plain)
    assert any(not torch.equal(stale[k], right[k]) for k in right)


def test_testing_reference_trains_the_checkpointed_model_as_torch() -> None:
    # fzero.testing's reference binds `module`'s parameters through the backward, so a
    # checkpointed model is checked against plain torch, not against a stale recompute.
    model, xs, ys = make("module")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    batches = [
        [(xs[t, 2 * r : 2 * r + 2], ys[t, 2 * r : 2 * r + 2]) for r in range(2)]
        for t in range(STEPS)
    ]
    fzero.testing.assert_stages_equivalent(
        loss_fn, params, batches, (torch.optim.AdamW, {"lr": 0.05}), stages=(0, 3), module=model
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["module", "sequential"])
@pytest.mark.parametrize("module", [False, True])
def test_a_reentrant_checkpoint_trains_as_torchs(stage: int, how: str, module: bool) -> None:
    # torch refuses a reentrant checkpoint under the step's gradient (taken with respect to
    # given tensors); inside a step it runs as the non-reentrant one, the same training.
    expected = torch_trained(how, reentrant=True)
    for params in run(2, train, how, stage, module, module, True):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{how} {stage}")


def test_a_reentrant_checkpoint_without_a_gradient_through_it_is_torchs() -> None:
    # Its inputs need no gradient: torch's reentrant checkpoint gives its parameters none
    # (and says so), in a step as in plain torch; the rest trains.
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()
    first = model[0]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        def body(y: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (y,))

        return checkpoint(body, x, use_reentrant=True).pow(2).mean() + p["1.bias"].pow(2).sum()

    def fn(mesh: fzero.Mesh) -> Any:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=0)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=0)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            state, _ = step(state, torch.ones(2, 3, dtype=torch.float64))
        return fzero.gather_params(state.params, mesh), [str(w.message) for w in said]

    for got, said in run(2, fn):
        assert any("None of the inputs have requires_grad" in w for w in said), said
        assert torch.equal(got["0.weight"], first.weight.detach())
        assert not torch.equal(got["1.bias"], params["1.bias"])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("module, units", [(False, False), (True, False), (True, True)])
def test_torchs_composable_checkpoint_trains_as_torch(
    stage: int, module: bool, units: bool
) -> None:
    # torch.distributed._composable.checkpoint: a forward pre-hook of the block pushes the
    # checkpoint's saved-tensor hooks after fzero's entered the unit, and calls torch's
    # generator by a name imported before the step.
    expected = torch_trained("composable")
    for params in run(2, train, "composable", stage, module, units):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{stage}")


def test_a_recompute_on_another_thread_sees_the_step() -> None:
    # On a GPU autograd recomputes on a thread of its own, where the step's context
    # variable is not set: checkpoints nested in a recompute must still see the step.
    from fzero._engine._bindings import slots
    from fzero._engine._checkpoints import _STEP, checkpoints_rebound, recomputing

    seen: list[bool] = []
    with checkpoints_rebound(None):
        where = slots([nn.Linear(2, 2)])
        again = recomputing(where, lambda: seen.append(_STEP.get() is not None))
    worker = threading.Thread(target=again)
    worker.start()
    worker.join()
    assert seen == [True] and _STEP.get() is None
