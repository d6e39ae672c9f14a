"""Gradient hooks on a module's parameters (`param.register_hook`) in a step given
`module=`: run on the tensors the loss is handed, as torch runs them on the parameters of
a module trained itself."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import run

pytestmark = pytest.mark.multiprocess  # ranks are fzero.simulate's processes

STEPS, VOCAB, NEW = 3, 10, 7  # rows NEW.. of the embedding are the new tokens


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x).mean(1)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


def rows(g: torch.Tensor) -> torch.Tensor:
    """Trains the new tokens' rows only: the fine-tuning recipe for added tokens."""
    mask = torch.zeros_like(g)
    mask[NEW:] = 1
    return g * mask


def halve(g: torch.Tensor) -> torch.Tensor:
    return g * 0.5


def hooked() -> nn.Module:
    torch.manual_seed(0)
    model = Net().double()
    model.tok.weight.register_hook(rows)
    model.blocks[1].weight.register_hook(halve)
    return model


def data(world: int, micro: int) -> list[list[list[Any]]]:
    """Per step, per rank, its micro-batches (tokens, targets)."""
    g = torch.Generator().manual_seed(1)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, VOCAB, (2, 3), generator=g)
        return x, torch.randn(2, 1, generator=g, dtype=torch.float64)

    return [[[pair() for _ in range(micro)] for _ in range(world)] for _ in range(STEPS)]


def torch_trained(world: int, micro: int) -> dict[str, torch.Tensor]:
    """The hooked model itself trained by torch.optim.Adam on the whole batch."""
    model = hooked()
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for step in data(world, micro):
        opt.zero_grad()
        pairs = [b for rank in step for b in rank]
        x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def loss_of(model: nn.Module) -> Any:
    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    return loss_fn


def train(mesh: fzero.Mesh, stage: int, units: bool, micro: int) -> dict[str, torch.Tensor]:
    model = hooked()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    kw: dict[str, Any] = {"units": ["tok", "blocks.0", "blocks.1"]} if units else {}
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, **kw)
    accumulate = {"accumulate": "sharded"} if micro > 1 else {}
    step = fzero.sharded_step(
        loss_of(model), opt, mesh, stage=stage, module=model, **kw, **accumulate
    )
    for batches in data(mesh.size, micro):
        mine = batches[mesh.rank]
        state, _ = step(state, mine if micro > 1 else mine[0])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("units", [False, True])
@pytest.mark.parametrize("world, micro", [(1, 1), (2, 1), (2, 2)])
def test_parameter_hooks_train_as_torch(stage: int, units: bool, world: int, micro: int) -> None:
    expected = torch_trained(world, micro)
    start = hooked().tok.weight.detach()
    for params in run(world, train, stage, units, micro):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        assert torch.equal(params["tok.weight"][:NEW], start[:NEW])  # the old tokens stay
        assert not torch.equal(params["tok.weight"][NEW:], start[NEW:])


def test_without_the_hooks_the_old_tokens_would_move() -> None:
    # What the hooks change: the same training without them moves every row.
    model = hooked()
    model.tok.weight._backward_hooks.clear()
    model.blocks[1].weight._backward_hooks.clear()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        opt = fzero.optim.adam(lr=0.05)
        state = fzero.shard_state(params, opt, mesh, stage=3)
        step = fzero.sharded_step(loss_of(model), opt, mesh, stage=3, module=model)
        for batches in data(2, 1):
            state, _ = step(state, batches[mesh.rank][0])
        return fzero.gather_params(state.params, mesh)

    got = run(2, fn)[0]
    assert not torch.equal(got["tok.weight"][:NEW], params["tok.weight"][:NEW])


def test_testing_reference_runs_the_parameters_hooks() -> None:
    model = hooked()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    batches = [[rank[0] for rank in step] for step in data(2, 1)]
    fzero.testing.assert_stages_equivalent(
        loss_of(model), params, batches, (torch.optim.Adam, {"lr": 0.05}), module=model
    )


def test_a_post_accumulate_grad_hook_is_refused_on_every_rank() -> None:
    # One rank's model has it: every rank raises at the first step's agreement, and the
    # step function is usable once it is gone.
    def fn(mesh: fzero.Mesh) -> tuple[str, bool]:
        model = hooked()
        hook = None
        if mesh.rank == 1:
            hook = model.out.weight.register_post_accumulate_grad_hook(lambda p: None)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=2)
        step = fzero.sharded_step(loss_of(model), opt, mesh, stage=2, module=model)
        batch = data(2, 1)[0][mesh.rank][0]
        with pytest.raises(TypeError, match=r"'out\.weight' has a post-accumulate-grad hook") as e:
            step(state, batch)
        if hook is not None:
            hook.remove()
        state, _ = step(state, batch)
        moved = not torch.equal(
            fzero.gather_params(state.params, mesh)["out.weight"], params["out.weight"]
        )
        return str(e.value), moved

    said = run(2, fn)
    assert all("rank 1: " in s and "would never run" in s for s, _ in said)
    assert all(moved for _, moved in said)


def test_a_compiled_step_refuses_parameter_hooks_on_every_rank() -> None:
    model = hooked()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def fn(mesh: fzero.Mesh) -> None:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=0)
        step = fzero.sharded_step(
            loss_of(model), opt, mesh, stage=0, module=model, compile="aot_eager"
        )
        with pytest.raises(ValueError, match="gradient hooks on module='s parameters"):
            step(state, data(2, 1)[0][mesh.rank][0])

    run(2, fn)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_hook_gets_the_parameters_dtype_under_mixed_precision(stage: int) -> None:
    # torch hands a parameter's hooks its own dtype: a hook written for fp32 (its mask
    # fp32) runs on the bf16 compute's gradient cast to fp32, and its result goes back.
    seen: list[torch.dtype] = []

    def fp32_rows(g: torch.Tensor) -> torch.Tensor:
        seen.append(g.dtype)
        mask = torch.zeros(VOCAB, 4)
        mask[NEW:] = 1
        return g * mask

    def fn(mesh: fzero.Mesh) -> dict[str, Any]:
        torch.manual_seed(0)
        model = Net()
        model.tok.weight.register_hook(fp32_rows)
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        opt = fzero.optim.adam(lr=0.05)
        precision = fzero.Precision(torch.bfloat16)
        state = fzero.shard_state(params, opt, mesh, stage=stage, precision=precision)

        def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
            out = functional_call(model, p, (batch[0],)).float()
            return ((out - batch[1].float()) ** 2).mean()

        step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model)
        for batches in data(mesh.size, 1):
            state, _ = step(state, batches[mesh.rank][0])
        return {"start": params["tok.weight"], "seen": seen, **fzero.master_params(state, mesh)}

    for got in run(2, fn):  # each rank its own process: its own `seen`
        assert torch.equal(got["tok.weight"][:NEW], got["start"][:NEW])
        assert not torch.equal(got["tok.weight"][NEW:], got["start"][NEW:])
        assert got["seen"] and set(got["seen"]) == {torch.float32}
