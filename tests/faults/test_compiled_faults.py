"""Faults in compiled steps: one rank's error raised on every rank, though a compiled
graph's collectives wait inside the graph, where no peer's failure can be looked for."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.func import functional_call

import fzero
from tests.faults.harness import BOUND, _catching, outcomes, raised_together
from tests.faults.test_step_faults import UNITS, batches, mine, model, reference, setup

# Every case starts rank processes and traces a small graph (aot_eager: no code is generated).
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _raises_in_trace(
    mesh: fzero.Mesh, stage: int, jit: bool, fault: str, pieces: bool = False
) -> None:
    """Rank 1's compiled loss raises while it is traced at the second step (its own
    exception, or a batch whose shape does not fit the model): it never runs the graph,
    whose collectives the other rank is about to run (stage 3's gathers). `pieces`: the
    loss breaks the graph after entering unit a, and raises in the second piece."""
    state, opt, net = setup(mesh, stage)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        xb, yb, t = batch
        if jit:
            a = fzero.gathered(p, "a")
            if pieces:  # the rest is traced apart: its own graph, with b's gather
                torch._dynamo.graph_break()
        if fault == "raise" and mesh.rank == 1 and t == 1:
            raise ValueError("rank 1's data loader handed a corrupt batch")
        if jit:
            b = fzero.gathered(p, "b")
            p = {**{f"a.{k}": v for k, v in a.items()}, **{f"b.{k}": v for k, v in b.items()}}
        return (functional_call(net, p, (xb,)) - yb).square().mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, just_in_time=jit, compile="aot_eager",
        reduce_bucket_bytes=0 if pieces else None,  # b's gather apart from a's
    )  # fmt: skip
    with warnings.catch_warnings():  # "compiled in pieces", said once
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in range(3):
            xb = mine(x[t], mesh.rank)
            if fault == "shape" and mesh.rank == 1 and t == 1:
                xb = xb[:, :3]  # a batch of 3 features for a model of 4
            state, _ = step(state, (xb, mine(y[t], mesh.rank), t))


@pytest.mark.parametrize(
    "stage, jit", [(0, False), (3, False), (3, True)], ids=["stage0", "stage3", "stage3-jit"]
)
def test_an_exception_in_one_ranks_compiled_loss_raises_on_every_rank_at_once(
    stage: int, jit: bool
) -> None:
    """Before this was guarded, rank 0 waited in the graph's first gather until the
    process group's timeout at stage 3, then raised a timeout (measured: 22 s here)."""
    outs = outcomes(2, _raises_in_trace, stage, jit, "raise")
    raised_together(outs, ValueError, "corrupt batch")
    assert [o.peer for o in outs] == [True, False]


def test_a_batch_that_fails_one_ranks_trace_raises_on_every_rank_at_once() -> None:
    outs = outcomes(2, _raises_in_trace, 3, False, "shape")
    raised_together(outs, RuntimeError)
    assert [o.peer for o in outs] == [True, False]


def _raises_inside_the_graph(mesh: fzero.Mesh) -> None:
    """Rank 1's graph raises as it runs (an index out of range, which no trace can see),
    before a just-in-time gather that rank 0's graph then waits in: inside the graph,
    where a peer's failure cannot be looked for, until the process group's timeout."""
    state, opt, net = setup(mesh, 3)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        xb, yb, rows = batch
        xb = xb[rows]
        a, b = fzero.gathered(p, "a"), fzero.gathered(p, "b")
        p = {**{f"a.{k}": v for k, v in a.items()}, **{f"b.{k}": v for k, v in b.items()}}
        return (functional_call(net, p, (xb,)) - yb).square().mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=3, units=UNITS, just_in_time=True, compile="aot_eager"
    )
    for t in range(2):
        rows = torch.tensor([0, 1 if mesh.rank == 0 or t == 0 else 7])
        state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank), rows))


def test_a_loss_in_pieces_whose_later_piece_fails_one_ranks_trace_raises_its_error() -> None:
    """The barrier is once a call, before the first gather: a trace that fails in a later
    piece of a loss that breaks the graph leaves the peer in that piece's gather until
    the process group's timeout (3 s here); the peer then raises the error, not a timeout."""
    sim = fzero.Simulation(2, collective_timeout=3.0, timeout=90)
    outs = sim.run(_catching, _raises_in_trace, 3, True, "raise", True)
    assert outs[1].isinstance(ValueError) and not outs[1].peer
    assert outs[0].isinstance(ValueError) and outs[0].peer, outs[0].message
    assert outs[0].message == outs[1].message


def _breaks_on_rank_0(mesh: fzero.Mesh, reshard: bool) -> Any:
    """Rank 0's loss breaks the graph between two just-in-time gathers (a log line on
    rank 0 alone), rank 1's does not: one graph there, two here, and one barrier each.
    With resharding: the error, then the same state trained on without it."""
    state, opt, net = setup(mesh, 3)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        xb, yb = batch
        a = fzero.gathered(p, "a")
        if mesh.rank == 0:
            torch._dynamo.graph_break()
        b = fzero.gathered(p, "b")
        p = {**{f"a.{k}": v for k, v in a.items()}, **{f"b.{k}": v for k, v in b.items()}}
        return (functional_call(net, p, (xb,)) - yb).square().mean()

    def make(reshard: bool) -> Any:
        return fzero.sharded_step(
            loss_fn, opt, mesh, stage=3, units=UNITS, just_in_time=True, compile="aot_eager",
            reduce_bucket_bytes=0,  # a's gather and b's apart
            reshard_after_forward=reshard,
        )  # fmt: skip

    step, said = make(reshard), None
    with warnings.catch_warnings():  # "compiled in pieces", on rank 0
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in range(3):
            try:
                state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank)))
            except ValueError as exc:  # the state is as it was: on without resharding
                said, step = str(exc), make(False)
                state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank)))
    params = fzero.gather_params(state.params, mesh)
    return params if not reshard else (said, params)


def test_ranks_whose_losses_break_the_graph_differently_train_like_one_process() -> None:
    outs = outcomes(2, _breaks_on_rank_0, False)
    want = reference([0, 1, 2], 2)
    for o in outs:
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, want, rtol=1e-10, atol=1e-12)
        assert not torch.equal(o.value["a.weight"], model().a.weight)


def test_ranks_whose_losses_break_the_graph_differently_at_stage_3_resharding_raise() -> None:
    # A rank in pieces keeps the gathers that cross a break where a rank compiled whole
    # may gather again for its backward: their collectives paired a gather with a
    # reduction and waited for the timeout (a block that logs on rank 0 only, through
    # module hooks). Every rank raises instead, before any gather.
    want = reference([0, 1, 2], 2)
    for said, params in fzero.Simulation(2, collective_timeout=20.0).run(_breaks_on_rank_0, True):
        assert "in pieces on some ranks only (rank 0: it breaks torch.compile's graph" in said
        assert "reshard_after_forward=False" in said
        fzero.assert_trees_close(params, want, rtol=1e-10, atol=1e-12)


def test_a_rank_whose_graph_raises_mid_run_has_its_error_raised_by_the_rank_left_waiting() -> None:
    """The waiting rank's collective ends at the process group's timeout (3 s here), or at
    once where the failed rank's process exits (torchrun's case); either way it raises
    the failed rank's error, not a timeout."""
    sim = fzero.Simulation(2, collective_timeout=3.0, timeout=90)
    outs = sim.run(_catching, _raises_inside_the_graph)
    assert outs[1].isinstance(IndexError) and not outs[1].peer
    assert outs[0].isinstance(IndexError) and outs[0].peer, outs[0].message
    assert outs[0].message == outs[1].message
    assert outs[0].at - outs[1].at < 3.0 + BOUND


def _faulty_micro_batch(mesh: fzero.Mesh, stage: int, where: str) -> None:
    """Rank 1's loss fails in its second step, after its forward's graph ran (at stage 3
    its gathers, whose barrier it passed): the loss breaks the graph there and fails in
    the Python after it. `where`:
    - "middle": it raises in the second of three micro-batches ("sharded"): the other
      rank goes on to that micro-batch's backward, whose reductions wait inside the
      graph, where a peer's failure cannot be looked for;
    - "last backward": the last of two micro-batches ("local") raises in its backward
      (a hook on the loss's input), after the step's last check: the other rank goes on
      to the one reduction after the micro-batches, functional collectives run eagerly,
      whose waits cannot look for a peer's failure either."""
    state, opt, net = setup(mesh, stage)
    n = 3 if where == "middle" else 2
    x, y = batches(mesh.size, 2 * n)

    def refuse(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("rank 1 ran out of memory in its backward")

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        xb, yb, fault = batch
        out = functional_call(net, p, (xb,))
        torch._dynamo.graph_break()
        if fault and where == "middle":
            raise RuntimeError("rank 1's data loader handed a corrupt batch")
        if fault:
            out.register_hook(refuse)
        return (out - yb).square().mean()

    accumulate = "sharded" if where == "middle" else "local"
    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, compile="aot_eager", accumulate=accumulate
    )
    with warnings.catch_warnings():  # "compiled in pieces", said once
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in (0, 1):
            micro = [
                (mine(x[n * t + k], mesh.rank), mine(y[n * t + k], mesh.rank), False)
                for k in range(n)
            ]
            if mesh.rank == 1 and t == 1:
                micro[1] = (*micro[1][:2], True)
            state, _ = step(state, micro)


@pytest.mark.parametrize("stage", [0, 3])
def test_an_exception_in_a_middle_micro_batch_raises_on_every_rank_at_once(stage: int) -> None:
    """Before every micro-batch's check exchanged in a compiled step (only the first and
    the last did), rank 0 waited in the graph's backward reductions until the process
    group's timeout (19 s here, found by a random run of faults)."""
    outs = outcomes(2, _faulty_micro_batch, stage, "middle")
    raised_together(outs, RuntimeError, "corrupt batch")
    assert [o.peer for o in outs] == [True, False]


@pytest.mark.parametrize("stage", [0, 3])
def test_an_exception_in_the_last_backward_of_local_accumulation_raises_at_once(
    stage: int,
) -> None:
    """Before the reduction after the micro-batches passed a polled barrier, rank 0
    waited in it until the process group's timeout (20 s; found by a random run of
    faults)."""
    outs = outcomes(2, _faulty_micro_batch, stage, "last backward")
    raised_together(outs, RuntimeError, "out of memory in its backward")
    assert [o.peer for o in outs] == [True, False]


def _forward_raises_in_trace(mesh: fzero.Mesh) -> None:
    """A compiled stage-3 forward whose function raises on rank 1 as it is traced."""
    state, _, net = setup(mesh, 3)
    x, _ = batches(mesh.size, 1)

    def predict(p: Any, xb: torch.Tensor) -> torch.Tensor:
        if mesh.rank == 1:
            raise KeyError("rank 1 asked for a head the model does not have")
        return functional_call(net, p, (xb,))

    fzero.sharded_forward(predict, mesh, compile="aot_eager")(state, mine(x[0], mesh.rank))


def test_an_exception_in_one_ranks_compiled_forward_raises_on_every_rank_at_once() -> None:
    outs = outcomes(2, _forward_raises_in_trace)
    raised_together(outs, KeyError, "a head the model does not have")
    assert [o.peer for o in outs] == [True, False]


def _barriers(mesh: fzero.Mesh, stage: int, backend: Any) -> int:
    """How many barriers two steps of two micro-batches each ran (`arrive_alike` counted,
    the compiled loss's barrier)."""
    import fzero._step._compiled as compiled

    state, opt, net = setup(mesh, stage)
    x, y = batches(mesh.size, 4)
    calls = []
    real = compiled.arrive_alike
    compiled.arrive_alike = lambda m, *a: (calls.append(m.rank), real(m, *a))[1]

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        xb, yb = batch
        return (functional_call(net, p, (xb,)) - yb).square().mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, compile=backend, accumulate="sharded"
    )
    for t in (0, 1):
        micro = [(mine(x[2 * t + k], mesh.rank), mine(y[2 * t + k], mesh.rank)) for k in (0, 1)]
        state, _ = step(state, micro)
    return len(calls)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_barrier_runs_once_a_compiled_stage_3_micro_batch(stage: int) -> None:
    """Once per call of the compiled loss (a micro-batch) at stage 3, whose forward
    graph gathers; never at stage 2, nor eagerly."""
    for backend, want in [(False, 0), ("aot_eager", 4 if stage == 3 else 0)]:
        for o in outcomes(2, _barriers, stage, backend):
            assert o.error is None and o.value == want, (backend, o.message, o.value)
