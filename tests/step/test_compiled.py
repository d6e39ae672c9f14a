"""Compiled steps (`sharded_step(compile=...)`): the forward and backward one traced graph,
units entering through functional collectives, against one process of torch.optim.

Most tests trace with the "aot_eager" backend: the same graph (dynamo, AOTAutograd, the
collectives inside it) without inductor's code generation, which costs seconds a graph on
this host; one runs inductor itself.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fzero
from tests.step.test_weights import (
    DIMS,
    UNITS,
    _weighs,
    make_data,
    pair_loss,
    reference,
    scalar_loss,
)
from tests.step.test_weights import train as weights_train
from tests.support import (
    errors_on_every_rank,
    graphs_made,
    make_optimizer,
    make_params,
    make_torch_optimizer,
    mlp_loss,
    run,
)


def final_params(state: fzero.ShardedState, mesh: fzero.Mesh) -> Any:
    return fzero.gather_params(state.params, mesh)


def train(
    mesh: fzero.Mesh,
    params: Any,
    data: list,
    kind: str,
    stage: int,
    layout: str,
    backend: str | bool,
    frozen: tuple[str, ...] = (),
    burst: int = 25 * 2**20,
    optimizer: str = "adamw",
    accumulate: str | None = None,
    entry: str = "upfront",
) -> Any:
    """`optimizer` over `data` (a rank's micro-batches each step: the first alone
    without `accumulate`), compiled, its units entering before the loss ("upfront") or
    where it asks for them ("gathered": `just_in_time`); the parameters and how many
    graphs torch.compile made."""
    made = graphs_made()
    opt = make_optimizer(optimizer)
    state = fzero.shard_state(
        params, opt, mesh, stage=stage, units=UNITS, layout=layout, frozen=list(frozen)
    )
    jit = entry == "gathered"
    loss_fn = functools.partial(pair_loss if kind == "pair" else scalar_loss, jit=jit)
    model = None
    if entry == "module":  # each unit entered by its submodule's hooks, traced
        model = TreeMLP(DIMS)
        loss_fn = functools.partial(module_loss, model, kind)
    step = fzero.sharded_step(
        loss_fn,
        opt,
        mesh,
        stage=stage,
        units=UNITS,
        module=model,
        compile=backend,
        reduce_bucket_bytes=burst,
        accumulate=accumulate,
        just_in_time=jit,
    )
    for per_rank in data:
        mine = per_rank[mesh.rank]
        with warnings.catch_warnings():  # a step where nothing counts says so
            warnings.filterwarnings("ignore", "fzero: step .* weights sum to 0")
            state, _ = step(state, mine if accumulate else mine[0])
    return final_params(state, mesh), graphs_made() - made


class _Layer(torch.nn.Module):
    def __init__(self, a: int, b: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(a, b, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.zeros(b, dtype=torch.float64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.w + self.b)


class TreeMLP(torch.nn.Module):
    """`token_losses`' MLP as a module whose parameters are named by the paths of
    `make_params(dims)`'s tree (`layers.0.w`, ..., `scale`, `shift`), for module= hooks."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(a, b) for a, b in itertools.pairwise(dims))
        self.scale = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
        self.shift = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale + self.shift


def module_loss(model: TreeMLP, kind: str, params: Any, batch: tuple) -> Any:
    """`pair_loss` or `scalar_loss` through `functional_call(model, ...)`."""
    x, y, mask = batch
    named = {"scale": params["scale"], "shift": params["shift"]}
    for i, layer in enumerate(params["layers"]):
        named |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    tokens = ((torch.func.functional_call(model, named, (x,)) - y) ** 2).sum(-1)
    return ((tokens * mask).sum(), mask.sum()) if kind == "pair" else tokens.mean()


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    world = draw(st.integers(1, 3))
    accumulate = draw(st.sampled_from([None, "sharded", "local"]))
    m = draw(st.integers(2, 3)) if accumulate else 1
    # Micro-batches of 1-2 sequences, every rank with all of them on the first step; on
    # the second any may be missing (0: None; a rank without data runs a batch of its own
    # again in the graph, or nothing); the last step's are another size (a new shape: the
    # graph recompiles).
    sizes = [[[draw(st.integers(1, 2)) for _ in range(m)] for _ in range(world)]]
    sizes.append([[draw(st.integers(0, 2)) for _ in range(m)] for _ in range(world)])
    sizes.append([[3] * m for _ in range(world)])
    return {
        "world": world,
        "accumulate": accumulate,
        "sizes": sizes,
        "stage": draw(st.integers(0, 3)),
        "layout": draw(st.sampled_from(["flat", "tensor"])),
        "kind": draw(st.sampled_from(["pair", "scalar"])),
        "frozen": draw(st.sampled_from([(), ("layers.1",)])),
        "burst": draw(st.sampled_from([0, 25 * 2**20])),
        "optimizer": draw(st.sampled_from(["adamw", "sgd"])),
        "entry": draw(st.sampled_from(["upfront", "gathered", "module"])),
        "seed": draw(st.integers(0, 99)),
    }


def example_case(**kw: Any) -> dict[str, Any]:
    """A case the property must see whatever it draws."""
    sizes = [[[2], [1]], [[1], [2]], [[3], [3]]]
    c = dict(world=2, sizes=sizes, layout="flat", kind="pair", frozen=(), burst=25 * 2**20)
    c["accumulate"], c["entry"] = None, "upfront"
    return c | {"optimizer": "sgd", "seed": 4} | kw


@pytest.mark.multiprocess
@settings(max_examples=8)
@example(c=example_case(stage=2))  # stage 2's reduce-scatter of several buckets as one
@example(c=example_case(stage=1, frozen=("layers.1",), burst=0))
@example(c=example_case(stage=3, layout="tensor", optimizer="adamw"))
@example(  # micro-batches of uneven work, each reduced in its own graph run
    c=example_case(
        stage=3, kind="scalar", accumulate="sharded", sizes=[[[2, 1], [1, 1]], [[1, 2], [2, 2]]]
    )
)
@example(c=example_case(stage=3, frozen=("layers.1",)))  # a frozen run gathered bare
@example(  # units entered where the loss asks, a frozen one among them, accumulating
    c=example_case(
        stage=3, entry="gathered", frozen=("layers.1",), accumulate="sharded",
        sizes=[[[1, 2], [2, 1]]] * 2,
    )
)  # fmt: skip
@example(c=example_case(stage=2, entry="gathered", burst=0))
@example(  # units entered by their submodules' hooks, traced, one frozen, accumulating
    c=example_case(
        stage=3, entry="module", frozen=("layers.1",), accumulate="sharded", kind="scalar",
        sizes=[[[1, 2], [2, 1]]] * 2,
    )
)  # fmt: skip
@example(c=example_case(stage=1, entry="module", layout="tensor", burst=0))
@example(  # hooks traced; the second step: rank 0 misses a micro-batch, rank 1 has none
    c=example_case(
        stage=3, entry="module", accumulate="sharded",
        sizes=[[[1, 2], [2, 1]], [[0, 2], [0, 0]], [[3, 3], [3, 3]]],
    )
)  # fmt: skip
@example(c=example_case(stage=0, accumulate="sharded", sizes=[[[2, 1], [1, 2]]] * 2))
@example(c=example_case(stage=1, accumulate="sharded", sizes=[[[1, 1], [2, 1]]] * 2))
@example(  # local: full gradients summed, reduced once (stage 3: gathered once a step)
    c=example_case(stage=3, accumulate="local", frozen=("layers.1",), sizes=[[[2, 1], [1, 2]]] * 2)
)
@example(c=example_case(stage=0, accumulate="local", kind="scalar", sizes=[[[1, 2], [2, 2]]] * 2))
@example(
    c=example_case(
        stage=2, accumulate="local", layout="tensor", entry="gathered", burst=0,
        sizes=[[[2, 2], [1, 1]]] * 2,
    )
)  # fmt: skip
@given(cases())
def test_a_compiled_step_trains_like_one_process(c: dict[str, Any]) -> None:
    """Stages 0-3, flat and tensor layouts, 1-3 ranks, scalar losses and (total, weight)
    pairs over uneven padding, missing micro-batches on the second step (ranks without
    data), one micro-batch or 2-3 accumulated ("sharded", or "local": reduced once
    after the last), a frozen unit or none, every bucket its own collective or all in
    one, units entering before
    the loss, where it calls fzero.gathered (just_in_time) or where their submodules run
    (module= hooks, traced): float64 AdamW and SGD
    (which, unlike Adam, sees a gradient's scale) equal to one-process torch.optim on the
    global mean (1e-10; the frozen unit unchanged), through three steps, the last with a
    new batch shape."""
    params = make_params(DIMS, torch.float64, c["seed"])
    data = make_data(c["sizes"], c["seed"])
    if not c["accumulate"]:
        data = [[per_rank[:1] for per_rank in step] for step in data]
    want = reference(params, data, c["kind"], c["optimizer"], frozen=c["frozen"])
    args = (c["kind"], c["stage"], c["layout"], "aot_eager", c["frozen"], c["burst"])
    extra = (c["optimizer"], c["accumulate"], c["entry"])
    got = [p for p, _ in run(c["world"], train, params, data, *args, *extra)]
    for rank, p in enumerate(got):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12, what=f"rank {rank} {c}")
    if any(_weighs(step, c["kind"]) for step in data):
        assert fzero._core._tree.max_abs_diff(got[0], params) > 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_inductor_compiles_the_step(stage: int) -> None:
    """The default backend, inductor's generated C++ kernels on the CPU: the same
    training as torch's, float64, at 2 ranks, from graphs dynamo made (a cold compile
    takes tens of seconds on 2 cores: long timeouts)."""
    params = make_params(DIMS, torch.float64, 7)
    data = make_data([[[2], [1]], [[1], [2]]], 7)
    want = reference(params, data, "pair", "sgd")
    sim = fzero.Simulation(2, collective_timeout=300, timeout=900)
    for p, graphs in sim.run(train, params, data, "pair", stage, "flat", True, (), 0, "sgd"):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)
        assert graphs >= 1


def recompiling(mesh: fzero.Mesh, params: Any, sizes: list[int]) -> list[list[str]]:
    """A compiled stage-3 step over batches of `sizes` sequences: per step, the
    RuntimeWarnings it gave."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    step = fzero.sharded_step(pair_loss, opt, mesh, stage=3, units=UNITS, compile="aot_eager")
    said = []
    for t, n in enumerate(sizes):
        batch = make_data([[[n]] * mesh.size], t)[0][mesh.rank][0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, _ = step(state, batch)
        said.append([str(w.message) for w in caught if w.category is RuntimeWarning])
    return said


@pytest.mark.multiprocess
def test_a_recompiling_step_says_so_once_per_recompile() -> None:
    """Bounded and visible: a new batch shape compiles the loss again and the step says
    so, naming the shapes, on every rank; the same shapes again, or a third size once
    torch.compile made the dimension dynamic, compile nothing and say nothing."""
    params = make_params(DIMS, torch.float64, 2)
    for said in run(2, recompiling, params, [2, 2, 3, 5, 3]):
        assert said[:2] == [[], []] and said[3:] == [[], []], said
        (message,) = said[2]
        assert "compiled again" in message and "-> [(3, " in message, message
        assert "at most" in message and "TORCH_LOGS=recompiles" in message


def past_the_limit(mesh: fzero.Mesh, params: Any, data: list) -> tuple[Any, list[str]]:
    """A compiled stage-3 step over batches of five sizes, dynamo's recompile limit 2 and
    no dynamic dimensions (each size a new graph): its parameters and what it said."""
    torch._dynamo.config.recompile_limit = 2  # this rank's process alone
    torch._dynamo.config.automatic_dynamic_shapes = False
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    step = fzero.sharded_step(pair_loss, opt, mesh, stage=3, units=UNITS, compile="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for per_rank in data:
            state, _ = step(state, per_rank[mesh.rank][0])
    said = [str(w.message) for w in caught if "recompile_limit;" in str(w.message)]
    return fzero.gather_params(state.params, mesh), said


@pytest.mark.multiprocess
def test_a_step_past_its_recompile_limit_goes_on_in_pieces() -> None:
    """Past dynamo's recompile limit a fullgraph compile raises; the step says so once and
    compiles the loss in pieces, whose frames run eagerly past their own limit: the run
    goes on, training as torch.optim does on one process (float64)."""
    params = make_params(DIMS, torch.float64, 3)
    data = make_data([[[n], [n]] for n in (1, 2, 3, 4, 5)], seed=2)
    want = reference(params, data, "pair", "sgd")
    for got, said in run(2, past_the_limit, params, data):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert len(said) == 1 and "compiled in pieces" in said[0], said


def ledgered(mesh: fzero.Mesh, params: Any, backend: str | bool, how: str) -> tuple[Any, ...]:
    """Two calls inside a comm_ledger (`how`: "step" at stage 2; "local" accumulation;
    "broken", a loss that breaks the graph; "forward" at stage 3, "replicas" at stage
    1, compiled forwards): its records' data bytes, whether it says it is complete, its
    count of graph runs, the RuntimeWarnings as it closed, and the count after clear()."""
    stage = {"forward": 3, "replicas": 1}.get(how, 2)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)
    batch = make_data([[[2]] * mesh.size], 0)[0][mesh.rank][0]

    def broken(p: Any, b: Any) -> Any:
        torch._dynamo.graph_break()
        return pair_loss(p, b)

    if how in ("forward", "replicas"):
        forward = fzero.sharded_forward(plain_predict, mesh, compile=backend)
        call = functools.partial(forward, state, batch[0])
    else:
        step = fzero.sharded_step(
            broken if how == "broken" else pair_loss, opt, mesh, stage=stage, units=UNITS,
            compile=backend, accumulate="local" if how == "local" else None, donate=False,
        )  # fmt: skip
        call = functools.partial(step, state, [batch] if how == "local" else batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fzero.comm_ledger() as ledger:
            for _ in range(2):
                call()
    said = [str(w.message) for w in caught if "comm_ledger" in str(w.message)]
    data = sum(r.nbytes for r in ledger.data)
    out = (data, ledger.complete, ledger.unrecorded, said)
    ledger.clear()
    return (*out, ledger.unrecorded)


@pytest.mark.multiprocess
def test_a_comm_ledger_says_a_compiled_graphs_collectives_are_not_in_it() -> None:
    """A compiled graph's collectives run past fzero's collective layer: a ledger open
    around compiled steps holds only their eager collectives (the gather after the
    update: half an eager step's data, whose reduce-scatter it also records), counts the
    graph's runs (once a call where the loss breaks the graph) and warns as it closes;
    around eager steps, and around graphs without collectives (local accumulation's, a
    stage-1 forward's reads), it is complete and quiet."""
    params = make_params(DIMS, torch.float64, 2)

    eager_runs = run(2, ledgered, params, False, "step")
    for (eager, *rest), (compiled, *crest) in zip(
        eager_runs, run(2, ledgered, params, "aot_eager", "step")
    ):
        assert rest == [True, 0, [], 0], rest
        complete, graphs, (said,), cleared = crest
        assert not complete and graphs == 2 and cleared == 0
        assert "2 run(s) of a compiled step's or forward's graph" in said, said
        assert compiled > 0 and 2 * compiled == eager, (compiled, eager)
    for how, runs in [("broken", 2), ("forward", 2), ("local", 0), ("replicas", 0)]:
        for rank, (_, complete, graphs, said, _) in enumerate(
            run(2, ledgered, params, "aot_eager", how)
        ):
            assert (complete, graphs, len(said)) == (runs == 0, runs, int(runs > 0)), (how, rank)


def profiled_train(mesh: fzero.Mesh, bound: int, *args: Any) -> tuple[Any, set[str]]:
    """`train` with the graph's all-to-all bound set to `bound` bytes, profiled: the
    parameters and the gloo reductions the steps ran."""
    from torch.profiler import ProfilerActivity, profile

    fzero._step._traced_comm.ALL_TO_ALL_MAX_BYTES = bound
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        params, _ = train(mesh, *args)
    ran = {e.key for e in prof.key_averages() if "alltoall" in e.key or "reduce_scatter" in e.key}
    return params, {"all_to_all" if "alltoall" in k else "reduce_scatter" for k in ran}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "path"), [(2, "all_to_all"), (3, "reduce_scatter")])
def test_gloo_reductions_in_the_graph_run_as_all_to_alls_up_to_the_bound(
    stage: int, path: str
) -> None:
    """On gloo a burst's reduce-scatter in the graph is an all-to-all whose rows each
    rank sums (half the bytes of gloo's own, an all-reduce underneath) up to the eager
    path's bound on its receive buffer, gloo's reduce-scatter beyond: either trains as
    torch.optim does, float64, at 3 ranks (rows summed over more than a pair)."""
    params = make_params(DIMS, torch.float64, 3)
    data = make_data([[[2], [1], [2]], [[1], [2], [1]]], 3)
    want = reference(params, data, "pair", "adamw")
    bound = fzero._comm.ALL_TO_ALL_MAX_BYTES if path == "all_to_all" else 0
    args = ("pair", stage, "flat", "aot_eager", (), 25 * 2**20, "adamw")
    for rank, (p, ran) in enumerate(run(3, profiled_train, bound, params, data, *args)):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12, what=f"rank {rank}")
        assert ran == {path}, ran


def refusing(mesh: fzero.Mesh, params: Any, data: list) -> Any:
    """Step 2: rank 1's weight is NaN (refused after the graph's forward), then step 3:
    rank 1's pair is (0, 0), a constant total of weight 0 (no gradient: it still joins
    the graph's collectives). Returns the error and the parameters after the steps."""
    opt = make_optimizer("sgd")
    state = fzero.shard_state(params, opt, mesh, stage=2, units=UNITS)

    def loss_fn(p: Any, batch: Any) -> Any:
        x, y, mask, bad = batch
        if bad == "nan":
            return pair_loss(p, (x, y, mask))[0], float("nan")
        if bad == "empty":
            return torch.zeros((), dtype=torch.float64), 0
        return pair_loss(p, (x, y, mask))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=2, units=UNITS, compile="aot_eager")
    mine = [per_rank[mesh.rank][0] for per_rank in data]
    state, _ = step(state, (*mine[0], None))
    with pytest.raises(ValueError) as caught:
        step(state, (*mine[1], "nan" if mesh.rank == 1 else None))
    state, _ = step(state, (*mine[1], "empty" if mesh.rank == 1 else None))
    return str(caught.value), fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
def test_a_refused_loss_raises_on_every_rank_and_a_weightless_one_joins() -> None:
    """A loss refused after the compiled forward raises on every rank before any
    backward collective (none is left waiting inside the graph) and leaves the state as
    it was; a rank whose pair is a constant of weight 0 runs the backward's collectives
    with zero gradients. The result is torch's on what counted."""
    params = make_params(DIMS, torch.float64, 2)
    data = make_data([[[2], [1]], [[1], [2]]], 2)
    for per_rank in data:  # no padding: every batch counts
        for (batch,) in per_rank:
            batch[2][:] = 1.0
    counted = [data[0], [data[1][0], [None]]]  # step 3: rank 1 counts nothing
    want = reference(params, counted, "pair", "sgd")
    for message, p in run(2, refusing, params, data):
        assert "weight must be finite" in message, message
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)


def refusing_a_middle_micro_batch(mesh: fzero.Mesh, params: Any, data: list) -> Any:
    """Accumulating three micro-batches at stage 3: in step 2 rank 1's second one has a
    NaN weight."""
    opt = make_optimizer("adamw")
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)

    def loss_fn(p: Any, batch: Any) -> Any:
        x, y, mask, bad = batch
        total, weight = pair_loss(p, (x, y, mask))
        return total, float("nan") if bad else weight

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=3, units=UNITS, compile="aot_eager", accumulate="sharded"
    )
    mine = [per_rank[mesh.rank] for per_rank in data]
    state, _ = step(state, [(*mb, False) for mb in mine[0]])
    bad = [(*mb, mesh.rank == 1 and j == 1) for j, mb in enumerate(mine[1])]
    with pytest.raises(ValueError) as caught:
        step(state, bad)
    state, _ = step(state, [(*mb, False) for mb in mine[2]])
    return str(caught.value), fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
def test_a_refused_middle_micro_batch_raises_on_every_rank_at_its_check() -> None:
    """Accumulating: a loss refused in a middle micro-batch raises on every rank at that
    micro-batch's check (where the graph collects, every check exchanges, before the
    backward's collectives), and the state is as it was: the training is torch's over
    steps 1 and 3 alone."""
    params = make_params(DIMS, torch.float64, 5)
    data = make_data([[[1, 2, 1], [2, 1, 1]]] * 3, 5)
    want = reference(params, [data[0], data[2]], "pair", "adamw")
    for message, p in run(2, refusing_a_middle_micro_batch, params, data):
        assert "weight must be finite" in message, message
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)
        assert fzero._core._tree.max_abs_diff(p, params) > 1e-4


def eager_then_compiled(mesh: fzero.Mesh, params: Any, data: list, path: str) -> Any:
    """Steps 1-2 eager, a checkpoint; steps 3-4 compiled from it, a checkpoint; step 5
    eager from that: stage 2 eager, stage 3 compiled (a checkpoint moves between
    stages too)."""
    opt = fzero.optim.adamw(lr=0.01, weight_decay=0.1)

    def stepper(stage: int, backend: str | bool) -> Any:
        return fzero.sharded_step(pair_loss, opt, mesh, stage=stage, units=UNITS, compile=backend)

    state = fzero.shard_state(params, opt, mesh, stage=2, units=UNITS)
    eager = stepper(2, False)
    for per_rank in data[:2]:
        state, _ = eager(state, per_rank[mesh.rank][0])
    fzero.checkpoint.save(state, f"{path}/a", mesh)
    state = fzero.checkpoint.load(f"{path}/a", mesh, opt, params, stage=3, units=UNITS)
    compiled = stepper(3, "aot_eager")
    for per_rank in data[2:4]:
        state, _ = compiled(state, per_rank[mesh.rank][0])
    fzero.checkpoint.save(state, f"{path}/b", mesh)
    state = fzero.checkpoint.load(f"{path}/b", mesh, opt, params, stage=2, units=UNITS)
    state, _ = eager(state, data[4][mesh.rank][0])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
def test_checkpoints_move_between_eager_and_compiled_steps(tmp_path: Path) -> None:
    """A user switches compile= on and off between runs: the state and its checkpoints
    are the same, and five steps across two switches train as torch's five."""
    params = make_params(DIMS, torch.float64, 3)
    data = make_data([[[2], [1]]] * 5, 3)
    want = reference(params, data, "pair", "adamw")
    for p in run(2, eager_then_compiled, params, data, str(tmp_path)):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)


def reloaded_then_without_data(mesh: fzero.Mesh, params: Any, data: list, path: str) -> Any:
    """A compiled stage-3 step, a checkpoint reloaded (a new layout: a new graph), then the
    last rank without data: it runs the batch it had before the reload again."""
    opt = make_optimizer("adam")
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    step = fzero.sharded_step(pair_loss, opt, mesh, stage=3, units=UNITS, compile="aot_eager")
    state, _ = step(state, data[0][mesh.rank][0])
    fzero.checkpoint.save(state, path, mesh)
    state = fzero.checkpoint.load(path, mesh, opt, params, stage=3, units=UNITS)
    for per_rank in data[1:]:
        state, _ = step(state, per_rank[mesh.rank][0])
    return fzero.gather_params(state.params, mesh)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_without_data_after_a_reload_runs_its_batch_from_before(tmp_path: Path) -> None:
    """Before, the reloaded state's new graph had no batch of this rank's to run again,
    and every rank refused the step."""
    params = make_params(DIMS, torch.float64, 4)
    data = make_data([[[2], [1]], [[2], [0]], [[1], [2]]], seed=6)
    want = reference(params, data, "pair", "adam")
    for p in run(2, reloaded_then_without_data, params, data, str(tmp_path)):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "accumulate", "kind", "missing"),
    [
        (0, None, "pair", "last step"), (2, "sharded", "pair", "last step"),
        (3, None, "scalar", "last step"), (2, "sharded", "pair", "first step, second"),
        (3, "sharded", "scalar", "first step, first"), (1, "local", "pair", "first step, first"),
        (3, "local", "pair", "last step"), (3, "local", "scalar", "last step, none"),
    ],
)  # fmt: skip
def test_a_rank_without_data_joins_a_compiled_step_with_zero_gradients(
    stage: int, accumulate: str | None, kind: str, missing: str
) -> None:
    """The last rank has no batch (None) or misses a micro-batch, on the last step or on
    the first, before or after the one it has, or has none on the last: it runs a batch
    of its own (its last, or this step's) through the graph again for the collectives
    alone (zero gradients, no weight), or with local accumulation runs nothing for it
    (nor compares the units it entered: just in time at stage 3); every rank ends where one
    process on the data that was there does, and returns that process's loss where the
    loss is token-weighted (a scalar loss: a rank's own mean, the others' without data;
    just-in-time units at stage 3)."""
    sizes = [[[2, 2] if accumulate else [2] for _ in range(2)] for _ in range(3)]
    if missing == "last step, none":
        sizes[-1][-1] = [0, 0]
    elif missing == "last step":
        sizes[-1][-1] = [2, 0] if accumulate else [0]
    else:
        sizes[0][-1] = [2, 0] if missing.endswith("second") else [0, 2]
    params = make_params(DIMS, torch.float64, 4)
    data = make_data(sizes, seed=5)
    losses: list[float] = []
    want = reference(params, data, kind, "adam", losses=losses)
    runs = run(2, weights_train, params, data, kind, "adam", stage, accumulate, stage == 3,
               "aot_eager")  # fmt: skip
    for rank, (got, returned, warned) in enumerate(runs):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
        if kind == "pair":  # every rank: the loss over all the data
            torch.testing.assert_close(returned, losses, rtol=1e-10, atol=1e-12)
        elif rank == 1 and missing.startswith("last step"):  # a scalar loss: no data, the others'
            torch.testing.assert_close(returned[-1], losses[-1], rtol=1e-10, atol=1e-12)
        assert warned == 0  # the replay compiled nothing again
    assert not torch.equal(runs[0][0]["layers"][0]["w"], params["layers"][0]["w"])


def refused(mesh: fzero.Mesh, params: Any, what: str) -> str:
    opt = fzero.optim.adamw(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    step_kw: dict[str, Any] = {"units": UNITS, "compile": "aot_eager"}
    if what == "just in time":
        step_kw["just_in_time"] = True
    if what == "a unit ledger":
        step_kw["ledger"] = fzero.UnitLedger()
    if what in ("no micro-batch", "uneven micro-batches"):
        step_kw["accumulate"] = "sharded"
    step = fzero.sharded_step(pair_loss, opt, mesh, stage=3, **step_kw)
    batch = make_data([[[1, 1], [1, 1]]], 0)[0][mesh.rank]
    if "accumulate" not in step_kw:
        batch = batch[0]
    if what == "no batch":  # at the first step: no batch of its own to run again
        batch = None if mesh.rank == 1 else batch
    elif what == "no micro-batch":  # at the first step: none of its own to run again
        batch = [None, None] if mesh.rank == 1 else batch
    elif what == "uneven micro-batches":
        state, _ = step(state, batch)  # a first step with every batch everywhere
        batch = batch[:1] if mesh.rank == 1 else batch
    with pytest.raises(ValueError) as caught:
        step(state, batch)
    return str(caught.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("just in time", "had not entered (just_in_time=True"),
        ("no batch", "rank(s) [1] stepped without a batch"),
        ("a unit ledger", "does not yet compile a step with ledger="),
        ("no micro-batch", "rank(s) [1] stepped without a batch or micro-batch"),
        ("uneven micro-batches", "different numbers of micro-batches ([2, 1], by rank)"),
    ],
)
def test_what_a_compiled_step_does_not_take_is_refused_on_every_rank(what: str, says: str) -> None:
    """Refused before any collective, the same error on every rank (never a rank waiting
    inside the graph's collectives for a peer that will not come)."""
    params = make_params(DIMS, torch.float64, 1)
    for message in run(2, refused, params, what):
        assert says in message, message


@pytest.mark.parametrize(
    ("stage", "compiled", "burst"),
    [
        (3, True, 4 * 2**20), (3, False, 25 * 2**20), (2, True, 4 * 2**20),
        (1, True, 4 * 2**20), (2, False, 25 * 2**20), (0, True, 25 * 2**20),
    ],
)  # fmt: skip
def test_bursts_default_smaller_where_a_compiled_graph_reduce_scatters(
    stage: int, compiled: bool, burst: int
) -> None:
    """`reduce_bucket_bytes=None`: DDP's 25 MiB, but 4 MiB where a compiled graph
    reduce-scatters (stages 1-3: its reductions run beside the backward, and a stage 3
    forward waits for each burst's gather); a number given is kept."""
    from fzero._step._options import step_options

    kw: dict[str, Any] = dict(
        layout=None, units=None, module=None, just_in_time=False,
        reshard_after_forward=True, quantize=None, prefetch=True, ledger=None, donate=True,
        accumulate=None, buffer_sync="broadcast", overlap_reduce=True, compile=compiled,
    )  # fmt: skip
    assert step_options(None, stage, reduce_bucket_bytes=None, **kw).reduce_bucket_bytes == burst
    assert step_options(None, stage, reduce_bucket_bytes=123, **kw).reduce_bucket_bytes == 123


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "case", ["fp16, fp32 reduce, scaler", "bf16, bf16 reduce", "bf16, bf16 reduce, 3 ranks"]
)
def test_mixed_precision_and_a_skipping_loss_scaler_compile(stage: int, case: str) -> None:
    """Compiled under `Precision`: 16-bit compute from fp32 masters (stage 3: the shard
    is the master, cast as it is gathered), gradients reduced in fp32 or bf16. With a
    dynamic loss scale and an inf in one rank's batch at step 1, every rank skips that
    update and halves the scale. The masters are torch.optim.Adam's under
    torch.amp.GradScaler on one process doing the same casts: at 2 ranks (a division by
    2 is exact) within the fused update's few fp32 ulps (eager: bitwise; compiled, the
    update fused, `fzero.optim._fused`), within bf16's rounding of the
    mean at 3, where each rank divides before the sum and torch after it."""
    _precision_case(stage, case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_local_accumulation_compiles_under_precision_and_a_skipping_scaler(stage: int) -> None:
    """`accumulate="local"` compiled, fp16 compute, fp32 reduction, a scaler skipping
    step 1 (its inf summed into the local gradient): each rank's batch twice as two
    micro-batches, whose fp32 sum and halving are exact, so the masters are those of the
    test above, torch.optim's (within the fused update's ulps)."""
    _precision_case(stage, "fp16, fp32 reduce, scaler", accumulate="local")


def _precision_case(stage: int, case: str, accumulate: str | None = None) -> None:
    from tests.state.test_precision import BF16, FP16, FP32, close, data, reference
    from tests.state.test_precision import train as train_precision

    pdt, rdt, scale = (FP16, FP32, True) if case.startswith("fp16") else (BF16, BF16, False)
    n = 3 if case.endswith("3 ranks") else 2
    xs, ys = data(n, 5, inf_at=(1, 1) if scale else None)
    ref = reference(xs, ys, pdt, rdt, scale=scale)
    if scale:
        assert ref["skipped"] == [False, True, False, False, False]
    kw = dict(pdt=pdt, rdt=rdt, scale=scale, compile="aot_eager", accumulate=accumulate)
    for out in fzero.simulate(n, train_precision, xs, ys, stage, **kw):
        assert out["graphs"] >= 1  # compiled, not stepped eagerly
        assert out["step"] == (4 if scale else 5)
        if scale:
            assert out["scales"][-1] == ref["scale"]
        for k in ref["masters"]:
            assert out["masters"][k].dtype == FP32 and out["params"][k].dtype == pdt
        close(out["masters"], ref["masters"], rtol=0, atol=1e-6 if n == 2 else 1e-3)
        assert fzero._core._tree.max_abs_diff(out["masters"], ref["start"]) > 1e-3


def plain_predict(params: dict[str, Any], x: torch.Tensor, jit: bool = False) -> torch.Tensor:
    """support.mlp_loss's network without the loss (`jit`: each layer through
    fzero.gathered)."""
    h = x
    for i, layer in enumerate(params["layers"]):
        layer = fzero.gathered(params, f"layers.{i}") if jit else layer
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return h * params["scale"] + params["shift"]


def compiled_predictions(mesh: fzero.Mesh, case: Any, held_out: torch.Tensor) -> Any:
    """Trains eagerly, then predicts with a compiled `sharded_forward`; also a weight
    returned by a compiled forward, read again after a donating step."""
    made = graphs_made()
    from tests.support import make_optimizer as optimizer_of
    from tests.support import mlp_loss

    opt = optimizer_of(case.optimizer)
    units = ["layers.0", "layers.1"]
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, units=units)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=case.stage, units=units)
    forward = fzero.sharded_forward(plain_predict, mesh, compile="aot_eager")
    weight = fzero.sharded_forward(lambda p, x: p["layers"][0]["w"], mesh, compile="aot_eager")
    for t in range(case.xs.shape[0]):
        state, _ = step(state, case.micro_batch(t, mesh.rank))
    out = forward(state, held_out)
    jit = functools.partial(plain_predict, jit=True)
    entered = fzero.sharded_forward(jit, mesh, just_in_time=True, compile="aot_eager")
    torch.testing.assert_close(entered(state, held_out), out, rtol=0, atol=0)
    model = TreeMLP([3, 5, 2])

    def module_predict(p: Any, x: torch.Tensor) -> torch.Tensor:
        named = {"scale": p["scale"], "shift": p["shift"]}
        for i, layer in enumerate(p["layers"]):
            named |= {f"layers.{i}.{k}": v for k, v in layer.items()}
        return torch.func.functional_call(model, named, (x,))

    hooked = fzero.sharded_forward(module_predict, mesh, module=model, compile="aot_eager")
    torch.testing.assert_close(hooked(state, held_out), out, rtol=0, atol=0)
    w = weight(state, held_out)
    before = w.clone()
    state, _ = step(state, case.micro_batch(0, mesh.rank))  # updates the replicas in place
    return out, w, before, graphs_made() - made


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_compiled_forward_predicts_as_one_process(stage: int) -> None:
    """`sharded_forward(compile=...)`: at stage 3 the shards gathered inside the graph
    (before `fn`, where it asks with `just_in_time`, or where a submodule runs with
    `module=`: the same), at stages 0-2 the
    replicas read: the predictions of torch.optim's trained parameters on
    one process (float64), and a returned weight is the rank's own copy, not the state's
    memory that the next step updates."""
    from tests.support import Case, train_reference

    g = torch.Generator().manual_seed(stage)
    xs = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(2, 4, 2, generator=g, dtype=torch.float64)
    case = Case(make_params([3, 5, 2], torch.float64, stage), xs, ys, 2, "adam", stage)
    held_out = torch.randn(6, 3, generator=g, dtype=torch.float64)
    trained = train_reference(case)
    want = plain_predict(trained, held_out)
    for out, w, before, graphs in run(2, compiled_predictions, case, held_out):
        assert graphs >= 2  # the predictions' graph and the weight's
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(w, trained["layers"][0]["w"], rtol=1e-10, atol=1e-12)
        assert torch.equal(w, before)


def forward_without_a_batch(mesh: fzero.Mesh, params: Any, x: torch.Tensor) -> tuple:
    """Rank 1 without a batch: on its first call (refused on every rank), then after one
    (its last batch run again for the gathers; None back), eager and compiled."""
    state = fzero.shard_state(params, fzero.optim.sgd(0.1), mesh, stage=3, units=["layers.0"])
    forward = fzero.sharded_forward(plain_predict, mesh, compile="aot_eager")
    eager = fzero.sharded_forward(plain_predict, mesh)
    with pytest.raises(ValueError) as caught:
        forward(state, None if mesh.rank == 1 else x)
    got = [forward(state, x[:2]), forward(state, None if mesh.rank == 1 else x)]
    return str(caught.value), got, [eager(state, x[:2]), eager(state, None if mesh.rank else x)]


@pytest.mark.multiprocess
def test_a_compiled_stage_3_forward_takes_a_rank_without_data_after_its_first_batch() -> None:
    """The gathers run inside the graph. A rank without a batch on its first call cannot
    join them: every rank raises the same error before any gather (none waits for the
    group's timeout). After a batch of its own, the rank runs that batch again for the
    gathers and gets None, as eagerly; the others get one process's predictions."""
    params = make_params([3, 5, 2], torch.float64, 0)
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = plain_predict(params, x)
    for rank, (message, got, eager) in enumerate(run(2, forward_without_a_batch, params, x)):
        assert "rank(s) [1] stepped without a batch" in message, message
        torch.testing.assert_close(got[0], want[:2], rtol=1e-12, atol=1e-14)
        if rank == 0:
            torch.testing.assert_close(got[1], want, rtol=1e-12, atol=1e-14)
        else:
            assert got[1] is None and eager[1] is None


def alone_without_data(mesh: fzero.Mesh, params: Any) -> tuple[Any, float, bool]:
    state = fzero.shard_state(params, fzero.optim.sgd(0.1), mesh, stage=3, units=["layers.0"])
    forward = fzero.sharded_forward(plain_predict, mesh, compile="aot_eager")
    step = fzero.sharded_step(mlp_loss, fzero.optim.sgd(0.1), mesh, stage=3, compile="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing counted anywhere: said once
        new, loss = step(state, None)
    same = fzero.gather_params(new.params, mesh)["layers"][0]["w"]
    return forward(state, None), float(loss), torch.equal(same, params["layers"][0]["w"])


@pytest.mark.multiprocess
def test_a_lone_rank_without_data_needs_no_graph() -> None:
    """On one rank nothing is collected in the graph: a compiled stage-3 forward without a
    batch returns None and a step without one changes nothing (loss 0), even first."""
    params = make_params([3, 5, 2], torch.float64, 0)
    assert run(1, alone_without_data, params) == [(None, 0.0, True)]


def hybrid(mesh: fzero.Mesh, params: Any, data: list) -> list[Any]:
    """Stages 0-3 in turn on a 2-D mesh of 4 ranks (2 shard, 2 replicas), from `params`
    each time, compiled: units where the loss asks at stages 0 and 3, before it at 1 and
    2; two micro-batches a rank, accumulated locally at stages 1 and 3 (reduced once
    after the graphs, across the replicas too), "sharded" at 0 and 2. The four trained
    trees."""
    mesh = fzero.ProcessGroupMesh(shard_size=2)
    out = []
    for stage in range(4):
        jit, local = stage in (0, 3), stage in (1, 3)
        opt = make_optimizer("adamw")
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)
        step = fzero.sharded_step(
            functools.partial(pair_loss, jit=jit),
            opt,
            mesh,
            stage=stage,
            units=UNITS,
            just_in_time=jit,
            compile="aot_eager",
            accumulate="local" if local else "sharded",
        )
        for per_rank in data:
            state, _ = step(state, per_rank[mesh.rank])
        out.append(final_params(state, mesh))
    return out


@pytest.mark.multiprocess
def test_a_two_dimensional_mesh_compiles() -> None:
    """Hybrid sharding compiled: the shard axis gathers and reduce-scatters inside the
    graph, the replica axis sums the reduced shards (stage 0: the world all-reduces);
    every stage trains as one-process torch.optim (float64, uneven padding)."""
    params = make_params(DIMS, torch.float64, 11)
    data = make_data([[[2, 1], [1, 1], [1, 2], [2, 2]], [[1, 2], [2, 1], [2, 2], [2, 1]]], 11)
    want = reference(params, data, "pair", "adamw")
    for per_stage in fzero.Simulation(4, collective_timeout=120, timeout=600).run(
        hybrid, params, data
    ):
        for stage, p in enumerate(per_stage):
            fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
            assert fzero._core._tree.max_abs_diff(p, params) > 1e-4


def hooked(mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor) -> list[Any]:
    """Stages 0-3 in turn, `module=` with a loss through functional_call, compiled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
        torch.nn.Linear(4, 2),
    ).double()  # fmt: skip
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    out = []
    for stage in range(4):
        opt = make_optimizer("adamw")
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=["0", "2"])
        step = fzero.sharded_step(
            loss_fn, opt, mesh, stage=stage, module=model, compile="aot_eager"
        )
        for t in range(xs.shape[0]):
            state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        out.append(final_params(state, mesh))
    return [params, *out]


@pytest.mark.multiprocess
def test_a_module_loss_compiles() -> None:
    """`module=` compiled: the loss runs torch's own layers through functional_call,
    each unit entered where its submodule runs (the hooks traced); every stage trains as
    one-process torch.optim.AdamW over both ranks' batches (float64)."""
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(3, 2, 2, 3, generator=g, dtype=torch.float64)  # step, rank, rows, in
    ys = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64)
    got = run(2, hooked, xs, ys)
    start = got[0][0]
    tensors = {k: v.detach().clone().requires_grad_() for k, v in start.items()}
    opt = make_torch_optimizer("adamw", list(tensors.values()))
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
        torch.nn.Linear(4, 2),
    ).double()  # fmt: skip
    for t in range(xs.shape[0]):
        out = torch.func.functional_call(model, tensors, (xs[t].reshape(4, 3),))
        opt.zero_grad()
        ((out - ys[t].reshape(4, 2)) ** 2).mean().backward()
        opt.step()
    for rank_out in got:
        for stage, p in enumerate(rank_out[1:]):
            fzero.assert_trees_close(p, tensors, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
            assert fzero._core._tree.max_abs_diff(p, start) > 1e-4


def misused(mesh: fzero.Mesh, how: str) -> None:
    """A hooked unit's parameter used outside its submodule's forward, compiled."""
    params = make_params(DIMS, torch.float64, 0)
    model = TreeMLP(DIMS)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)

    def loss_fn(p: Any, batch: tuple) -> torch.Tensor:
        loss = module_loss(model, "scalar", p, batch)
        w = p["layers"][1]["w"]
        if how == "gathered":
            w = fzero.gathered(p, "layers.1")["w"]
        if how == "matmul":  # beside the batch's tensors: the trace fails
            return loss + (batch[0] @ w).sum()
        return loss + 1e-3 * w.square().sum()  # a scalar: the loss comes out meta

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, compile="aot_eager")
    step(state, make_data([[[1], [1]]], 0)[0][mesh.rank][0])


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["scalar", "matmul", "gathered"])
def test_a_hooked_parameter_used_outside_its_submodule_is_refused_on_every_rank(
    how: str,
) -> None:
    """Compiled, a hooked unit's leaves are empty until its submodule runs: a loss that
    reads one elsewhere (a regulariser, `fzero.gathered`) raises a ValueError saying so on
    every rank, never a value read from nothing."""
    for said in errors_on_every_rank(2, functools.partial(misused, how=how)):
        assert said.startswith("ValueError: rank ") and "outside that unit's submodule" in said


def swapped(mesh: fzero.Mesh, params: Any, forward: bool) -> str:
    """Rank 1 enters two units of one size in the other order: the graph's gathers pair
    rank 0's layers.1 with rank 1's layers.2 (no collective fails)."""
    opt = make_optimizer("sgd")
    units = ["layers.0", "layers.1", "layers.2"]
    state = fzero.shard_state(params, opt, mesh, stage=3, units=units)
    order = ["layers.1", "layers.2"] if mesh.rank == 0 else ["layers.2", "layers.1"]

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        got = {u: fzero.gathered(p, u) for u in order}
        h = batch
        for u in ["layers.0", "layers.1", "layers.2"]:
            layer = got.get(u) or fzero.gathered(p, u)
            h = torch.tanh(h @ layer["w"] + layer["b"])
        return h.sum()

    x = torch.ones(2, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as caught:
        if forward:
            fzero.sharded_forward(loss_fn, mesh, just_in_time=True, compile="aot_eager")(state, x)
        else:
            step = fzero.sharded_step(
                loss_fn, opt, mesh, stage=3, units=units, just_in_time=True, compile="aot_eager"
            )
            step(state, x)
    return str(caught.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("forward", [False, True])
def test_units_entered_in_another_order_on_one_rank_raise_on_every_rank(forward: bool) -> None:
    """Where the loss enters its units, a rank-dependent order would pair one unit's
    gather with another's of the same size, silently: the ranks compare what their
    graphs entered before any backward (after a forward), and every rank raises."""
    params = make_params([4, 4, 4, 4], torch.float64, 0)
    for message in run(2, swapped, params, forward):
        assert "different units on different ranks" in message, message
        assert "'layers.2', 'layers.1'" in message or "layers.2, layers.1" in message, message


def part_loss(params: Any, batch: tuple, how: str) -> torch.Tensor:
    """test_weights' network, its layers entered through `fzero.gathered` on the "layers"
    subtree ("subtree"), or layers.1's weight alone ("part")."""
    x, y, mask = batch
    h = x
    for i in range(len(DIMS) - 1):
        if how == "part" and i == 1:
            layer = {"w": fzero.gathered(params, "layers.1.w"), "b": params["layers"][1]["b"]}
        else:
            layer = fzero.gathered(params["layers"], str(i))
        h = torch.tanh(h @ layer["w"] + layer["b"])
    out = h * params["scale"] + params["shift"]
    return (((out - y) ** 2).sum(-1) * mask).sum() / mask.sum()


def entering(mesh: fzero.Mesh, params: Any, data: list, how: str, dynamo: bool) -> Any:
    """Stage 3, just in time, compiled (`dynamo` False: the same step under
    `torch.compiler.set_stance("force_eager")`, its function run as Python); the trained
    tree, or the error."""
    if not dynamo:
        torch.compiler.set_stance("force_eager")
    opt = make_optimizer("sgd")
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS)
    loss = functools.partial(part_loss, how=how)
    step = fzero.sharded_step(
        loss, opt, mesh, stage=3, units=UNITS, just_in_time=True, compile="aot_eager"
    )
    try:
        for per_rank in data:
            state, _ = step(state, per_rank[mesh.rank][0])
    except ValueError as exc:
        return str(exc)
    return final_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("dynamo", [True, False])
def test_units_enter_from_a_subtree_and_a_part_of_one_is_refused(dynamo: bool) -> None:
    """`fzero.gathered` on a part of the step's tree (`params["layers"]`, "0") enters the
    unit as on the whole tree; asking for part of a just-in-time unit is a ValueError
    naming it, as eagerly. Traced, and forced eager (torch.compile's debugging stance:
    the compiled step's function then runs as Python, entering the units there)."""
    params = make_params(DIMS, torch.float64, 6)
    data = make_data([[[2], [2]], [[2], [2]]], 6)
    for per_rank in data:  # no padding: each rank's mean is the pair's
        for (batch,) in per_rank:
            batch[2][:] = 1.0
    want = reference(params, data, "scalar", "sgd")
    for p in run(2, entering, params, data, "subtree", dynamo):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12)
    for message in run(2, entering, params, data, "part", dynamo):
        assert "'layers.1.w' is only part of the just-in-time unit 'layers.1'" in message, message


def test_just_in_time_units_enter_in_bursts_up_to_the_cap() -> None:
    """`jit_bursts`: consecutive just-in-time units share an entry while their full
    buckets (reduce dtype) fit `reduce_bucket_bytes`; 0, or a unit larger than the cap,
    enters alone."""
    from fzero._core._layout import build_layout
    from fzero._step._bursts import jit_bursts, jit_units

    sizes = {"a": 100, "b": 300, "c": 50, "d": 60, "e": 1000}
    params = {u: {"w": torch.zeros(n, dtype=torch.float64)} for u, n in sizes.items()}
    layout = build_layout(params, 2, units=list(sizes))
    units = sorted(jit_units(layout), key=layout.units.index)
    reduce = [b.dtype for b in layout.buckets]
    # 8 bytes an element: a, b = 3200 bytes; c, d = 880; e = 8000.
    assert jit_bursts(layout, units, 3500, reduce) == [("a", "b"), ("c", "d"), ("e",)]
    assert jit_bursts(layout, units, 0, reduce) == [(u,) for u in units]
    assert jit_bursts(layout, units, 10**6, reduce) == [tuple(units)]
    # A 4-byte reduce dtype halves what each unit counts for.
    assert jit_bursts(layout, units, 3500, [torch.float32] * len(reduce)) == [
        ("a", "b", "c", "d"),
        ("e",),
    ]


class _Fixed:
    """A compiled loss's stand-in: `table` fixed, `scale` not."""

    def __init__(self) -> None:
        self.table, self.scale = (1, 2, 3), 2.0

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum(self.table) * self.scale


@pytest.mark.skipif(
    not hasattr(torch._dynamo.types, "GuardFilterEntry"), reason="torch < 2.8: no guard filter"
)
def test_this_torch_compiles_a_loss_without_the_guards_on_its_fixed_attributes() -> None:
    """Through dynamo itself (not a predicate over names made up here: torch 2.13 names
    a guard's value `self.table`, and a filter written for `L['self'].table` had dropped
    nothing): once traced, a fixed attribute changed (as fzero never changes one) is
    not looked at again, no retrace; a changed attribute that is not fixed retraces."""
    from fzero._step._dynamo import compile_loss, own_code

    held = _Fixed()
    fn = compile_loss(own_code(held.loss), "eager", True, ("table",))  # a code of its own
    x = torch.ones(2)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(fn(x), x * 12)
    held.table = (1, 2, 4)
    assert torch.equal(fn(x), x * 12)  # the trace's constant: the guard is gone
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1
    held.scale = 3.0
    assert torch.equal(fn(x), x * 21)  # retraced, reading both again
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 2


def test_guards_on_a_compiled_losss_fixed_attributes_are_dropped_and_no_others() -> None:
    """`compile_loss(..., fixed)`'s guard filter: a guard on a value under one of the
    loss's fixed attributes (its layout, its bursts) is dropped; one on the user's loss,
    on the loss's hooks, on the graph's inputs, or on an attribute whose name merely
    starts like a fixed one, is kept."""
    from types import SimpleNamespace

    from fzero._step._compiled import CompiledLoss
    from fzero._step._dynamo import _unfixed

    roots = tuple(f"self.{name}" for name in CompiledLoss.FIXED)
    # Named as torch 2.13's entries name them (the frame's locals unwrapped), and as the
    # guards do (`L['self']`).
    dropped = [
        "self.layout",
        "self.layout.buckets[3].slots[1].offset",
        "L['self'].runs[0][2]",
        "self.jit['blocks.0']",
    ]
    kept = [
        "self",
        "self.loss_fn.__closure__[0].cell_contents",
        "L['self'].hooks.enter_unit",
        "self.layouts",
        "leaves[0]",
        "L['batch'][1]",
    ]
    entries = [SimpleNamespace(name=n) for n in dropped + kept]
    assert _unfixed(roots, entries) == [False] * len(dropped) + [True] * len(kept)
