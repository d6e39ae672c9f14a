"""A loss that writes one of its parameters in place is refused on every rank, naming it.

torch.optim on one process keeps such a write (`nn.Embedding(max_norm=...)` renormalizes
the rows a batch looks up); fzero's ranks cannot (a replica would keep only its own
batch's writes, a gathered copy drops them), so the write must fail loudly, not train
differently: without the check a frozen leaf's write was dropped at stage 3 and kept on
one rank at stages 0-2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import run

F64 = torch.float64


class Net(nn.Module):
    """An embedding that renormalizes its rows in its forward, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, max_norm=0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).sum(1)


def _setup(frozen: bool) -> tuple[Net, dict[str, torch.Tensor]]:
    model = Net().double()
    with torch.no_grad():
        model.emb.weight.mul_(3)  # every row above max_norm: a lookup writes it
    params = {
        k: v.detach().clone().requires_grad_(not (frozen and k == "emb.weight"))
        for k, v in model.named_parameters()
    }
    return model, params


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 10, (3, 5), generator=g), torch.randn(3, 2, dtype=F64, generator=g)


def _attempt(
    mesh: fzero.Mesh, stage: int, frozen: bool, how: str, writer: int | None, compile: Any = False
) -> str:
    """One step whose loss looks up the renormalizing embedding (on rank `writer` only, or
    on every rank); the rank's error as "Type: message"."""
    model, params = _setup(frozen)
    units = ["emb", "head"]

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        if writer is not None and mesh.rank != writer:
            model.emb.max_norm = None  # this rank's forward writes nothing
        if how == "gathered":
            p = {f"{u}.{k}": v for u in units for k, v in fzero.gathered(p, u).items()}
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    step = fzero.sharded_step(
        loss_fn,
        opt,
        mesh,
        stage=stage,
        module=model if how == "hooks" else None,
        just_in_time=how == "gathered",
        compile=compile,
    )
    try:
        step(state, _batch(mesh.rank))
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["upfront", "hooks", "gathered"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_parameter_written_in_place_is_refused_on_every_rank(stage: int, how: str) -> None:
    # Only rank 1 writes: rank 0's loss is clean and must still raise, the same error.
    said = run(2, _attempt, stage, True, how, 1)
    assert said[0] == said[1], said
    assert said[0].startswith(
        "ValueError: rank 1: the loss wrote the frozen parameter 'emb.weight'"
    )
    assert "in place" in said[0] and "max_norm" in said[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_trainable_parameter_written_in_place_is_named(stage: int) -> None:
    said = run(2, _attempt, stage, False, "hooks", None)
    for rank, message in enumerate(said):
        assert message.startswith(
            f"ValueError: rank {rank}: the loss wrote the trainable parameter 'emb.weight' in "
            "place (autograd: Output 0 of _Enter is a view"
        ), message


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_compiled_loss_writing_a_trainable_parameter_is_named_a_write() -> None:
    """Traced, the write is autograd's refusal as the graph runs: its words stay, not those
    of a tensor a module still holds from an earlier step (tests/engine/test_tied.py),
    which torch.compile meets while it traces."""
    for message in run(2, _attempt, 1, False, "upfront", None, "aot_eager"):
        assert "the loss wrote a trainable parameter in place" in message, message
        assert "earlier step" not in message, message


@pytest.mark.multiprocess
def test_a_trainable_write_on_one_rank_fails_every_rank() -> None:
    said = run(2, _attempt, 3, False, "upfront", 0)
    assert "rank 0: the loss wrote the trainable parameter 'emb.weight'" in said[0]
    # The peer raises the writer's error, as a PeerError (of ValueError).
    assert said[1].partition(": ")[2] == said[0].partition(": ")[2], said


def _forward(mesh: fzero.Mesh, stage: int) -> str:
    model, params = _setup(False)
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["emb", "head"])
    forward = fzero.sharded_forward(lambda p, x: functional_call(model, p, (x,)), mesh)
    try:
        forward(state, _batch(mesh.rank)[0])
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_without_gradients_refuses_a_write_too(stage: int) -> None:
    for rank, message in enumerate(run(2, _forward, stage)):
        assert message.startswith(f"rank {rank}: the loss wrote the parameter 'emb.weight'")


def _clean_after_refused(mesh: fzero.Mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """A refused step, then the same embedding without max_norm: the state trains on."""
    model, params = _setup(True)
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=["emb", "head"])
    before = fzero.gather_params(state.params, mesh)["head.weight"].clone()

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3)
    with pytest.raises(ValueError, match="in place"):
        step(state, _batch(mesh.rank))
    model.emb.max_norm = None
    state, _ = step(state, _batch(mesh.rank))
    return before, fzero.gather_params(state.params, mesh)["head.weight"]


@pytest.mark.multiprocess
def test_a_refused_frozen_write_leaves_a_stage_3_state_usable() -> None:
    # The gathered copy took the write, the state did not: the next step trains, against
    # torch.optim on one process over both ranks' batches.
    before, after = run(2, _clean_after_refused)[0]
    model, params = _setup(True)
    model.emb.max_norm = None
    trained = [v for k, v in params.items() if k != "emb.weight"]
    ref = torch.optim.AdamW(trained, lr=0.05)
    batches = [_batch(r) for r in range(2)]
    loss = sum(((functional_call(model, params, (x,)) - y) ** 2).mean() for x, y in batches) / 2
    loss.backward()
    ref.step()
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, params["head.weight"].detach(), rtol=1e-12, atol=1e-12)


def _under_inference_mode(mesh: fzero.Mesh, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    model, params = _setup(False)
    model.emb.max_norm = None
    opt = fzero.optim.adamw(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["emb", "head"])
    forward = fzero.sharded_forward(lambda p, x: functional_call(model, p, (x,)), mesh)
    x = _batch(0)[0]
    with torch.inference_mode():  # its tensors keep no version counter to watch
        return forward(state, x), model(x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_under_inference_mode_is_not_watched(stage: int) -> None:
    for got, want in run(2, _under_inference_mode, stage):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
