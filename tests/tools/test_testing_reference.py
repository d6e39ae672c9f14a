"""fzero.testing's one-process reference: it must see what training the model itself
sees, so that a check that passes means the user's model trains like torch.optim."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from fzero import testing

pytestmark = pytest.mark.multiprocess


def _batches(world: int, steps: int = 2) -> list:
    g = torch.Generator().manual_seed(3)
    return [
        testing.split_batch(
            (
                torch.randn(2 * world, 4, generator=g, dtype=torch.float64),
                torch.randn(2 * world, 2, generator=g, dtype=torch.float64),
            ),
            world,
        )
        for _ in range(steps)
    ]


def test_a_loss_reading_the_models_own_parameters_is_named() -> None:
    """An L2 term over `model.parameters()` rather than the tree: every stage drops its
    gradient alike, so the check passed where training the model itself differs (found
    by a second reader)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        fit = nn.functional.mse_loss(functional_call(model, p, (x,)), y)
        return fit + 0.1 * sum(w.square().sum() for w in model.parameters())

    with pytest.raises(ValueError, match=r"reads a \(\d.*\) torch.float64 parameter .* outside"):
        testing.assert_stages_equivalent(
            loss_fn, dict(model.named_parameters()), _batches(2), (torch.optim.SGD, {"lr": 0.1})
        )


def _token_loss(p: dict, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """A sum of per-row losses over the rows whose first target is above -0.5, and their
    count: ranks weigh differently (0, 0 and 2 rows at the first step, 0, 2, 1 next)."""
    x, y = batch
    mask = (y[:, 0] > -0.5).double()
    rows = ((torch.tanh(x @ p["w"]) - y) ** 2).sum(-1)
    return (rows * mask).sum(), mask.sum()


def test_total_and_weight_losses_are_checked_as_the_global_mean() -> None:
    """`(total, weight)` losses, as `sharded_step` takes them: the reference trains on
    Σ total / Σ weight (it stacked the pairs and raised a TypeError)."""
    g = torch.Generator().manual_seed(4)
    params = {"w": torch.randn(4, 2, generator=g, dtype=torch.float64)}
    batches = _batches(3)
    testing.assert_stages_equivalent(
        _token_loss, params, batches, (torch.optim.Adam, {"lr": 0.05}), stages=(0, 3)
    )
    # An fzero optimizer 1 % off: the check must fail.
    with pytest.raises(AssertionError, match="stage 0"):
        testing.assert_stages_equivalent(
            _token_loss,
            params,
            batches,
            (torch.optim.Adam, {"lr": 0.05}),
            stages=(0,),
            fzero_optimizer=fzero.optim.adam(lr=0.0505),
        )


def test_the_models_buffers_are_left_as_they_were() -> None:
    """A BatchNorm in training mode: the reference's forwards updated the user's running
    statistics and batch count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)).double()
    before = {k: v.clone() for k, v in model.named_buffers()}

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    testing.assert_stages_equivalent(
        loss_fn,
        dict(model.named_parameters()),
        _batches(2),
        (torch.optim.SGD, {"lr": 0.1}),
        stages=(0,),
        module=model,
    )
    for k, v in model.named_buffers():
        assert torch.equal(v, before[k]), k
