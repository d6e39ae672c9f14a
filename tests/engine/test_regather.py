"""Stage 3 resharding gathers again only what a backward uses, the same on every rank.

Each test trains against plain torch.optim on one process, and counts the backward's
gathers with the communication ledger.
"""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import fzero
from tests.support import run

STEPS, D, V = 3, 6, 11


class LM(nn.Module):
    """An embedding, three hidden layers and an output layer: one unit each."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.a, self.b, self.c = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for layer in (self.a, self.b, self.c):
            h = torch.tanh(layer(h))
        return self.out(h)


UNITS = ["emb", "a", "b", "c", "out"]


def lm_loss(model: nn.Module) -> Any:
    def loss(p: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
        idx, target = batch
        return nn.functional.cross_entropy(functional_call(model, p, (idx,)), target)

    return loss


def lm_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(V, (STEPS, 2 * n), generator=g), torch.randint(
        V, (STEPS, 2 * n), generator=g
    )


def reference(params: Any, loss: Any, batches: list[list[Any]]) -> Any:
    """torch.optim.Adam on one process over a tree of tensors; each step's loss is the
    mean of `loss` over every rank's micro-batch `batches[t]` (a step of equal ones)."""
    leaves, treedef = fzero._core._tree.tree_flatten(params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.Adam(tensors, lr=0.01)
    for t in range(STEPS):
        opt.zero_grad()
        p = fzero._core._tree.tree_unflatten(treedef, tensors)
        parts = [loss(p, b) for b in batches[t]]
        (sum(parts) / len(parts)).backward()
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def train_lm(mesh: fzero.Mesh, params: dict[str, torch.Tensor]) -> tuple[Any, list[dict]]:
    torch.manual_seed(0)
    model = LM().double()
    idx, target = lm_data(mesh.size)
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    step = fzero.sharded_step(lm_loss(model), opt, mesh, stage=3, module=model)
    rows = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    gathered = []
    for t in range(STEPS):
        with fzero.comm_ledger() as ledger:
            state, _ = step(state, (idx[t, rows], target[t, rows]))
        gathered.append(sum(r.elements for r in ledger.data if r.op == "all_gather"))
    sizes = {
        u: sum(state.layout.buckets[i].full_numel for i in state.layout.unit_buckets(u))
        for u in UNITS
    }
    return fzero.gather_params(state.params, mesh), [gathered, sizes]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_units_no_backward_uses_are_not_gathered_again(n: int) -> None:
    # The embedding's backward needs only the indices: its table is gathered for the
    # forward alone. From the second step the last two units stay gathered for the
    # backward (`keep_last`), so only the hidden layers a and b are gathered again.
    torch.manual_seed(0)
    model = LM().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    idx, target = lm_data(n)
    batches = [
        [(idx[t, 2 * r : 2 * r + 2], target[t, 2 * r : 2 * r + 2]) for r in range(n)]
        for t in range(STEPS)
    ]
    expected = reference(params, lm_loss(model), batches)
    assert not torch.equal(expected["emb.weight"], params["emb.weight"])
    for got, (gathered, sizes) in run(n, train_lm, params):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what=f"{n} ranks")
        psi = sum(sizes.values())
        first = psi + sizes["a"] + sizes["b"] + sizes["c"] + sizes["out"]
        later = psi + sizes["a"] + sizes["b"]
        assert gathered == [first, later, later]


def pure_loss(params: dict[str, Any], batch: tuple) -> torch.Tensor:
    """Four layers asked for with fzero.gathered. Where `scaled`, the input is multiplied
    by the root's `scale` first: it then needs a gradient, and so does layer 0's weight."""
    x, y, scaled = batch
    h = x * params["scale"] if scaled else x
    for i in range(4):
        layer = fzero.gathered(params, f"l{i}")
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return ((h - y) ** 2).mean()


def pure_params() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    params: dict[str, Any] = {"scale": 1 + 0.1 * torch.randn(D, generator=g, dtype=torch.float64)}
    for i in range(4):
        params[f"l{i}"] = {
            "w": torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5,
            "b": torch.randn(D, generator=g, dtype=torch.float64) * 0.1,
        }
    return params


def pure_data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(STEPS, 2 * n, D, generator=g, dtype=torch.float64)
    return xs, torch.randn(STEPS, 2 * n, D, generator=g, dtype=torch.float64)


def train_pure(mesh: fzero.Mesh, loss: Any, scaled_ranks: tuple[int, ...]) -> Any:
    opt = fzero.optim.adam(lr=0.01)
    units = [f"l{i}" for i in range(4)]
    state = fzero.shard_state(pure_params(), opt, mesh, stage=3, units=units)
    step = fzero.sharded_step(loss, opt, mesh, stage=3, just_in_time=True)
    for micro in pure_batches(mesh.size, scaled_ranks):
        state, _ = step(state, micro[mesh.rank])
    return fzero.gather_params(state.params, mesh)


def pure_batches(n: int, scaled_ranks: tuple[int, ...]) -> list[list[Any]]:
    """Every rank's micro-batch per step, as `train_pure` hands them out."""
    xs, ys = pure_data(n)
    rows = [slice(2 * r, 2 * r + 2) for r in range(n)]
    return [
        [(xs[t, sl], ys[t, sl], r in scaled_ranks) for r, sl in enumerate(rows)]
        for t in range(STEPS)
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("scaled_ranks", [(0,), (1,), (0, 2)])
def test_ranks_whose_backward_uses_different_units_gather_alike(
    scaled_ranks: tuple[int, ...],
) -> None:
    # Layer 0's weight is saved on the scaled ranks only. Every rank gathers it again
    # (the call check ORs what the ranks need), or the gathers would pair wrongly and time
    # out; the others' backward just does not use it.
    n = 3
    expected = reference(pure_params(), pure_loss, pure_batches(n, scaled_ranks))
    for got in run(n, train_pure, pure_loss, scaled_ranks):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what=str(scaled_ranks))


def checkpointed_loss(params: dict[str, Any], batch: tuple) -> torch.Tensor:
    """pure_loss with layer 0 entered inside torch's checkpoint: autograd saves nothing of
    it in the forward, and the recompute inside the backward asks for the unit again."""
    x, y, _ = batch

    def first(x: torch.Tensor) -> torch.Tensor:
        layer = fzero.gathered(params, "l0")
        return torch.tanh(x @ layer["w"] + layer["b"])

    h = checkpoint(first, x, use_reentrant=False)
    for i in range(1, 4):
        layer = fzero.gathered(params, f"l{i}")
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return ((h - y) ** 2).mean()


@pytest.mark.multiprocess
def test_a_unit_entered_inside_a_checkpoint_is_gathered_again() -> None:
    expected = reference(pure_params(), checkpointed_loss, pure_batches(2, ()))
    for got in run(2, train_pure, checkpointed_loss, ()):
        fzero.assert_trees_close(got, expected, rtol=1e-10, atol=1e-12, what="checkpoint")
