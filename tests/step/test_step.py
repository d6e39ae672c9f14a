"""sharded_step end to end: learning-rate schedules, and meshes over process subgroups."""

from typing import Any

import pytest
import torch

import fzero
from tests.support import Case, make_params, mlp_loss, run, tolerance


def _schedule(count: int) -> float:
    """Warm-up then decay, indexed by the number of updates already applied."""
    return 0.02 * min(count + 1, 2) / (1 + count) ** 0.5


def _case(n: int, steps: int = 4, seed: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, 2 * n, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(steps, 2 * n, 2, generator=g, dtype=torch.float64)
    return Case(make_params([3, 5, 2], torch.float64, seed), xs, ys, n)


def _reference(case: Case) -> Any:
    """torch.optim.AdamW on one process; the learning rate set before every step."""
    leaves, treedef = fzero._core._tree.tree_flatten(case.params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.AdamW(tensors, lr=_schedule(0), weight_decay=0.1, foreach=False)
    for t in range(case.xs.shape[0]):
        opt.param_groups[0]["lr"] = _schedule(t)
        opt.zero_grad()
        mlp_loss(
            fzero._core._tree.tree_unflatten(treedef, tensors), (case.xs[t], case.ys[t])
        ).backward()
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def _train(mesh: fzero.Mesh, case: Case, stage: int) -> Any:
    opt = fzero.optim.adamw(lr=_schedule, weight_decay=0.1)
    state = fzero.shard_state(case.params, opt, mesh, stage=stage, units=["layers.1"])
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_lr_schedule_through_sharded_step_matches_torch(stage: int) -> None:
    case = _case(3)
    expected = _reference(case)
    assert not torch.equal(expected["layers"][0]["w"], case.params["layers"][0]["w"])
    for params in run(3, _train, case, stage):
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64), what=f"{stage=}")


def _train_in_subgroups(world: fzero.Mesh, cases: list[Case]) -> list[Any]:
    # Ranks 0-1 and 2-3 each train their own model on their own data, over their own
    # process group: collectives (and gloo's point-to-point messages, which address
    # peers by global rank) must stay within the group.
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = fzero.ProcessGroupMesh(groups[world.rank // 2])
    assert mesh.size == 2 and mesh.rank == world.rank % 2
    return [_train(mesh, cases[world.rank // 2], stage) for stage in (0, 1, 2, 3)]


@pytest.mark.multiprocess
def test_meshes_over_subgroups_train_their_own_model() -> None:
    cases = [_case(2, seed=1), _case(2, seed=2)]
    expected = [_reference(c) for c in cases]
    for world_rank, per_stage in enumerate(run(4, _train_in_subgroups, cases)):
        for stage, params in enumerate(per_stage):
            fzero.assert_trees_close(
                params,
                expected[world_rank // 2],
                **tolerance(torch.float64),
                what=f"rank {world_rank}, stage {stage}",
            )


def _train_in_mode(mesh: fzero.Mesh, case: Case, stage: int, mode: str) -> Any:
    opt = fzero.optim.adamw(lr=_schedule, weight_decay=0.1)
    state = fzero.shard_state(case.params, opt, mesh, stage=stage, units=["layers.1"])
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)
    around = torch.no_grad if mode == "no_grad" else torch.inference_mode
    for t in range(case.xs.shape[0]):
        with around():
            state, _ = step(state, case.micro_batch(t, mesh.rank))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_called_under_no_grad_still_trains_like_torch(stage: int, n: int) -> None:
    # A step takes its own gradients, as torch.func.grad does. Under the caller's
    # no_grad the loss used to record nothing and the step applied a zero update.
    case = _case(n)
    expected = _reference(case)
    for params in run(n, _train_in_mode, case, stage, "no_grad"):
        fzero.assert_trees_close(params, expected, **tolerance(torch.float64), what=f"{stage=}")


@pytest.mark.multiprocess
def test_a_step_called_under_inference_mode_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"rank \d: sharded_step .* torch.inference_mode"):
        run(2, _train_in_mode, _case(2), 3, "inference_mode")


def test_value_and_grad_under_no_grad_differentiates() -> None:
    case = _case(1)
    batch = case.micro_batch(0, 0)
    with torch.no_grad():
        value, grads = fzero.value_and_grad(mlp_loss, case.params, batch)
    leaves, treedef = fzero._core._tree.tree_flatten(case.params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    loss = mlp_loss(fzero._core._tree.tree_unflatten(treedef, tensors), batch)
    expected = torch.autograd.grad(loss, tensors)
    assert torch.equal(value, loss.detach())
    fzero.assert_trees_close(grads, fzero._core._tree.tree_unflatten(treedef, list(expected)))


def _spectral(params: Any, batch: Any) -> torch.Tensor:
    """A Fourier layer (FNO's): a complex weight multiplies the input's spectrum. fzero
    holds the weight as its real view; the loss views it back."""
    x, y = batch
    w = torch.view_as_complex(params["w"]) if params["w"].dtype != torch.complex128 else params["w"]
    out = torch.fft.irfft(torch.fft.rfft(x) * w, n=x.shape[-1]) + params["b"]
    return torch.nn.functional.mse_loss(out, y)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_complex_parameter_held_as_its_real_view_trains_as_torch_steps_it(stage: int) -> None:
    """torch.optim steps a complex parameter as its real view: so does fzero, which
    holds it that way (it refuses a complex leaf, saying so)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, dtype=torch.complex128, generator=g)
    b = torch.randn(8, dtype=torch.float64, generator=g)
    xs = torch.randn(3, 6, 8, dtype=torch.float64, generator=g)
    ys = torch.randn(3, 6, 8, dtype=torch.float64, generator=g)
    tensors = {"w": w.clone().requires_grad_(), "b": b.clone().requires_grad_()}
    opt = torch.optim.AdamW(tensors.values(), lr=0.05, weight_decay=0.1, foreach=False)
    for t in range(3):
        opt.zero_grad()
        _spectral(tensors, (xs[t], ys[t])).backward()
        opt.step()
    want = {"w": torch.view_as_real(tensors["w"].detach()), "b": tensors["b"].detach()}
    assert not torch.equal(tensors["w"], w)

    def train(mesh: fzero.Mesh) -> Any:
        adamw = fzero.optim.adamw(lr=0.05, weight_decay=0.1)
        params = {"w": torch.view_as_real(w).clone(), "b": b}
        state = fzero.shard_state(params, adamw, mesh, stage=stage)
        step = fzero.sharded_step(_spectral, adamw, mesh, stage=stage)
        for t in range(3):
            state, _ = step(state, (xs[t, 3 * mesh.rank : 3 * mesh.rank + 3],
                                    ys[t, 3 * mesh.rank : 3 * mesh.rank + 3]))  # fmt: skip
        return fzero.gather_params(state.params, mesh)

    for got in run(2, train):
        fzero.assert_trees_close(got, want, **tolerance(torch.float64), what=f"{stage=}")
