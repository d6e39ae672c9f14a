"""Global-norm clipping and weight-decay masks through chain, at every stage and layout."""

from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero._core._tree import leaf_paths, tree_flatten, tree_unflatten
from tests.support import Case, cases, mlp_loss, run

MAX_NORM = 0.05  # small enough that every step clips


def decays(path: str) -> bool:
    return path.endswith(".w")  # matrices decay; biases, the 0-d scale and the shift do not


def reference(case: Case, kind: str) -> tuple[Any, list[float]]:
    """torch.optim with param groups for the mask and clip_grad_norm_ before each step."""
    leaves, treedef = tree_flatten(case.params)
    paths = leaf_paths(case.params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    groups = [
        {"params": [t for t, p in zip(tensors, paths) if decays(p)]},
        {"params": [t for t, p in zip(tensors, paths) if not decays(p)], "weight_decay": 0.0},
    ]
    if kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.3, foreach=False)
    else:
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.3, foreach=False)
    norms = []
    for t in range(case.xs.shape[0]):
        opt.zero_grad()
        mlp_loss(tree_unflatten(treedef, tensors), (case.xs[t], case.ys[t])).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(tensors, MAX_NORM, foreach=False).item())
        opt.step()
    return tree_unflatten(treedef, [t.detach() for t in tensors]), norms


def train(mesh: fzero.Mesh, case: Case, kind: str, mask_as: str) -> tuple[Any, list[float]]:
    mask: Any = decays
    if mask_as == "tree":
        mask = tree_unflatten(
            tree_flatten(case.params)[1], [decays(p) for p in leaf_paths(case.params)]
        )
    if kind == "adamw":
        last = optim.adamw(lr=0.05, weight_decay=0.3, mask=mask)
    else:
        last = optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.3, mask=mask)
    opt = optim.chain(optim.clip_by_global_norm(MAX_NORM), last)
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, layout=case.layout)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=case.stage)
    norms = []
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
        norms.append(state.opt_state[0].norm.item())
    return fzero.gather_params(state.params, mesh), norms


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=16)
@given(
    cases(optimizers=st.just("adamw")),
    st.sampled_from(["adamw", "sgd"]),
    st.sampled_from(["predicate", "tree"]),
)
def test_clipping_uses_the_true_global_norm_and_masks_apply(
    case: Case, kind: str, mask_as: str
) -> None:
    expected, expected_norms = reference(case, kind)
    for rank, (params, norms) in enumerate(run(case.world_size, train, case, kind, mask_as)):
        # The norm number for number: a rank-local norm would be smaller at stages 1-3.
        assert norms == pytest.approx(expected_norms, rel=1e-12), f"rank {rank}"
        fzero.assert_trees_close(
            params,
            expected,
            rtol=1e-10,
            atol=1e-12,
            what=f"stage {case.stage} {case.layout} rank {rank}",
        )


@pytest.mark.multiprocess
def test_a_flat_shard_mixing_decayed_and_undecayed_leaves_gets_a_per_element_mask() -> None:
    params = {"w": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)}
    layout = fzero.build_layout(params, 2)  # dict keys sort: [b b w | w w pad]
    assert layout.piece_segments(0) == ((("b", 0, 2), ("w", 2, 3)),)
    assert layout.piece_segments(1) == ((("w", 0, 2),),)

    def fn(mesh: fzero.Mesh) -> Any:
        opt = optim.adamw(lr=0.1, weight_decay=0.5, mask=lambda path: path == "w")
        state = fzero.shard_state(params, opt, mesh, stage=3)
        grads = fzero.Shards(
            tuple(torch.zeros_like(b) for b in state.params.buffers), state.layout, mesh.rank
        )
        new, _ = fzero.sharded_update(opt, state.params, grads, state.opt_state, mesh=mesh)
        return fzero.gather_params(new, mesh)

    out = run(2, fn)[0]  # zero gradients: only decoupled decay moves anything
    assert torch.equal(out["b"], params["b"])
    assert torch.equal(out["w"], params["w"] * (1 - 0.1 * 0.5))


def test_chain_must_end_in_an_optimizer() -> None:
    with pytest.raises(TypeError, match="must end in an Optimizer"):
        optim.chain(optim.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match="positive"):
        optim.clip_by_global_norm(0.0)


@pytest.mark.multiprocess
def test_clipping_shards_without_the_mesh_is_a_clear_error() -> None:
    # Without mesh= the norm would silently be this rank's share: refuse instead.
    params = {"w": torch.ones(4, dtype=torch.float64)}

    def fn(mesh: fzero.Mesh) -> None:
        opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(lr=0.1))
        state = fzero.shard_state(params, opt, mesh, stage=3)
        grads = fzero.Shards(state.params.buffers, state.layout, mesh.rank)
        fzero.sharded_update(opt, state.params, grads, state.opt_state)

    with pytest.raises(ValueError, match="pass mesh= to sharded_update"):
        run(2, fn)


F64 = torch.float64


@pytest.mark.multiprocess
@pytest.mark.parametrize("loss", ["shared", "expanded"])
def test_gradients_autograd_shares_between_leaves_are_scaled_once(loss: str) -> None:
    """One rank at stage 0 takes autograd's gradients as they come: one tensor for two
    leaves (`(a + b)^2`), or an expanded one (a sum). Clipping, a loss scaler and the
    loss weights scale them once each, as torch does."""
    start = {
        "a": torch.tensor([1.0, 2.0, 3.0], dtype=F64),
        "b": torch.tensor([0.5, -1.0, 2.0], dtype=F64),
    }

    def loss_fn(p: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
        s = p["a"] + p["b"]
        return (s.pow(2) if loss == "shared" else s).sum() * batch.sum()

    mine = {k: v.clone().requires_grad_() for k, v in start.items()}
    opt = torch.optim.SGD(mine.values(), lr=1.0, foreach=False)
    batch = torch.ones(2, dtype=F64)
    for _ in range(2):
        opt.zero_grad()
        (loss_fn(mine, batch) / 2.0).backward()  # fzero's step below: (total, weight 2)
        torch.nn.utils.clip_grad_norm_(list(mine.values()), 0.1, foreach=False)
        opt.step()
    want = {k: v.detach() for k, v in mine.items()}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        sgd = optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(lr=1.0))
        state = fzero.shard_state(dict(start), sgd, mesh, stage=0,
                                  loss_scale=fzero.DynamicLossScale(init_scale=4.0))  # fmt: skip
        step = fzero.sharded_step(lambda p, b: (loss_fn(p, b), 2.0), sgd, mesh, stage=0)
        for _ in range(2):
            state, _ = step(state, batch)
        return dict(state.params)

    got = run(1, fn)[0]
    fzero.assert_trees_close(got, want, rtol=1e-12, atol=1e-14)


class EmaState(NamedTuple):
    m: Any


def ema(decay: float) -> optim.GradientTransformation:
    """A user's transformation that returns its own state as the gradient."""

    def init(params: Any) -> EmaState:
        return EmaState(optree.tree_map(torch.zeros_like, params))

    def update(grads: Any, state: EmaState, params: Any) -> tuple[Any, EmaState]:
        m = optree.tree_map(lambda m, g: m * decay + g * (1 - decay), state.m, grads)
        return m, EmaState(m)

    return optim.GradientTransformation(init, update)


@pytest.mark.multiprocess
def test_clipping_after_a_transformation_leaves_that_transformations_state_alone() -> None:
    """chain(ema, clip, sgd): clip scales what ema returned, ema's own state, out of
    place; the moving average is the unclipped one, as written by hand."""
    gen = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(4, 3, generator=gen, dtype=F64)}
    xs = torch.randn(3, 4, 4, generator=gen, dtype=F64)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["w"]).pow(2).mean()

    w, m = start["w"].clone(), torch.zeros(4, 3, dtype=F64)
    for t in range(3):
        g = torch.func.grad(lambda w_, x=xs[t]: loss_fn({"w": w_}, x))(w)
        m = m * 0.5 + g * 0.5
        w = w - 0.1 * m * min(1.0, 0.01 / (m.norm().item() + 1e-6))

    def fn(mesh: fzero.Mesh) -> torch.Tensor:
        opt = optim.chain(ema(0.5), optim.clip_by_global_norm(0.01), optim.sgd(lr=0.1))
        state = fzero.shard_state(dict(start), opt, mesh, stage=1)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=1)
        for t in range(3):
            state, _ = step(state, xs[t, mesh.rank * 2 : mesh.rank * 2 + 2])
        return state.params["w"].clone()

    for got in run(2, fn):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12)
