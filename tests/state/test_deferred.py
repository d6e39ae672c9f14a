"""fzero.init.deferred: any construction recorded and replayed, bitwise the eager one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import differences, errors_on_every_rank, run, state_values
from tests.support import module_values as values

F64 = torch.float64


class Leaf(nn.Module):
    """Initializes in `__init__` only: a raw draw, a layer, a computed buffer, a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3))
        self.lin = nn.Linear(3, 4)
        self.register_buffer("pos", torch.arange(10.0).sin(), persistent=False)
        self.scale = torch.tensor([2.0, 3.0])  # a plain attribute, made for real


class Tricky(nn.Module):
    """A parent re-initializing its children, in part and through `.data`, from views and
    from other tensors; layers without `reset_parameters`; draws with tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Leaf(), Leaf()
        self.emb = nn.Embedding(7, 3)
        self.mha = nn.MultiheadAttention(6, 2, batch_first=True)
        self.out = nn.Linear(6, 6)
        with torch.no_grad():
            self.a.lin.weight[:, :2].zero_()
            self.b.w.data.mul_(0.5)
            nn.init.orthogonal_(self.out.weight)
            self.b.lin.weight.copy_(self.a.lin.weight * 2 + 1)
            self.gate = nn.Parameter(torch.rand(4).bernoulli())
        self.register_buffer("perm", torch.randperm(9))
        self.post_init()

    def post_init(self) -> None:  # as Hugging Face's: every Linear drawn again
        for m in self.modules():
            if isinstance(m, nn.Linear) and m is not self.b.lin:
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = self.a.lin(h @ self.a.w.T[:3, :3]) + self.b.lin(h) * self.a.pos[: h.shape[1], None]
        h = torch.cat([h, h[..., :2]], -1)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.out(h)


class Truncated(nn.Module):
    """trunc_normal_ draws until every value is inside its bounds: the number of draws
    depends on the values, which ties a recording to its seed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(40, 3))
        nn.init.trunc_normal_(self.w, std=1.0, a=-0.5, b=0.5)


def eager(cls: type[nn.Module], seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        return cls()
    finally:
        torch.set_default_dtype(before)


def first_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    return next(iter(differences(got, want)), None)


UNITS = ["a", "b", "emb", "mha", "out"]


@pytest.mark.slow
@pytest.mark.multiprocess
@given(
    world=st.integers(1, 4),
    units=st.lists(st.sampled_from(UNITS), unique=True),
    recorded_seed=st.integers(0, 9),
    seed=st.integers(0, 9),
    dtype=st.sampled_from([torch.float32, F64]),
)
def test_deferred_is_bitwise_eager_construction(
    world: int, units: list[str], recorded_seed: int, seed: int, dtype: torch.dtype
) -> None:
    want = values(eager(Tricky, seed, dtype))
    torch.set_default_dtype(dtype)
    try:  # recorded here, replayed by the (forked) ranks
        model = fzero.init.deferred(Tricky, seed=recorded_seed)
    finally:
        torch.set_default_dtype(torch.float32)
    assert all(t.device.type == "meta" for t in values(model).values())

    def fn(mesh: fzero.Mesh) -> list[Any]:
        out = []
        for stage in range(4):
            for layout in ("flat", "tensor"):
                state = fzero.shard_state(
                    dict(model.named_parameters()),
                    fzero.optim.sgd(1e-3),
                    mesh,
                    stage=stage,
                    layout=layout,
                    units=units,
                    buffers=dict(model.named_buffers()),
                    init=fzero.init.from_module(model, seed=seed),
                )
                out.append(first_difference(state_values(state, mesh), want))
        return out

    for result in run(world, fn):
        assert result == [None] * 8


def test_deferred_leaves_the_callers_generator_alone() -> None:
    want = values(eager(Tricky, 3))

    def fn(mesh: fzero.Mesh) -> tuple[bool, str | None]:
        torch.manual_seed(7)
        before = torch.random.get_rng_state()
        model = fzero.init.deferred(Tricky, seed=1)
        state = fzero.shard_state(
            dict(model.named_parameters()), fzero.optim.sgd(1e-2), mesh, stage=0,
            buffers=dict(model.named_buffers()), init=fzero.init.from_module(model, seed=3),
        )  # fmt: skip
        same = torch.equal(torch.random.get_rng_state(), before)
        return same, first_difference(state_values(state, mesh), want)

    assert run(1, fn) == [(True, None)]


def test_a_recording_that_read_random_values_holds_for_its_seed_only() -> None:
    want = eager(Truncated, 4).w.detach()
    assert want.abs().max() <= 0.5

    def fn(mesh: fzero.Mesh) -> tuple[bool, str]:
        model = fzero.init.deferred(Truncated, seed=4)
        params, sgd = dict(model.named_parameters()), fzero.optim.sgd()
        init = fzero.init.from_module(model)
        state = fzero.shard_state(params, sgd, mesh, stage=0, init=init)
        try:
            fzero.shard_state(
                params, sgd, mesh, stage=0, init=fzero.init.from_module(model, seed=5)
            )
        except ValueError as exc:
            return torch.equal(state.params["w"], want), str(exc)
        return torch.equal(state.params["w"], want), "no error"

    [(same, msg)] = run(1, fn)
    assert same and "recorded with seed 4 and depends on it" in msg


class Unwritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.bias2 = nn.Parameter(torch.empty(3))  # never filled: eager holds garbage


def test_a_leaf_the_construction_leaves_unwritten_fails_on_every_rank() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        model = fzero.init.deferred(Unwritten)
        fzero.shard_state(
            dict(model.named_parameters()),
            fzero.optim.sgd(),
            mesh,
            stage=3,
            init=fzero.init.from_module(model),
        )

    for msg in errors_on_every_rank(2, fn):
        assert "'bias2'" in msg and "unwritten" in msg


def test_module_with_a_buffer_left_on_meta_fails_at_the_first_step_naming_it() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        model = fzero.init.deferred(Tricky)
        opt = fzero.optim.sgd(0.1)
        state = fzero.shard_state(  # buffers= forgotten: the module's stay on meta
            dict(model.named_parameters()), opt, mesh, stage=3, units=UNITS,
            init=fzero.init.from_module(model),
        )  # fmt: skip

        def loss_fn(params: Any, batch: torch.Tensor) -> torch.Tensor:
            return functional_call(model, params, (batch,)).square().mean()

        step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model)
        step(state, torch.zeros(2, 3, dtype=torch.long))

    for msg in errors_on_every_rank(2, fn):
        assert "buffer 'perm' on the meta device" in msg and "(3 such buffers)" in msg
        assert "buffers=dict(model.named_buffers())" in msg


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "stage"), [(2, 3), (3, 2)])
def test_training_from_a_deferred_model_matches_torch_optim(world: int, stage: int) -> None:
    steps, per_rank = 3, 2
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(7, (steps, world * per_rank, 3), generator=gen)
    target = torch.randn(steps, world * per_rank, 3, 6, generator=gen, dtype=F64)
    model = eager(Tricky, 5, F64)
    start = values(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(steps):
        loss = F.mse_loss(model(data[k]), target[k])
        opt.zero_grad()
        loss.backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}

    def fn(mesh: fzero.Mesh) -> Any:
        torch.set_default_dtype(F64)
        m = fzero.init.deferred(Tricky, seed=5)
        torch.set_default_dtype(torch.float32)
        sgd = fzero.optim.sgd(0.1, momentum=0.9)
        state = fzero.shard_state(
            dict(m.named_parameters()), sgd, mesh, stage=stage, units=UNITS,
            buffers=dict(m.named_buffers()), init=fzero.init.from_module(m),
        )  # fmt: skip
        lo, hi = mesh.rank * per_rank, (mesh.rank + 1) * per_rank

        def loss_fn(params: Any, bufs: Any, batch: Any) -> Any:
            x, y = batch
            return F.mse_loss(functional_call(m, (params, bufs), (x,)), y), bufs

        step = fzero.sharded_step(loss_fn, sgd, mesh, stage=stage, module=m)
        for k in range(steps):
            state, _ = step(state, (data[k, lo:hi], target[k, lo:hi]))
        params = fzero.gather_params(state.params, mesh) if stage == 3 else state.params
        return {k: v.detach().clone() for k, v in params.items()}

    for got in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert any(not torch.equal(got[k], start[k]) for k in want)  # training moved them


class OnCuda(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, device="cuda"))


def test_a_construction_drawing_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="draws random numbers on cuda"):
        fzero.init.deferred(OnCuda)


class Norm(nn.Module):
    """Hugging Face's RMSNorm: a weight and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class WithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.pre, self.head = Norm(), nn.Linear(4, 4), nn.Linear(4, 3)


def test_missing_on_a_meta_model_replays_only_what_the_file_lacks(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    pretrained = {"norm.weight": torch.randn(4), "pre.weight": torch.randn(4, 4)}
    pretrained["pre.bias"] = torch.randn(4)
    save_file(pretrained, tmp_path / "m.safetensors")  # no head

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = WithHead()  # Norm has no reset_parameters: it must not be asked for
        init = fzero.init.from_file(
            tmp_path / "m.safetensors", missing=fzero.init.from_module(model, seed=3)
        )
        state = fzero.shard_state(dict(model.named_parameters()), fzero.optim.sgd(), mesh,
                                  stage=3, init=init)  # fmt: skip
        return state_values(state, mesh)

    [got] = run(1, fn)
    assert all(torch.equal(got[k], v) for k, v in pretrained.items())
    torch.manual_seed(3)
    head = WithHead().head  # drawn after pre's draws, which the replay made on scratch
    assert torch.equal(got["head.weight"], head.weight.detach())
    assert torch.equal(got["head.bias"], head.bias.detach())


class Reshaped(nn.Module):
    """In-place ops that change a tensor's shape or strides, and factories without a
    dtype under a default dtype that the construction changes as it goes."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(3, 3)
        w.t_()
        self.w = nn.Parameter(w)
        b = torch.arange(4.0)
        b.unsqueeze_(0)
        self.register_buffer("b", b)
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        self.d = nn.Parameter(torch.ones(2) + torch.rand(2))  # made in float64
        torch.set_default_dtype(before)
        self.f = nn.Parameter(torch.rand(3))  # float32 again


def test_replay_follows_in_place_reshapes_and_the_default_dtype_as_it_changed() -> None:
    want = values(eager(Reshaped, 6))

    def fn(mesh: fzero.Mesh) -> str | None:
        model = fzero.init.deferred(Reshaped, seed=6)
        state = fzero.shard_state(
            dict(model.named_parameters()), fzero.optim.sgd(), mesh, stage=0,
            buffers=dict(model.named_buffers()), init=fzero.init.from_module(model, seed=6),
        )  # fmt: skip
        return first_difference(state_values(state, mesh), want)

    assert run(1, fn) == [None]
    assert want["d"].dtype == F64 and want["b"].shape == (1, 4)


def test_a_module_converted_while_recorded_is_refused_naming_the_way_that_works() -> None:
    """torch cannot convert a module built on fake tensors (`_apply(): Couldn't swap`,
    naming neither cause nor cure); the deferred model converted afterwards makes the
    eager conversion's values, bitwise."""
    with pytest.raises(RuntimeError, match=r"converts a module .* Convert the model deferred"):
        fzero.init.deferred(lambda: Reshaped().to(torch.bfloat16))
    want = values(eager(Reshaped, 6).to(torch.bfloat16))

    def fn(mesh: fzero.Mesh) -> str | None:
        model = fzero.init.deferred(Reshaped, seed=6)
        # Rank 1 as torch's `overwrite_module_params_on_conversion` has it: new Parameters.
        torch.__future__.set_overwrite_module_params_on_conversion(mesh.rank == 1)
        try:
            model = model.to(torch.bfloat16)
        finally:  # as torch has it by default
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        state = fzero.shard_state(
            dict(model.named_parameters()), fzero.optim.sgd(), mesh, stage=3,
            buffers=dict(model.named_buffers()), init=fzero.init.from_module(model, seed=6),
        )  # fmt: skip
        return first_difference(state_values(state, mesh), want)

    assert run(2, fn) == [None, None]
    assert want["w"].dtype == torch.bfloat16


def test_a_deferred_leaf_replaced_or_materialized_since_is_not_replayed() -> None:
    """A new meta tensor of the recorded dtype put in a leaf's place is another tensor,
    not a conversion (it has no recorded values); a model materialized since (to_empty)
    says so rather than that its parameters are not its own."""
    replaced = fzero.init.deferred(Reshaped, seed=6)
    replaced.w = nn.Parameter(torch.empty(3, 3, device="meta"))
    materialized = fzero.init.deferred(Reshaped, seed=6).to_empty(device="cpu")

    def fn(mesh: fzero.Mesh) -> list[str]:
        out = []
        for model in (replaced, materialized):
            try:
                fzero.shard_state(
                    dict(model.named_parameters()), fzero.optim.sgd(), mesh, stage=0,
                    init=fzero.init.from_module(model, seed=6),
                )  # fmt: skip
            except ValueError as exc:
                out.append(str(exc))
        return out

    (said,) = run(1, fn)
    assert "no recorded parameter or buffer 'w'" in said[0], said
    # The usual cause (resize_token_embeddings after deferred), and its remedy.
    assert "changed after deferred returned it" in said[0], said
    assert "inside the function given to deferred" in said[0], said
    assert "no longer the meta tensor fzero.init.deferred made" in said[1], said
