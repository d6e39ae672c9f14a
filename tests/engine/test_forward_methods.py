"""`fzero.register_forward_method`: a unit entered around a method other than forward (a
dual encoder's `encode`), against one process with torch.optim."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import run


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.mix = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) + self(x)  # its own forward inside, too


class DualEncoder(nn.Module):
    """CLIP's shape: the parent calls each tower's `encode`, never the tower itself."""

    def __init__(self) -> None:
        super().__init__()
        self.text, self.image, self.head = Encoder(), Encoder(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.text.encode(x) * self.image.encode(y))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    xs = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return [(x, y) for x, y in xs]


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DualEncoder().double()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
    for x, y in batches():
        opt.zero_grad()
        model(x, y).square().mean().backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train(mesh: fzero.Mesh, stage: int, register: bool, compile: Any = False) -> Any:
    torch.manual_seed(0)
    model = DualEncoder().double()
    if register:
        fzero.register_forward_method(model.text, "encode")
        fzero.register_forward_method(model.image, "encode")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["text", "image"])

    def loss_fn(p: dict, batch: Any) -> torch.Tensor:
        return functional_call(model, p, batch).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model, compile=compile)
    for x, y in batches():
        state, _ = step(state, (x.chunk(2)[mesh.rank], y.chunk(2)[mesh.rank]))
    forward = fzero.sharded_forward(lambda p, b: functional_call(model, p, b), mesh, module=model)
    out = forward(state, batches()[0])
    # Outside a step the method is the class's again: no instance attribute left over.
    left = [n for n in ("encode",) if n in vars(model.text) or n in vars(model.image)]
    return fzero.gather_params(state.params, mesh), out, left


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_registered_method_enters_its_unit_like_forward(stage: int) -> None:
    expected = reference()
    for params, out, left in run(2, train, stage, True):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
        assert out.shape == (4, 1) and not left


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_registered_method_compiles(stage: int) -> None:
    expected = reference()
    for params, _, _ in run(2, train, stage, True, "aot_eager"):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")


@pytest.mark.multiprocess
def test_an_unregistered_method_is_refused_naming_the_remedy() -> None:
    def catch(mesh: fzero.Mesh) -> str:
        try:
            train(mesh, 3, False)
        except (ValueError, fzero.PeerError) as exc:
            return str(exc)
        return "no error"

    for message in run(2, catch):
        assert "'text.proj.weight'" in message and "fzero.register_forward_method" in message


def test_bad_registrations_are_clear_errors() -> None:
    model = DualEncoder()
    with pytest.raises(ValueError, match="forward needs no registration"):
        fzero.register_forward_method(model.text, "forward")
    with pytest.raises(ValueError, match="'decode' is not a method of Encoder"):
        fzero.register_forward_method(model.text, "decode")


class Upcast(DualEncoder):
    """The parent hands each tower a float32 tensor (its own upcast of the input)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(self.text.encode(x.float()) * self.image.encode(y.float()))


def train_cast(mesh: fzero.Mesh) -> list[torch.dtype]:
    torch.manual_seed(0)
    model = Upcast()
    seen: list[torch.dtype] = []
    for tower in (model.text, model.image):
        fzero.register_forward_method(tower, "encode")
        tower.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.1)
    prec = fzero.Precision(param_dtype=torch.bfloat16)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=["text", "image"], precision=prec)

    def loss_fn(p: dict, batch: Any) -> torch.Tensor:
        return functional_call(model, p, batch).float().square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model)
    x, y = batches()[0]
    step(state, (x.float().chunk(2)[mesh.rank], y.float().chunk(2)[mesh.rank]))
    return seen


@pytest.mark.multiprocess
def test_a_registered_method_casts_its_inputs_as_a_forward() -> None:
    """Under Precision a registered method's floating-point inputs are cast to the
    compute dtype, as FSDP2's patched method casts them: a float32 tensor the parent
    makes reaches the tower's own forward (inside `encode`) in bfloat16."""
    for seen in run(2, train_cast):
        assert seen and set(seen) == {torch.bfloat16}
