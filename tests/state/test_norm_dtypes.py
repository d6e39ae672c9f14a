"""Norm layers under mixed precision: a BatchNorm whose weight `Precision.param_dtype`
casts away from its running statistics is named on every rank (torch's batch_norm refuses
the pair, naming neither); the norms kept in float32 beside a bfloat16 model train like
one process doing the same casts, bitwise."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import differences, errors_on_every_rank, run

BF16 = torch.bfloat16


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    )


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4 * n, 2, 4, 4, generator=g), torch.randn(4 * n, 3, generator=g))
        for _ in range(3)
    ]


def refused(mesh: fzero.Mesh, stage: int, held: bool, how: str) -> None:
    """A bfloat16 Precision over a float32 model whose BatchNorm statistics stay float32,
    the statistics the module's own or `held` in the state, stepped (eagerly or compiled)
    or run forward."""
    m = model()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    buffers = {k: v.clone() for k, v in m.named_buffers()} if held else None
    opt = fzero.optim.adamw(lr=0.01)
    prec = fzero.Precision(param_dtype=BF16)
    state = fzero.shard_state(params, opt, mesh, stage=stage, precision=prec, buffers=buffers)

    def loss_fn(p: dict, *rest: Any) -> Any:
        b, (x, y) = (rest[0], rest[1]) if held else ({}, rest[0])
        loss = ((functional_call(m, {**p, **b}, (x,)).float() - y) ** 2).mean()
        return (loss, b) if held else loss

    x, y = data(1)[0]
    if how == "forward":
        fzero.sharded_forward(lambda p, x: functional_call(m, p, (x,)), mesh, module=m)(state, x)
    compile = "aot_eager" if how == "compiled" else False
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=m, compile=compile)
    step(state, (x, y))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "stage, held, how",
    [(0, False, "eager"), (3, False, "eager"), (3, True, "eager"), (3, False, "forward")],
)
def test_a_norm_cast_away_from_its_statistics_is_named_on_every_rank(
    stage: int, held: bool, how: str
) -> None:
    for said in errors_on_every_rank(2, lambda mesh: refused(mesh, stage, held, how)):
        assert said.startswith("ValueError: rank ") and "BatchNorm2d '1'" in said, said
        assert "expected scalar type" in said  # torch's own words, kept
        remedy = "buffer_dtype=torch.bfloat16)" if held else "the norm's own .to(torch.bfloat16)"
        assert remedy in said and "Precision(master_dtype=torch.float32)" in said, said


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_compiled_step_names_the_norm_too() -> None:
    # The graph calls batch norm's operator; no torch.nn.functional frame is on the stack.
    for said in errors_on_every_rank(2, lambda mesh: refused(mesh, 3, False, "compiled")):
        assert said.startswith("ValueError: rank ") and "BatchNorm2d '1'" in said, said


def mixed(m: nn.Module) -> nn.Module:
    """The remedy: the model in bfloat16, its norm layers in float32."""
    m.to(BF16)
    m[1].float()
    return m


def reference(n: int) -> dict[str, torch.Tensor]:
    """One process: float32 masters under torch.optim.AdamW; each step casts them to the
    model's dtypes, and the gradient is the mean of `n` ranks' (each rank's BatchNorm
    with its own statistics), summed in each leaf's dtype."""
    m = mixed(model())
    dtypes = {k: v.dtype for k, v in m.named_parameters()}
    masters = {k: v.detach().float().clone().requires_grad_() for k, v in m.named_parameters()}
    opt = torch.optim.AdamW(masters.values(), lr=0.01, foreach=False)
    ranks = [{k: v.clone() for k, v in m.named_buffers()} for _ in range(n)]
    for x, y in data(n):
        grads = {k: torch.zeros_like(v, dtype=dtypes[k]) for k, v in masters.items()}
        for r, (xr, yr) in enumerate(zip(x.chunk(n), y.chunk(n))):
            cast = {k: v.detach().to(dtypes[k]).requires_grad_() for k, v in masters.items()}
            out = functional_call(m, {**cast, **ranks[r]}, (xr.to(BF16),))
            loss = ((out.float() - yr) ** 2).mean()
            for k, g in zip(cast, torch.autograd.grad(loss, list(cast.values()))):
                grads[k] += g
        for k, v in masters.items():
            v.grad = (grads[k] / n).float()
        opt.step()
    return {k: v.detach() for k, v in masters.items()}


def train_mixed(mesh: fzero.Mesh, stage: int) -> dict[str, torch.Tensor]:
    m = mixed(model())
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    opt = fzero.optim.adamw(lr=0.01)
    prec = fzero.Precision(master_dtype=torch.float32)
    units = [("0", "1"), "4"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, precision=prec, units=units)

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        return ((functional_call(m, p, (batch[0].to(BF16),)).float() - batch[1]) ** 2).mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=m)
    for x, y in data(mesh.size):
        rows = slice(4 * mesh.rank, 4 * mesh.rank + 4)
        state, _ = step(state, (x[rows], y[rows]))
    assert m[1].running_mean.dtype == torch.float32  # the statistics stayed float32
    return fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_norms_kept_float32_in_a_bfloat16_model_train_like_one_process(stage: int) -> None:
    want = reference(2)
    start = {k: v.float() for k, v in mixed(model()).named_parameters()}
    assert all(not torch.allclose(want[k], start[k]) for k in want)  # every leaf moved
    for got in run(2, train_mixed, stage):  # bitwise, at two ranks
        assert differences(got, want) == []


class Misfit(nn.Module):
    """A batch norm over statistics of the wrong size: torch's shape error."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.zeros(3, dtype=x.dtype), torch.ones(3, dtype=x.dtype)
        return nn.functional.batch_norm(x, *stats, training=False)


def misfit(mesh: fzero.Mesh) -> str:
    m = nn.Sequential(nn.Linear(4, 4), Misfit(), nn.BatchNorm1d(4))
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(
        params, opt, mesh, stage=0, precision=fzero.Precision(param_dtype=BF16)
    )

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(m, p, (x.to(BF16),)).float().sum()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=0, module=m)
    try:
        step(state, torch.randn(5, 4))
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multiprocess
def test_another_error_inside_a_batch_norm_passes_as_torch_said_it() -> None:
    # Beside a norm cast away from its statistics ('2'), a shape error inside another
    # batch norm was told as that norm's dtypes.
    said = run(1, misfit)[0]
    assert said.startswith("RuntimeError: ") and "should contain 4 elements not 3" in said, said
