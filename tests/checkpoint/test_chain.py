"""A clipped optimizer (`chain(clip_by_global_norm, adamw)`) in and out of torch.optim's
format: torch keeps clipping outside the optimizer, so its state is AdamW's alone.

Before, `export_torch`/`export_dcp` refused a chain's state ("this state is a tuple") and
`import_torch`/`import_dcp` could not map torch's state to it: every job that clips could
not move to or from FSDP2 with its optimizer state (found by a random run of exports).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import errors_on_every_rank, run

F64 = torch.float64
HYPER = {"lr": 0.05, "weight_decay": 0.1}
CLIP = 0.05  # below the gradients' norm: every step clips
STEPS, WORLD = 3, 2
pytestmark = pytest.mark.multiprocess


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(STEPS, 4 * WORLD, 5, generator=gen, dtype=F64),
        torch.randn(STEPS, 4 * WORLD, 3, generator=gen, dtype=F64),
    )


def torch_steps(
    net: nn.Module, opt: torch.optim.Optimizer, steps: range, kind: str = "adamw"
) -> None:
    """torch.optim.AdamW on one process over the whole batch, clipping first."""
    x, y = data()
    for k in steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[k]), y[k]).backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        assert norm > CLIP  # the test means something only if the clip bites
        if kind == "nested":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 10 * CLIP)
        opt.step()


def reference(kind: str = "adamw") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    net = model()
    start = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = torch.optim.AdamW(net.parameters(), **HYPER, foreach=False)
    torch_steps(net, opt, range(STEPS), kind)
    return start, {k: v.detach() for k, v in net.named_parameters()}


def clipped(kind: str = "adamw") -> fzero.optim.Optimizer:
    """The clipped optimizer: fzero's AdamW, torch's through `from_torch`, or a chain inside
    a chain (a clip, then a chain of a looser clip and AdamW)."""
    clip = fzero.optim.clip_by_global_norm(CLIP)
    if kind == "from_torch":
        return fzero.optim.chain(clip, fzero.optim.from_torch(torch.optim.AdamW, **HYPER))
    if kind == "nested":
        inner = fzero.optim.chain(
            fzero.optim.clip_by_global_norm(10 * CLIP), fzero.optim.adamw(**HYPER)
        )
        return fzero.optim.chain(clip, inner)
    return fzero.optim.chain(clip, fzero.optim.adamw(**HYPER))


KINDS = ["adamw", "from_torch", "nested"]
LAYOUT = {"from_torch": "tensor"}  # torch's optimizer steps whole tensors


def fzero_steps(mesh: fzero.Mesh, state: Any, stage: int, steps: range, kind: str) -> Any:
    net, (x, y) = model(), data()
    step = fzero.sharded_step(
        lambda p, b: torch.nn.functional.mse_loss(functional_call(net, p, (b[0],)), b[1]),
        clipped(kind), mesh, stage=stage,
    )  # fmt: skip
    per = x.shape[1] // mesh.size
    for k in steps:
        lo, hi = mesh.rank * per, (mesh.rank + 1) * per
        state, _ = step(state, (x[k, lo:hi], y[k, lo:hi]))
    return state


def export_then_torch(mesh: fzero.Mesh, stage: int, kind: str, path: str) -> Any:
    """fzero trains two steps clipped and exports; torch resumes for the third."""
    params = {k: v.detach().clone() for k, v in model().named_parameters()}
    layout = LAYOUT.get(kind, "flat")
    state = fzero.shard_state(params, clipped(kind), mesh, stage=stage, layout=layout)
    state = fzero_steps(mesh, state, stage, range(STEPS - 1), kind)
    hyper = torch.optim.AdamW([torch.zeros(1)], **HYPER, foreach=False).defaults
    fzero.checkpoint.export_torch(state, path, mesh, hyperparams=hyper)
    if mesh.rank != 0:
        return None
    saved = torch.load(path, weights_only=True)
    net = model()
    net.load_state_dict(saved["model"])
    opt = torch.optim.AdamW(net.parameters(), **HYPER, foreach=False)
    opt.load_state_dict(saved["optimizer"])
    torch_steps(net, opt, range(STEPS - 1, STEPS))
    return {k: v.detach() for k, v in net.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_clipped_fzero_run_resumes_in_torch_as_one_process(
    stage: int, kind: str, tmp_path: Path
) -> None:
    start, want = reference(kind)
    got = run(WORLD, export_then_torch, stage, kind, str(tmp_path / "ckpt.pt"))[0]
    fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert all(not torch.equal(got[k], start[k]) for k in want)


def torch_then_import(mesh: fzero.Mesh, stage: int, kind: str) -> Any:
    """torch trains two steps clipped; fzero imports its state dicts, resumes clipped."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), **HYPER, foreach=False)
    torch_steps(net, opt, range(STEPS - 1), kind)
    state = fzero.checkpoint.import_torch(
        dict(net.state_dict()), opt.state_dict(), clipped(kind), mesh, stage=stage,
        layout=LAYOUT.get(kind, "flat"),
    )  # fmt: skip
    assert state.step == STEPS - 1
    state = fzero_steps(mesh, state, stage, range(STEPS - 1, STEPS), kind)
    return dict(fzero.gather_params(state.params, mesh))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", [1, 3])
def test_a_clipped_torch_run_resumes_in_fzero_as_one_process(stage: int, kind: str) -> None:
    start, want = reference(kind)
    for got in run(WORLD, torch_then_import, stage, kind):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


class Averaged(NamedTuple):
    mean: Any  # a per-parameter running mean of the gradients


def averaging() -> fzero.optim.GradientTransformation:
    def init(params: Any) -> Averaged:
        return Averaged({k: torch.zeros_like(v) for k, v in params.items()})

    def update(grads: Any, state: Averaged, params: Any) -> tuple[Any, Averaged]:
        return grads, Averaged({k: 0.9 * state.mean[k] + g for k, g in grads.items()})

    return fzero.optim.GradientTransformation(init, update)


def export_averaged(mesh: fzero.Mesh) -> None:
    params = {k: v.detach().clone() for k, v in model().named_parameters()}
    opt = fzero.optim.chain(averaging(), fzero.optim.adamw(**HYPER))
    state = fzero.shard_state(params, opt, mesh, stage=0)
    fzero.checkpoint.export_torch(state, None, mesh)


def test_a_transformation_with_per_parameter_state_is_refused_naming_it() -> None:
    for message in errors_on_every_rank(WORLD, export_averaged):
        assert "per-parameter state (Averaged)" in message, message
        assert "fzero.checkpoint.save" in message
