"""fzero.remat: activation checkpointing inside and around units, at every stage."""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import fzero
from tests.support import counting, differences, module_values, run


class Block(nn.Module):
    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(d, d), nn.Linear(d, d), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.how == "inside":  # FSDP(checkpoint(m)): the unit's body is checkpointed
            h = fzero.remat(self.fc2)(h)
        elif self.how == "plain":  # torch's own checkpoint (tests/engine/test_torch_checkpoint.py)
            h = checkpoint(self.fc2, h, use_reentrant=False)
        else:
            h = self.fc2(h)
        return x + torch.tanh(h)


class Net(nn.Module):
    def __init__(self, how: str, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, how) for _ in range(3))
        self.out, self.how = nn.Linear(d, 2), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            # checkpoint(FSDP(m)): the whole unit is checkpointed, its gather included
            x = fzero.remat(block)(x) if self.how == "outside" else block(x)
        return self.out(x)


def make(how: str, n: int = 2) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return (
        Net(how).double(),
        torch.randn(4, n * 2, 4, generator=g, dtype=torch.float64),
        torch.randn(4, n * 2, 2, generator=g, dtype=torch.float64),
    )


def reference(n: int = 2) -> dict[str, torch.Tensor]:
    model, xs, ys = make("none", n)
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        ((model(xs[t]) - ys[t]) ** 2).mean().backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def stepped(
    mesh: fzero.Mesh, model: nn.Module, block: type, stage: int, xs: torch.Tensor, ys: torch.Tensor
) -> fzero.ShardedState:
    """`model` trained by Adam with `block` modules as units, each rank on its slice of
    each step's batch."""
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    units = fzero.units.by_module(model, block)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model)
    rows = xs.shape[1] // mesh.size
    sl = slice(rows * mesh.rank, rows * (mesh.rank + 1))
    for x, y in zip(xs, ys):
        state, _ = step(state, (x[sl], y[sl]))
    return state


def train(mesh: fzero.Mesh, how: str, stage: int) -> tuple[Any, int, int]:
    model, xs, ys = make(how, mesh.size)
    reductions = ("reduce_scatter_async", "all_reduce_async", "reduce_scatter_mean")
    gathers_of = ("all_gather_async", "all_gather_many_async")  # stage 1: the update's
    with counting(gathers_of) as gathers, counting(reductions) as reduced:
        state = stepped(mesh, model, Block, stage, xs, ys)
    return fzero.gather_params(state.params, mesh), len(gathers), len(reduced)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["inside", "outside", "plain"])
def test_remat_matches_single_process(stage: int, how: str) -> None:
    expected = reference()
    for params, _, _ in run(2, train, how, stage):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{how} {stage}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 3])
def test_checkpointing_around_units_communicates_no_more_than_inside_them(stage: int) -> None:
    # FSDP(checkpoint(m)) vs checkpoint(FSDP(m)): around a unit, the recompute re-enters
    # the unit's hook inside the backward. It reuses the forward's entry (at stage 3 the
    # one re-gather every resharded unit gets for its backward): no second all-gather, no
    # reduction of its own.
    _, inside_gathers, inside_reduced = run(2, train, "inside", stage)[0]
    _, outside_gathers, outside_reduced = run(2, train, "outside", stage)[0]
    steps, blocks = 4, 3
    assert outside_gathers == inside_gathers > 0
    if stage == 3:  # per step: the root and each block in the forward, each block again,
        # but from the second step the last two blocks, which stay gathered into the backward
        assert inside_gathers == steps * (1 + 2 * blocks) - (steps - 1) * 2
    assert outside_reduced == inside_reduced


def compiled_remat(mesh: fzero.Mesh, how: str) -> str:
    """A compiled stage-3 step with module hooks: remat around a unit ("outside") or
    inside its body ("inside")."""
    model, xs, ys = make(how, mesh.size)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=fzero.units.by_module(model, Block))

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, compile="aot_eager")
    sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    with pytest.warns(RuntimeWarning, match="breaks torch.compile's graph"):
        try:
            step(state, (xs[0, sl], ys[0, sl]))
        except ValueError as exc:
            return str(exc)
    return "trained"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_remat_around_a_hooked_unit_is_refused_naming_the_remedy() -> None:
    # fzero.remat breaks the graph; around a unit module='s hooks enter it recorded the
    # compiled step's placeholders, and its recompute failed inside torch on the meta
    # device. Its body checkpointed (the remedy named) trains.
    for said in run(2, compiled_remat, "outside"):
        assert said.startswith("fzero: a fzero.remat of Block ran outside"), said
        assert "checkpoint the unit's body rather than the unit" in said
    assert run(2, compiled_remat, "inside") == ["trained"] * 2


class Centred(nn.Module):
    """Its input less a running mean of it, a buffer the forward rebinds (out of place)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return x - self.mean


class Shared(nn.Module):
    """One buffer registered by two submodules: one moves it in place, the other reads it."""

    def __init__(self) -> None:
        super().__init__()
        # float64 already: the model's .double() would part a float32 pair
        self.a, self.b, mean = nn.Module(), nn.Module(), torch.zeros(4, dtype=torch.float64)
        self.a.register_buffer("mean", mean)
        self.b.register_buffer("mean", mean)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.a.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.b.mean


# A block whose forward writes its buffers: in place, BatchNorm's running statistics (with
# momentum, and the cumulative average that counts batches) and spectral norm's power
# iteration, whose updated vectors the output then reads; or by rebinding one.
NORMS: dict[str, Callable[[], nn.Module]] = {
    "batchnorm": lambda: nn.BatchNorm1d(4),
    "cumulative": lambda: nn.BatchNorm1d(4, momentum=None),
    "spectral": lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)),
    "rebound": Centred,
    "shared": Shared,  # replayed as one: copies apart, the reader would miss the write
}


class Normed(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(4, 4), NORMS[norm]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x)))


class NormedNet(nn.Module):
    def __init__(self, norm: str, remat: bool) -> None:
        super().__init__()
        self.block, self.out, self.remat = Normed(norm), nn.Linear(4, 2), remat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(fzero.remat(self.block)(x) if self.remat else self.block(x))


def normed(norm: str, remat: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return (
        NormedNet(norm, remat).double(),
        torch.randn(3, 8, 4, generator=g, dtype=torch.float64),
        torch.randn(3, 8, 2, generator=g, dtype=torch.float64),
    )


def normed_reference(norm: str, n: int) -> dict[str, torch.Tensor]:
    """Plain torch, no checkpoint: each step's gradient the mean of `n` ranks' losses on
    their slices, each rank's forward with its own buffers (each rank's module keeps its
    own); rank 0's at the end."""
    model, xs, ys = normed(norm, remat=False)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)

    def buffers(values: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(values[k] if values is not None else v)
        return {k: v.clone() for k, v in model.named_buffers()}

    ranks = [buffers() for _ in range(n)]
    for x, y in zip(xs, ys):
        opt.zero_grad()
        for r, (xr, yr) in enumerate(zip(x.chunk(n), y.chunk(n))):
            buffers(ranks[r])
            (((model(xr) - yr) ** 2).mean() / n).backward()
            ranks[r] = buffers()
        opt.step()
    buffers(ranks[0])
    return module_values(model)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_remat_by_hand_replays_the_buffers_its_forward_wrote(norm: str) -> None:
    # torch's checkpoint writes them again in the recompute: BatchNorm's statistics moved
    # twice a step, and spectral norm's recompute iterated from the forward's result, its
    # gradients those of another weight.
    model, xs, ys = normed(norm, remat=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    want = normed_reference(norm, 1)
    assert not torch.equal(want["out.weight"], normed(norm, remat=False)[0].out.weight)
    assert differences(module_values(model), want) == []


def train_normed(mesh: fzero.Mesh, norm: str, stage: int) -> dict[str, torch.Tensor]:
    model, xs, ys = normed(norm, remat=True)
    state = stepped(mesh, model, Normed, stage, xs, ys)
    return {**fzero.gather_params(state.params, mesh), **dict(model.named_buffers())}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("norm", ["cumulative", "spectral", "rebound", "shared"])
def test_remat_in_a_step_replays_the_buffers_its_forward_wrote(norm: str, stage: int) -> None:
    want = normed_reference(norm, 2)
    got = run(2, train_normed, norm, stage)[0]
    fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12, what=f"{norm} {stage}")
