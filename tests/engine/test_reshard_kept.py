"""Stage 3 with resharding keeps only the forward's last units gathered for the backward,
whatever last step's forward did: measured on the gathered buffers themselves (their
storage, alive or freed), with training checked against one-process torch.optim."""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
import fzero._engine._pool as pool
from tests.support import run

pytestmark = pytest.mark.multiprocess

D = 8


class Chain(nn.Module):
    """Units called in `order` (names of its layers; `big` four times as wide inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({n: nn.Linear(D, D, bias=False) for n in "acdefgh"})
        self.layers["b"] = nn.Sequential(nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor, order: str) -> torch.Tensor:
        for name in order:
            x = torch.tanh(self.layers[name](x))
        return x


def _train(mesh: fzero.Mesh, model: nn.Module, steps: list, prefetch: bool) -> Any:
    """The parameters after `steps` ((x, y, order) per rank), the gathered bytes alive when
    each forward ended (in units of one D x D weight), and how many buffers each step
    took for unit b (the only one wider than 4 D x D: its gathers, its gradient's)."""
    made: list[tuple[int, weakref.ref]] = []

    def take(self: Any, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=device)  # fresh: none comes back pooled
        made.append((numel, weakref.ref(out)))
        return out

    pool.Pool.take, pool.Pool.pools = take, lambda self, buf: False
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    alive = []

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y, order = batch
        out = functional_call(model, p, (x, order))
        held = sum(t.untyped_storage().nbytes() for _, r in made if (t := r()) is not None)
        alive.append(held / (D * D * x.element_size()))
        return ((out - y) ** 2).mean()

    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=[f"layers.{n}" for n in "abcdefgh"])
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, prefetch=prefetch)
    gathers = []
    with warnings.catch_warnings():  # a unit some step does not call: the zero gradient
        warnings.filterwarnings("ignore", "fzero: rank .: no rank's loss used")
        for x, y, order in steps:
            made.clear()
            state, _ = step(state, (x[mesh.rank], y[mesh.rank], order))
            gathers.append(sum(numel > 4 * D * D for numel, _ in made))
    return fzero.gather_params(state.params, mesh), alive, gathers


def _reference(model: nn.Module, steps: list) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for x, y, order in steps:
        opt.zero_grad()
        ((m(x.flatten(0, 1), order) - y.flatten(0, 1)) ** 2).mean().backward()
        for p in m.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a unit not called: fzero's zero gradient
        opt.step()
    return {k: v.detach() for k, v in m.named_parameters()}


def _steps(orders: list[str]) -> list:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2, 2, D, generator=g, dtype=torch.float64),
         torch.randn(2, 2, D, generator=g, dtype=torch.float64), order)
        for order in orders
    ]  # fmt: skip


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_deeper_forward_than_last_steps_reshards_its_extra_units(prefetch: bool) -> None:
    """A layer-drop or multi-task loop: 8 units, then 2, then 8. The deeper step kept all
    of its units past last step's two gathered until the backward (7 units, 8 with
    prefetch), as if resharding were off; now what a same-depth step keeps, the last
    entry (the last two with prefetch)."""
    torch.manual_seed(0)
    model = Chain().double()
    steps = _steps(["acdefgh", "acdefgh", "ac", "acdefgh"])
    expected = _reference(model, steps)
    for params, alive, _ in run(2, _train, model, steps, prefetch):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        assert alive[3] == alive[1] == (2 if prefetch else 1), alive


def test_a_unit_entered_twice_prefetches_what_follows_its_second_entry() -> None:
    """The forward a, b, a, c...: the second entry of `a` started gathering `b` again (the
    unit after a's first entry last step), four units wide, which nothing used and which
    stayed gathered through the backward; `c` went unprefetched."""
    torch.manual_seed(0)
    model = Chain().double()
    steps = _steps(["abacdefg"] * 3)
    expected = _reference(model, steps)
    for params, alive, gathers in run(2, _train, model, steps, True):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        # The forward's last two units kept (f and g), nothing more (b's wasted gather
        # held 8 more); b's wide buffers per step: its forward's gather, its backward's,
        # and its gradient's two (the wasted gather made 5).
        assert alive[2] == 2, alive
        assert gathers == [4, 4, 4], gathers
