"""Frozen parameters mixed with trainable ones, even inside one unit, at every stage."""

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.func import functional_call

import fzero
from fzero._core._tree import tree_flatten
from tests.engine.test_units import make_case
from tests.support import counting, run

# layers.0 mixes a frozen weight with a trainable bias; scale (root) is frozen too.
FROZEN = ["layers.0.weight", "scale"]


def reference(case: dict) -> dict[str, torch.Tensor]:
    """torch.optim.Adam over the trainable parameters of a plain copy of the module."""
    model = copy.deepcopy(case["model"])
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    opt = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, foreach=False
    )
    for t in range(case["xs"].shape[0]):
        opt.zero_grad()
        ((model(case["xs"][t]) - case["ys"][t]) ** 2).mean().backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # fzero's unused-parameter semantics
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train(mesh: fzero.Mesh, case: dict, stage: int, how: str, hooked: bool) -> Any:
    model = case["model"]
    if how == "requires_grad":  # dict(model.named_parameters()) after freezing some
        params = {
            k: v.detach().clone().requires_grad_(k not in FROZEN)
            for k, v in model.named_parameters()
        }
        frozen = None
    else:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        frozen = FROZEN if how == "prefixes" else {k: k in FROZEN for k in params}

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    opt = fzero.optim.adam(lr=0.05)
    units = [f"layers.{i}" for i in range(len(model.layers))]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, frozen=frozen)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model if hooked else None)
    # elements this rank reduce-scatters or all-reduces
    with counting(
        ("reduce_scatter_mean", "reduce_scatter_async", "all_reduce_mean", "all_reduce_async")
    ) as reduced:
        for t in range(case["xs"].shape[0]):
            sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
            state, _ = step(state, (case["xs"][t, sl], case["ys"][t, sl]))
    opt_elems = sum(
        x.numel()
        for x in tree_flatten(state.opt_state)[0]
        if isinstance(x, torch.Tensor) and x.dim()
    )
    return fzero.gather_params(state.params, mesh), opt_elems, sum(reduced), state.layout


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["requires_grad", "prefixes", "mask"])
def test_frozen_parameters_stay_bitwise_and_the_rest_trains_like_torch(
    stage: int, how: str
) -> None:
    case = make_case([3, 4, 4, 2], 2, seed=9)
    expected = reference(case)
    initial = {k: v.detach() for k, v in case["model"].named_parameters()}
    psi = sum(v.numel() for v in initial.values())
    frozen_numel = sum(initial[k].numel() for k in FROZEN)
    for params, opt_elems, reduced, layout in run(2, train, case, stage, how, stage >= 2):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
        for name in FROZEN:
            assert torch.equal(params[name], initial[name]), f"{name} moved"
        # No optimizer state for frozen parameters (Adam: two moments per element) ...
        trainable = psi - frozen_numel
        owned = (
            trainable if stage == 0 else sum(b.shard_numel for b in layout.buckets if not b.frozen)
        )
        assert opt_elems == 2 * owned
        # ... and no gradient communication: every reduction covers trainable buckets only.
        per_step = sum(b.full_numel for b in layout.buckets if not b.frozen)
        assert reduced <= case["xs"].shape[0] * per_step
        assert frozen_numel > 0 and all(
            b.frozen
            for b in layout.buckets
            if b.unit == "" and any(s.path == "scale" for s in b.slots)
        )


@pytest.mark.multiprocess
def test_frozen_must_name_parameters() -> None:
    case = make_case([3, 2], 1, seed=1)
    params = {k: v.detach() for k, v in case["model"].named_parameters()}

    def fn(mesh: fzero.Mesh, frozen: Any) -> None:
        fzero.shard_state(params, fzero.optim.sgd(), mesh, stage=1, frozen=frozen)

    with pytest.raises(ValueError, match="matches no parameter"):
        run(1, fn, ["nope"])
    with pytest.raises(ValueError, match="pytree of bools"):
        run(1, fn, {"layers.0.weight": True})


def _module_freezes(mesh: fzero.Mesh, keep_flag: bool) -> list[str]:
    """The model freezes `FROZEN`; the state's leaves are copies that drop the flag (the
    quickstart's `v.detach().clone()`), or keep it."""
    case = make_case([3, 4, 4, 2], 2, seed=9)
    model = case["model"]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    params = {
        k: v.detach().clone().requires_grad_(v.requires_grad and keep_flag)
        for k, v in model.named_parameters()
    }
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=2)
    step = fzero.sharded_step(
        lambda p, b: ((functional_call(model, p, (b[0],)) - b[1]) ** 2).mean(),
        opt, mesh, stage=2, module=model,
    )  # fmt: skip
    sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for t in range(2):
            state, _ = step(state, (case["xs"][t, sl], case["ys"][t, sl]))
    return [str(w.message) for w in seen if "module= freezes" in str(w.message)]


@pytest.mark.multiprocess
def test_a_tree_that_dropped_the_modules_frozen_flags_is_named_once() -> None:
    """Whisper freezes its encoder's sinusoidal positions; a params tree made by
    `v.detach().clone()` trained them without a word (found by a random run over Hugging
    Face architectures, against torch.optim over the model's trainable parameters)."""
    for said in run(2, _module_freezes, False):
        assert len(said) == 1, said
        assert "['layers.0.weight', 'scale']" in said[0] and "frozen=" in said[0]
    assert run(2, _module_freezes, True) == [[], []]  # the flags kept: frozen, nothing said


def _gathered_in_bf16(mesh: fzero.Mesh, stage: int, xs: torch.Tensor, ys: torch.Tensor) -> Any:
    """float64 leaves, `frozen=["base"]`, gathered in bfloat16 (FairScale's
    `broadcast_fp16`): the parameters after two steps, masters included, and the frozen
    weight as the loss saw it."""
    opt = fzero.optim.adam(lr=0.01)
    prec = fzero.Precision(gather_dtype=torch.bfloat16)
    state = fzero.shard_state(GATHER_CASE, opt, mesh, stage=stage, frozen=["base"], precision=prec)
    seen = []

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        seen.append(p["base"].detach().clone())
        return ((torch.tanh(batch[0] @ p["base"]) @ p["head"] - batch[1]) ** 2).mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    for t in range(xs.shape[0]):
        sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
        state, _ = step(state, (xs[t, sl], ys[t, sl]))
    return fzero.master_params(state, mesh), seen[-1]


GATHER_CASE = {
    "base": torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
    "head": torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4)),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_leaf_is_not_rounded_through_the_gather_dtype_it_never_travels_in(
    stage: int,
) -> None:
    """Stages 1-2 gather trainable leaves in `gather_dtype` after each update; a frozen one
    is never gathered there and keeps its values bitwise (it was rounded to bfloat16 for
    good, found by a second reader). Stage 3 gathers every unit for its forward: the loss
    sees the frozen leaf rounded, the state keeps it exact. Against torch.optim.Adam on
    one process, its forward on the parameters as each stage's gathers deliver them."""
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(2, 4, 4, dtype=torch.float64, generator=gen)
    ys = torch.randn(2, 4, 2, dtype=torch.float64, generator=gen)

    def rounded(x: torch.Tensor, yes: bool) -> torch.Tensor:
        return x.to(torch.bfloat16).to(x.dtype) if yes else x

    base = GATHER_CASE["base"].clone()
    head = GATHER_CASE["head"].clone().requires_grad_()
    opt = torch.optim.Adam([head], lr=0.01, foreach=False)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        used = rounded(head.detach(), stage > 0).requires_grad_()
        out = torch.tanh(xs[t] @ rounded(base, stage == 3)) @ used
        ((out - ys[t]) ** 2).mean().backward()
        head.grad = used.grad
        opt.step()
    for params, seen in run(2, _gathered_in_bf16, stage, xs, ys):
        assert torch.equal(params["base"], GATHER_CASE["base"])
        assert torch.equal(seen, rounded(GATHER_CASE["base"], stage == 3))
        assert not torch.equal(params["head"], GATHER_CASE["head"])  # trained
        torch.testing.assert_close(params["head"], head.detach(), rtol=1e-10, atol=1e-12)


def _flag_changed_after(mesh: fzero.Mesh, stage: int, path: str, freeze: bool, how: str) -> Any:
    """Two steps with `module=`; then `path`'s requires_grad flipped (on every rank, on
    rank 1 only, or where the state disagreed with the module from the start: `how`)
    and the third step. Returns what it raised, and the parameters after the third step
    is made again on every rank with the flag put back."""
    case = make_case([3, 4, 4, 2], 2, seed=9)
    model = case["model"]
    model.get_parameter(path).requires_grad_(freeze)  # trainable until frozen, or frozen
    params = {
        k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in model.named_parameters()
    }
    if how == "agree":  # the state says the opposite of the module, which then agrees
        params[path].requires_grad_(not freeze)
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage)
    step = fzero.sharded_step(
        lambda p, b: ((functional_call(model, p, (b[0],)) - b[1]) ** 2).mean(),
        opt, mesh, stage=stage, module=model,
    )  # fmt: skip
    sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the case's unused layer, said
        for t in range(2):
            state, _ = step(state, (case["xs"][t, sl], case["ys"][t, sl]))
    if how != "one" or mesh.rank == 1:
        model.get_parameter(path).requires_grad_(not freeze)
    said = "no error"
    try:
        state, _ = step(state, (case["xs"][2, sl], case["ys"][2, sl]))
    except ValueError as exc:
        said = str(exc)
        model.get_parameter(path).requires_grad_(freeze)
        state, _ = step(state, (case["xs"][2, sl], case["ys"][2, sl]))
    return said, fzero.master_params(state, mesh)


def _flag_reference(path: str, trained: bool) -> dict[str, torch.Tensor]:
    """torch.optim.Adam over the module's trainable parameters, `path` among them or not,
    three steps on the whole batch (an unused parameter's gradient: zero, as fzero's)."""
    case = make_case([3, 4, 4, 2], 2, seed=9)
    model = copy.deepcopy(case["model"])
    model.get_parameter(path).requires_grad_(trained)
    opt = torch.optim.Adam(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, foreach=False
    )
    for t in range(3):
        opt.zero_grad()
        ((model(case["xs"][t]) - case["ys"][t]) ** 2).mean().backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.parametrize("how", ["all", "one"])
def test_a_parameter_frozen_or_unfrozen_after_the_first_step_is_refused(
    stage: int, freeze: bool, how: str
) -> None:
    """torch.optim stops training a parameter once `requires_grad_(False)` (its grad stays
    None) and trains one unfrozen; the state's frozen leaves are fixed, so a flip after the
    first step trained on (or stayed frozen) without a word (found by a second reader).
    Every rank raises alike, even where one rank flipped (its peers learn it with the
    step's call check), and with the flag put back the job trains on like torch.optim."""
    path = "layers.2.weight"
    want = _flag_reference(path, trained=freeze)
    for said, params in run(2, _flag_changed_after, stage, path, freeze, how):
        assert f"rank {1 if how == 'one' else 0}: module='s parameter '{path}'" in said, said
        assert ("was frozen" if freeze else "was unfrozen") in said, said
        for k, v in want.items():
            torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12, msg=k)


@pytest.mark.multiprocess
@pytest.mark.parametrize("freeze", [True, False])
def test_a_flip_that_makes_the_module_agree_with_the_state_is_no_error(freeze: bool) -> None:
    """The state was made disagreeing with the module (`frozen=`, or a tree that dropped
    the flag, which the first step warns of); a flip that makes them agree changes
    nothing the state trains: it is no error (a reader of this stop's diff)."""
    path = "layers.2.weight"
    want = _flag_reference(path, trained=not freeze)
    for said, params in run(2, _flag_changed_after, 0, path, freeze, "agree"):
        assert said == "no error", said
        for k, v in want.items():
            torch.testing.assert_close(params[k], v, rtol=1e-10, atol=1e-12, msg=k)
