"""fzero.sharded_forward: evaluation over a sharded state, against plain torch on one process."""

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import (
    Case,
    dims_and_units,
    make_optimizer,
    make_params,
    map_every_allocation,
    mlp_loss,
    peak_rss_rise,
    run,
    tolerance,
    train_reference,
)


def predict(params: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """support.mlp_loss's network without the loss, each layer asked for where it is used."""
    h = x
    for i in range(len(params["layers"])):
        layer = fzero.gathered(params, f"layers.{i}")
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return h * params["scale"] + params["shift"]


def train_then_predict(
    mesh: fzero.Mesh, case: Case, units: list[str], held_out: torch.Tensor, **options: Any
) -> list[Any]:
    """Trains with sharded_step (predicting between steps), then predicts on `held_out`
    three times: this rank's half of it, the other half, and (rank 1 of several) nothing
    at all on the last call."""
    opt = make_optimizer(case.optimizer)
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, units=units)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=case.stage)
    forward = fzero.sharded_forward(predict, mesh, **options)
    halves = held_out.chunk(2)
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
        forward(state, halves[0])  # between steps: the next step trains as it would have
    outs = [forward(state, halves[mesh.rank % 2]), forward(state, halves[(mesh.rank + 1) % 2])]
    outs.append(forward(state, None if mesh.rank == 1 else held_out))
    assert all(not o.requires_grad for o in outs if o is not None)
    return outs


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=16)
@given(
    dims_and_units(),
    st.integers(1, 3),
    st.sampled_from([0, 1, 2, 3]),
    st.booleans(),
    st.booleans(),
)
def test_predictions_after_training_are_one_process_predictions(
    dims_units: tuple, n: int, stage: int, jit: bool, prefetch: bool
) -> None:
    # Any subset of the layers as units; the reference trains with torch.optim on the
    # concatenated batch and predicts with plain tensors (where gathered is the identity).
    dims, units = dims_units
    g = torch.Generator().manual_seed(len(dims) + n)
    xs = torch.randn(2, 2 * n, dims[0], generator=g, dtype=torch.float64)
    ys = torch.randn(2, 2 * n, dims[-1], generator=g, dtype=torch.float64)
    case = Case(make_params(dims, torch.float64, seed=n), xs, ys, n, "adam", stage)
    held_out = torch.randn(6, dims[0], generator=g, dtype=torch.float64)
    trained = train_reference(case)
    assert not torch.equal(trained["layers"][0]["w"], case.params["layers"][0]["w"])
    halves = [predict(trained, h) for h in held_out.chunk(2)]
    options = {"just_in_time": jit, "prefetch": prefetch}
    for rank, outs in enumerate(run(n, train_then_predict, case, units, held_out, **options)):
        expected = [halves[rank % 2], halves[(rank + 1) % 2], predict(trained, held_out)]
        if rank == 1:
            expected[2] = None
        what = f"stage {stage} rank {rank} of {n}, units {units} {options}"
        for got, want in zip(outs, expected, strict=True):
            if want is None:
                assert got is None, what
            else:
                torch.testing.assert_close(got, want, **tolerance(torch.float64), msg=what)


# --- modules, with buffers -----------------------------------------------------------------


class _Net(nn.Module):
    """Linear blocks with a BatchNorm (buffers) and a head tied to the embedding-like input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(3)
        )
        self.out = nn.Linear(8, 6)
        self.out.weight = nn.Parameter(self.inp.weight.detach().t().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _net() -> nn.Module:
    torch.manual_seed(0)
    model = _Net().double()
    for m in model.modules():  # statistics a fresh BatchNorm would not have
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    return model.eval()


def _module_predict(
    mesh: fzero.Mesh, stage: int, x: torch.Tensor, hooked: bool, grouped: bool = False
) -> Any:
    model = _net()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    units: list[Any] = [f"blocks.{i}" for i in range(3)] + ["out"]
    if grouped:  # units of several submodules: FSDP2's fully_shard([...])
        units = [("blocks.0", "blocks.1"), ("blocks.2", "out")]
    state = fzero.shard_state(
        params, fzero.optim.sgd(lr=0.1), mesh, stage=stage, units=units, buffers=buffers
    )
    model.to("meta")  # the module is only the program: the state holds the values

    def fn(p: dict, b: dict, batch: torch.Tensor) -> torch.Tensor:
        return functional_call(model, (p, b), (batch,))

    forward = fzero.sharded_forward(fn, mesh, module=model if hooked else None)
    out = forward(state, x[mesh.rank :: mesh.size])
    kept = {k: v.clone() for k, v in state.buffers.items()}
    model.train()  # BatchNorm in train mode updates its statistics: on copies only
    forward(state, x[mesh.rank :: mesh.size])
    return out, all(torch.equal(state.buffers[k], v) for k, v in kept.items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("hooked", [True, False])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_with_buffers_predicts_as_the_plain_module(
    stage: int, hooked: bool, grouped: bool
) -> None:
    x = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _net()(x)
    outs = run(2, _module_predict, stage, x, hooked, grouped)
    for rank, (out, unchanged) in enumerate(outs):
        torch.testing.assert_close(out, expected[rank::2], **tolerance(torch.float64))
        assert unchanged, f"rank {rank}: a forward in train mode changed the state's buffers"


# --- what it holds -------------------------------------------------------------------------

WIDTH, DEPTH = 1024, 16  # B = 16 x (1024^2 + 1024) x 4 bytes = 67 MB, as tests/e2e/test_memory.py


def _forward_rise(mesh: fzero.Mesh, entry: str) -> list[float]:
    """Peak resident bytes a stage-3 forward allocates above the state, in units of B."""
    map_every_allocation()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model_bytes = sum(v.numel() * 4 for v in params.values())
    units = [str(i) for i in range(DEPTH)]
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=units)
    del params
    model.to("meta")

    def by_module(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,))

    def pure(p: dict, x: torch.Tensor) -> torch.Tensor:
        for i in range(DEPTH):
            layer = fzero.gathered(p, str(i))
            x = torch.tanh(torch.nn.functional.linear(x, layer["0.weight"], layer["0.bias"]))
        return x

    forward = fzero.sharded_forward(
        pure if entry == "gathered" else by_module,
        mesh,
        module=model if entry == "module" else None,
        just_in_time=entry == "gathered",
    )
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(mesh.rank))
    forward(state, x)  # warm: the first call sets up what it keeps (hooks, the call order)
    rises = []
    for _ in range(3):
        with peak_rss_rise() as m:
            forward(state, x)
        rises.append(m["rise"] / model_bytes)
    return rises


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["module", "gathered"])
def test_a_stage_3_forward_holds_a_few_units_not_the_model(entry: str) -> None:
    """Measured on the rank processes (resident memory, every large allocation its own
    mapping): the unit computing, the one prefetched, and the gather of a third in the
    allocator's hands at most. Gathering every unit before the forward holds the whole
    model (B): the same bound must reject that, or it could not fail."""
    bound = 4 / DEPTH
    for rises in run(2, _forward_rise, entry):
        assert max(rises) <= bound, f"{entry}: {rises} x B > {bound}"
    if entry == "module":
        for rises in run(2, _forward_rise, "upfront"):
            assert min(rises) > 0.75, f"up front: {rises} x B"


# --- what it returns and refuses ------------------------------------------------------------


def _returns_weights(mesh: fzero.Mesh, stage: int) -> Any:
    params = make_params([3, 4, 2], torch.float64, seed=0)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=["layers.0", "layers.1"])

    def fn(p: dict, _: Any) -> Any:
        w = fzero.gathered(p, "layers.1")["w"]
        return {"w": w, "wt": w.t(), "b0": fzero.gathered(p, "layers.0")["b"], "n": 3}

    forward = fzero.sharded_forward(fn, mesh, just_in_time=True)
    first, second = forward(state, 0), forward(state, 0)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)  # donates: updates in place
    batch = (torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64))
    step(state, batch)
    return first, second


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_tensors_sharing_parameter_memory_are_returned_as_copies(stage: int) -> None:
    # Stage 3's gathered buffers are freed as the forward ends, and stages 0-2's replicas
    # are updated in place by the next (donating) step: what fn returned must not change.
    params = make_params([3, 4, 2], torch.float64, seed=0)
    for first, second in run(2, _returns_weights, stage):
        for out in (first, second):
            assert torch.equal(out["w"], params["layers"][1]["w"])
            assert torch.equal(out["wt"], params["layers"][1]["w"].t())
            assert torch.equal(out["b0"], params["layers"][0]["b"]) and out["n"] == 3


def _swapped(mesh: fzero.Mesh, first: str) -> Any:
    params = make_params([3, 4, 4, 4, 2], torch.float64, seed=0)
    units = ["layers.0", "layers.1", "layers.2", "layers.3"]
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=units)
    # A rank-dependent order of two units of one size: their gathers pair up across ranks
    # (so nothing aborts), each rank computing with the other unit's parameters.
    order = [units[0], units[2], units[1], units[3]] if mesh.rank == 1 else units

    def fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        for u in order:
            layer = fzero.gathered(p, u)
            x = torch.tanh(x @ layer["w"] + layer["b"])
        return x

    forward = fzero.sharded_forward(fn, mesh, just_in_time=True)
    forward(state, None if first == "none" else torch.ones(2, 3, dtype=torch.float64))


@pytest.mark.multiprocess
def test_ranks_calling_units_in_different_orders_fail_naming_every_ranks_calls() -> None:
    calls = (
        r"rank 0: 'layers.0', 'layers.1', 'layers.2', 'layers.3'; rank 1: 'layers.0', 'layers.2'"
    )
    with pytest.raises(ValueError, match=calls):
        run(2, _swapped, "data")


@pytest.mark.multiprocess
def test_a_first_call_without_data_says_there_is_no_last_call_to_follow() -> None:
    with pytest.raises(ValueError, match=r"forward\(state, None\) on the first call"):
        run(2, _swapped, "none")


def _more_entries_than_last_call(mesh: fzero.Mesh) -> list[torch.Tensor]:
    params = make_params([3, 4, 4, 2], torch.float64, seed=0)
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=units)

    def fn(p: dict, x: torch.Tensor, repeat: int) -> torch.Tensor:
        for i in [0, *([1] * repeat), 2]:  # layers.1 entered `repeat` times
            layer = fzero.gathered(p, f"layers.{i}")
            x = torch.tanh(x @ layer["w"] + layer["b"]) if i != 1 else x @ layer["w"]
        return x

    forward = fzero.sharded_forward(lambda p, b: fn(p, *b), mesh, just_in_time=True)
    x = torch.ones(2, 3, dtype=torch.float64)
    return [forward(state, (x, repeat)) for repeat in (1, 3, 1)]


@pytest.mark.multiprocess
def test_a_forward_may_enter_more_units_than_the_last_one() -> None:
    # No backward follows a forward, so every just-in-time entry is freed as it goes,
    # however many the last call made: none is kept back for a backward (and then
    # gathered again by nothing, or asked for flags the forward's check has none of).
    params = make_params([3, 4, 4, 2], torch.float64, seed=0)
    lay = params["layers"]
    x = torch.ones(2, 3, dtype=torch.float64)

    def plain(repeat: int) -> torch.Tensor:
        h = torch.tanh(x @ lay[0]["w"] + lay[0]["b"])
        for _ in range(repeat):
            h = h @ lay[1]["w"]
        return torch.tanh(h @ lay[2]["w"] + lay[2]["b"])

    for outs in run(2, _more_entries_than_last_call):
        for out, repeat in zip(outs, (1, 3, 1), strict=True):
            fzero.assert_trees_close(out, plain(repeat), rtol=1e-12, atol=1e-12)


@pytest.mark.multiprocess
def test_a_donated_state_is_refused() -> None:
    params = make_params([3, 2], torch.float64, seed=0)

    def go(mesh: fzero.Mesh) -> None:
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=3)
        step = fzero.sharded_step(mlp_loss, opt, mesh, stage=3)
        batch = (torch.ones(1, 3, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64))
        step(state, batch)
        fzero.sharded_forward(predict, mesh)(state, batch[0])

    with pytest.raises(ValueError, match=r"rank 0: sharded_forward: this state .* already donated"):
        run(1, go)


def _half_predict(mesh: fzero.Mesh, stage: int, x: torch.Tensor) -> torch.Tensor:
    params = make_params([5, 8, 8, 3], torch.float32, seed=2)
    precision = fzero.Precision(param_dtype=torch.bfloat16)
    units = ["layers.0", "layers.1", "layers.2"]
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, precision=precision)
    return fzero.sharded_forward(predict, mesh, just_in_time=True)(state, x[mesh.rank :: 2])


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 3])
def test_mixed_precision_predicts_in_the_compute_dtype(stage: int) -> None:
    # The parameters fn sees are the step's: cast to param_dtype (bfloat16), here from
    # float32 values, so the reference is plain torch on the parameters cast down.
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    cast = fzero._core._tree.tree_map(
        lambda t: t.bfloat16(), make_params([5, 8, 8, 3], torch.float32, seed=2)
    )
    expected = predict(cast, x)
    for rank, out in enumerate(run(2, _half_predict, stage, x)):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected[rank::2])


class _Bypass(nn.Module):
    """Calls its second unit's forward directly, so that unit's hooks never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.forward(torch.tanh(self.a(x)))


def _bypassing(mesh: fzero.Mesh, stage: int) -> None:
    torch.manual_seed(0)
    model = _Bypass().double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=stage, units=["a", "b"])
    forward = fzero.sharded_forward(
        lambda p, x: functional_call(model, p, (x,)), mesh, module=model
    )
    forward(state, torch.ones(2, 4, dtype=torch.float64))


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_unit_used_outside_its_hooks_fails_alike_at_every_stage(stage: int) -> None:
    # As in a step: stages 0-2 could compute with their replicas, but code that runs
    # there would then fail at stage 3.
    with pytest.raises(ValueError, match=r"'b.weight' of the just-in-time unit 'b' was used"):
        run(2, _bypassing, stage)


def _distill(mesh: fzero.Mesh, stage: int, teacher: dict, student: dict, xs: torch.Tensor) -> Any:
    units = ["layers.0", "layers.1", "layers.2"]
    sgd = fzero.optim.sgd(lr=0.1)
    frozen = fzero.shard_state(teacher, sgd, mesh, stage=3, units=units)
    teach = fzero.sharded_forward(predict, mesh, just_in_time=True)

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return ((predict(p, x) - teach(frozen, x)) ** 2).mean()

    state = fzero.shard_state(student, sgd, mesh, stage=stage, units=units)
    step = fzero.sharded_step(loss_fn, sgd, mesh, stage=stage, just_in_time=True)
    for t in range(xs.shape[0]):
        state, _ = step(state, xs[t].chunk(mesh.size)[mesh.rank])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_sharded_teacher_inside_a_students_step_trains_like_one_process(stage: int) -> None:
    # Distillation with both models sharded: the teacher's forward (its gathers and call
    # check) runs inside the student's forward, between the student's own gathers.
    teacher = make_params([3, 5, 5, 2], torch.float64, seed=1)
    student = make_params([3, 4, 4, 2], torch.float64, seed=2)
    xs = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    leaves, treedef = fzero._core._tree.tree_flatten(student)
    tensors = [x.clone().requires_grad_() for x in leaves]
    opt = torch.optim.SGD(tensors, lr=0.1)
    for x in xs:
        opt.zero_grad()
        with torch.no_grad():
            target = predict(teacher, x)
        (
            (predict(fzero._core._tree.tree_unflatten(treedef, tensors), x) - target) ** 2
        ).mean().backward()
        opt.step()
    expected = fzero._core._tree.tree_unflatten(treedef, [t.detach() for t in tensors])
    assert not torch.equal(expected["layers"][0]["w"], student["layers"][0]["w"])
    for got in run(2, _distill, stage, teacher, student, xs):
        fzero.assert_trees_close(got, expected, **tolerance(torch.float64), what=f"stage {stage}")


def _hybrid_predict(mesh: fzero.Mesh, x: torch.Tensor) -> torch.Tensor:
    params = make_params([3, 4, 4, 2], torch.float64, seed=0)
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3, units=units)
    return fzero.sharded_forward(predict, mesh, just_in_time=True)(state, x[mesh.rank :: 4])


@pytest.mark.multiprocess
def test_a_hybrid_mesh_predicts_as_one_process() -> None:
    # 4 ranks, shards over 2: each unit is gathered from the rank's own pair.
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expected = predict(make_params([3, 4, 4, 2], torch.float64, seed=0), x)
    simulation = fzero.Simulation(4, shard_size=2, collective_timeout=30, timeout=120)
    for rank, out in enumerate(simulation.run(_hybrid_predict, x)):
        torch.testing.assert_close(out, expected[rank::4], **tolerance(torch.float64))
