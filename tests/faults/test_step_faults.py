"""Faults in a step: one rank's error raises on every rank, at once.

Agreed errors (a loss's value refused, a configuration that differs, a first step
without data where units enter just in time) raise on every rank at the same exchange
and leave the step usable; an exception inside one rank's loss is published and raised
by the others as a `fzero.PeerError` of the same class and message.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.faults.harness import BOUND, outcomes, raised_together

# Every case starts rank processes and takes about a second.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

UNITS = ["a", "b"]
D = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def model() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batches(world: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, world * 2, D, generator=g, dtype=torch.float64)
    return x, x.sum(-1, keepdim=True).sin()


def mine(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x[2 * rank : 2 * rank + 2]


def setup(mesh: fzero.Mesh, stage: int, hooks: bool = True, **options: Any) -> tuple[Any, Any, Net]:
    net = model()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)
    return state, opt, net


def reference(steps: list[int], world: int) -> dict[str, torch.Tensor]:
    """One process, torch.optim.Adam over the concatenated batches of `steps`."""
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=0.05, foreach=False)
    x, y = batches(world, 4)
    for t in steps:
        opt.zero_grad()
        (net(x[t]) - y[t]).square().mean().backward()
        opt.step()
    return {k: v.detach() for k, v in net.named_parameters()}


# -- an exception inside one rank's loss: published, raised by every rank -----------------
def _loss_raises_on_rank_1(
    mesh: fzero.Mesh, stage: int, hooks: bool, error: type[BaseException] = RuntimeError
) -> None:
    state, opt, net = setup(mesh, stage)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: dict, batch: Any) -> torch.Tensor:
        xb, yb, t = batch
        out = functional_call(net, p, (xb,))
        if mesh.rank == 1 and t == 1:
            raise error("rank 1's data loader handed a corrupt batch")
        return (out - yb).square().mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, module=net if hooks else None
    )
    for t in range(3):
        state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank), t))


@pytest.mark.parametrize("hooks", [False, True], ids=["up-front", "hooks"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_exception_in_one_ranks_loss_raises_on_every_rank(stage: int, hooks: bool) -> None:
    outs = outcomes(3, _loss_raises_on_rank_1, stage, hooks)
    raised_together(outs, RuntimeError, "corrupt batch")
    assert [o.peer for o in outs] == [True, False, True]


def _interrupted(mesh: fzero.Mesh, stage: int) -> tuple[str, float]:
    """Rank 1 interrupted (Ctrl-C) inside its loss; each rank's error, and when, caught
    as a handler would before saving."""
    try:
        _loss_raises_on_rank_1(mesh, stage, True, KeyboardInterrupt)
    except BaseException as exc:  # the interrupt is the point
        return f"{type(exc).__name__}: {exc}", time.time()
    return "returned", time.time()


@pytest.mark.parametrize("stage", [0, 3])
def test_an_interrupt_in_one_ranks_loss_raises_on_every_rank(stage: int) -> None:
    """A KeyboardInterrupt is no Exception: it was not published, and the peers waited
    for the collective timeout, then named no rank (a second reader's find)."""
    (said0, at0), (said1, at1) = fzero.Simulation(2, collective_timeout=20).run(_interrupted, stage)
    assert said1 == "KeyboardInterrupt: rank 1's data loader handed a corrupt batch"
    assert said0.startswith("PeerError: ") and "corrupt batch" in said0, said0
    assert abs(at0 - at1) < BOUND


def _bare_interrupt(mesh: fzero.Mesh) -> str:
    """Rank 1's Ctrl-C with no message, inside its loss."""
    state, opt, net = setup(mesh, 0)

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        if mesh.rank == 1:
            raise KeyboardInterrupt
        return functional_call(net, p, (batch,)).sum()

    batch = torch.ones(2, 4, dtype=torch.float64)
    try:
        fzero.sharded_step(loss_fn, opt, mesh, stage=0)(state, batch)
    except BaseException as exc:  # the interrupt is the point
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def test_a_bare_interrupt_is_named_on_its_peers() -> None:
    # Its message is empty: the peer raised PeerError('') and never said KeyboardInterrupt.
    said = fzero.Simulation(2, collective_timeout=20).run(_bare_interrupt)
    assert said == ["PeerError: KeyboardInterrupt", "KeyboardInterrupt: "]


def _forward_fails_alone(mesh: fzero.Mesh, stage: int) -> None:
    """Rank 2's evaluation raises at stages 0-2, where `sharded_forward` sends nothing: its
    peers leave the forward whole and go on to the next step. It lingers in a handler
    (logging, say) before its error ends its process."""
    state, opt, net = setup(mesh, stage, hooks=False)
    x, y = batches(mesh.size, 2)
    step = fzero.sharded_step(
        lambda p, b: (functional_call(net, p, (b[0],)) - b[1]).square().mean(),
        opt, mesh, stage=stage, units=UNITS,
    )  # fmt: skip

    def evaluate(p: Any, batch: Any) -> torch.Tensor:
        if mesh.rank == 2:
            raise ValueError("rank 2's evaluation set is empty")
        return functional_call(net, p, (batch,))

    forward = fzero.sharded_forward(evaluate, mesh)
    state, _ = step(state, (mine(x[0], mesh.rank), mine(y[0], mesh.rank)))
    try:
        forward(state, mine(x[1], mesh.rank))
    except ValueError:
        time.sleep(6)  # the handler: its process stays alive meanwhile
        raise
    step(state, (mine(x[1], mesh.rank), mine(y[1], mesh.rank)))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_a_forward_that_fails_alone_reaches_its_peers_next_step(stage: int) -> None:
    # The peers waited in the next step until the failed rank's process ended, then
    # blamed a healthy rank for the closed connection, and never said the error.
    outs = outcomes(3, _forward_fails_alone, stage)
    assert [o.peer for o in outs] == [True, True, False]
    assert all(o.isinstance(ValueError) and "evaluation set is empty" in o.message for o in outs)
    peers = [o.at for o in outs[:2]]
    assert max(peers) - min(peers) < BOUND and outs[2].at - max(peers) > 3  # in its 6 s


def _then_again(mesh: fzero.Mesh) -> None:
    """A step after a published failure raises at once: its collectives could never end."""
    with contextlib.suppress(RuntimeError):
        _loss_raises_on_rank_1(mesh, 3, True)
    state, opt, _net = setup(mesh, 3)
    step = fzero.sharded_step(lambda p, b: p["a.weight"].sum(), opt, mesh, stage=3, units=UNITS)
    step(state, None)


def test_after_a_published_failure_every_call_raises_it_again_at_once() -> None:
    outs = outcomes(2, _then_again)
    raised_together(outs, RuntimeError, "corrupt batch")
    assert all(o.peer for o in outs)


def _update_fails_on_rank_0(mesh: fzero.Mesh) -> Any:
    """Stage 3, rank 0's update raises at the second step, after the step's last
    collective: rank 1 finishes that step and waits in the next for a rank that joins no
    more. Rank 0 stays alive, as a process that handles its error would."""
    state, opt, net = setup(mesh, 3)
    armed = {"on": False}

    def update_(g: Any, s: Any, p: Any) -> Any:
        if armed["on"] and mesh.rank == 0:
            raise OSError(5, "the update's disk failed")
        return opt.update_(g, s, p)  # type: ignore[misc]

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        return (functional_call(net, p, (b[0],)) - b[1]).square().mean()

    step = fzero.sharded_step(loss_fn, opt._replace(update_=update_), mesh, stage=3, units=UNITS)
    x, y = batches(mesh.size, 3)
    for t in range(3):
        armed["on"] = t == 1
        try:
            state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank)))
        except OSError:
            if mesh.rank == 0:
                failed = time.time()
                time.sleep(BOUND + 1)  # alive, calling fzero no more
                return t, failed
            raise
    return "no error"


def test_a_failure_after_a_steps_last_collective_reaches_a_peers_next_step() -> None:
    # The peer's next step looked only for failures of the call it was in: it waited for
    # the collective timeout and raised that, not rank 0's error.
    outs = outcomes(2, _update_fails_on_rank_0)
    step, failed = outs[0].value
    assert step == 1, outs
    assert outs[1].peer and outs[1].isinstance(OSError), outs
    assert "the update's disk failed" in outs[1].message, outs
    assert outs[1].at - failed < BOUND, outs  # not the 20 s collective timeout


# -- a loss whose value is refused: agreed at the call check, the step stays usable ---------
BAD = {
    "nan weight": lambda out: (out.sum(), float("nan")),
    "negative weight": lambda out: (out.sum(), -1.0),
    "infinite weight": lambda out: (out.sum(), float("inf")),
    "non-scalar loss": lambda out: out,
    "no grad": lambda out: out.mean(),
}


def _bad_then_good(mesh: fzero.Mesh, stage: int, hooks: bool, bad: str) -> dict[str, Any]:
    state, opt, net = setup(mesh, stage)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: dict, batch: Any) -> Any:
        xb, yb, t = batch
        faulty = t == 0 and mesh.rank == mesh.size - 1
        with torch.no_grad() if faulty and bad == "no grad" else contextlib.nullcontext():
            out = (functional_call(net, p, (xb,)) - yb).square()  # one forward, as the others
        return BAD[bad](out) if faulty else out.mean()

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, module=net if hooks else None
    )
    try:
        step(state, (mine(x[0], mesh.rank), mine(y[0], mesh.rank), 0))
    except (TypeError, ValueError) as exc:
        error = (type(exc).__name__, str(exc))
    else:
        error = None
    for t in (1, 2):  # the state was not consumed: the run goes on
        state, _ = step(state, (mine(x[t], mesh.rank), mine(y[t], mesh.rank), t))
    return {"error": error, "params": fzero.gather_params(state.params, mesh)}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize(("stage", "hooks"), [(0, False), (3, False), (3, True)])
def test_a_refused_loss_on_one_rank_raises_on_every_rank_and_the_run_goes_on(
    stage: int, hooks: bool, bad: str
) -> None:
    outs = outcomes(2, _bad_then_good, stage, hooks, bad)
    errors = [o.value["error"] for o in outs]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert f"rank {1}" in errors[0][1]
    want = reference([1, 2], 2)
    for o in outs:
        fzero.assert_trees_close(o.value["params"], want, rtol=1e-10, atol=1e-12)
        assert not torch.equal(o.value["params"]["a.weight"], model().a.weight)


def test_a_loss_without_grad_on_every_rank_is_refused() -> None:
    def run(mesh: fzero.Mesh) -> None:
        state, opt, net = setup(mesh, 1)

        def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return functional_call(net, p, (xb,)).square().mean()

        step = fzero.sharded_step(loss_fn, opt, mesh, stage=1, units=UNITS)
        step(state, torch.ones(2, D, dtype=torch.float64))

    raised_together(outcomes(2, run), ValueError, "does not require grad", "torch.no_grad()")


# -- configuration that differs across ranks: agreed on the first step ----------------------
def _differ(mesh: fzero.Mesh, what: str) -> None:
    odd = mesh.rank % 2 == 1
    options: dict[str, Any] = {}
    stage = step_stage = 3
    if what == "reshard_after_forward":
        options["reshard_after_forward"] = 2 if odd else True
    elif what == "quantize":
        options["quantize"] = fzero.QuantizedComm(weights=True, grads=True) if odd else None
    elif what == "accumulate":
        options["accumulate"] = "local" if odd else None
    elif what == "stage":
        step_stage = 2 if odd else 3
    elif what == "units":
        pass
    state_units = ["a"] if what == "units" and odd else UNITS
    net = model()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adam(lr=0.5 if odd and what == "optimizer" else 0.05)
    if what == "torch optimizer":  # from_torch: the class and its options, shown
        opt = fzero.optim.from_torch(torch.optim.SGD if odd else torch.optim.Adam, lr=0.05)
    if what == "clipping":  # a chain's transformations
        clip = fzero.optim.clip_by_global_norm(2.0 if odd else 1.0)
        opt = fzero.optim.chain(clip, fzero.optim.adam(lr=0.05))
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=state_units)
    x = torch.ones(2, D, dtype=torch.float64)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=step_stage, module=net, **options)
    batch = [x] if options.get("accumulate") else x
    step(state, batch)


@pytest.mark.parametrize("what", ["reshard_after_forward", "quantize", "accumulate"])
def test_options_that_differ_across_ranks_raise_on_every_rank_naming_each_value(what: str) -> None:
    outs = outcomes(4, _differ, what)
    raised_together(outs, ValueError, "the ranks' steps differ", what, "rank 0:", "rank 3:")


@pytest.mark.parametrize(
    ("what", "shown"),
    [
        ("optimizer", "lr=0.5"),
        ("torch optimizer", "optimizer_cls=SGD"),
        ("clipping", "max_norm=2.0"),  # past a long common start: the window shows it
    ],
)
def test_optimizers_that_differ_across_ranks_raise_on_every_rank(what: str, shown: str) -> None:
    """Every fzero optimizer's `update` is one function (`from_inplace`'s), so ranks at
    other learning rates, or with other torch classes, trained on, each rank updating its
    own shard its own way (a second reader's find)."""
    outs = outcomes(4, _differ, what)
    raised_together(outs, ValueError, "the ranks' steps differ (optimizer: rank 0:", shown)


def test_a_step_for_another_stage_on_some_ranks_raises_on_every_rank() -> None:
    outs = outcomes(4, _differ, "stage")
    raised_together(outs, ValueError, "rank 1", "rank 3", "this step is for stage 2")


def test_units_that_differ_across_ranks_raise_on_every_rank() -> None:
    # shard_state agrees on the layout before any step: its error, on every rank.
    outs = outcomes(2, _differ, "units")
    raised_together(outs, ValueError)


def _micro_counts(mesh: fzero.Mesh, accumulate: str, later: bool) -> None:
    state, opt, net = setup(mesh, 3)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=net, accumulate=accumulate)
    x = torch.ones(2, D, dtype=torch.float64)
    if later:
        state, _ = step(state, [x, x])
    step(state, [x] * (2 + mesh.rank))


@pytest.mark.parametrize("later", [False, True], ids=["first step", "later step"])
@pytest.mark.parametrize("accumulate", ["local", "sharded"])
def test_micro_batch_counts_that_differ_raise_on_every_rank(accumulate: str, later: bool) -> None:
    outs = outcomes(3, _micro_counts, accumulate, later)
    raised_together(outs, ValueError, "micro-batch", "rank 0: 2", "rank 2: 4", "pad a short rank")


def _first_step_without_data(mesh: fzero.Mesh) -> None:
    state, opt, net = setup(mesh, 3)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=net)
    step(state, None if mesh.rank == 1 else torch.ones(2, D, dtype=torch.float64))


def test_a_first_step_without_data_with_just_in_time_units_raises_on_every_rank() -> None:
    outs = outcomes(3, _first_step_without_data)
    raised_together(outs, ValueError, "rank(s) [1]", "first call")


# -- an optimizer state another optimizer made ------------------------------------------------
def _foreign(mesh: fzero.Mesh, made: str, steps: str) -> None:
    optimizers = {
        "adam": fzero.optim.adam(lr=0.1),
        "sgd": fzero.optim.sgd(lr=0.1),
        "momentum": fzero.optim.sgd(lr=0.1, momentum=0.9),
    }
    net = model()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    state = fzero.shard_state(params, optimizers[made], mesh, stage=1)
    step = fzero.sharded_step(
        lambda p, xb: functional_call(net, p, (xb,)).square().mean(),
        optimizers[steps],
        mesh,
        stage=1,
    )
    step(state, torch.ones(2, D, dtype=torch.float64))


@pytest.mark.parametrize(
    ("made", "steps"), [("adam", "sgd"), ("sgd", "momentum"), ("momentum", "adam")]
)
def test_an_optimizer_state_from_another_optimizer_raises_naming_both(
    made: str, steps: str
) -> None:
    outs = outcomes(2, _foreign, made, steps)
    raised_together(outs, TypeError, "not this step's optimizer's", "rank 0", "rank 1")


def _consumed_on_one_rank(mesh: fzero.Mesh) -> None:
    state, opt, net = setup(mesh, 2)
    step = fzero.sharded_step(
        lambda p, xb: functional_call(net, p, (xb,)).square().mean(), opt, mesh, stage=2
    )
    x = torch.ones(2, D, dtype=torch.float64)
    new, _ = step(state, x)
    step(state if mesh.rank == 0 else new, x)  # rank 0 steps the state it gave away


def test_a_consumed_state_on_one_rank_at_a_later_step_raises_on_every_rank() -> None:
    outs = outcomes(2, _consumed_on_one_rank)
    raised_together(outs, ValueError, "rank 0", "already donated")
    assert [o.peer for o in outs] == [False, True]


def _state_differs(mesh: fzero.Mesh, what: str) -> None:
    odd = mesh.rank % 2 == 1
    net = model()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    options: dict[str, Any] = {}
    if what == "precision" and odd:
        options["precision"] = fzero.Precision(param_dtype=torch.float32)
    if what == "layout":
        options["layout"] = "tensor" if odd else "flat"
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS, **options)
    step = fzero.sharded_step(
        lambda p, xb: functional_call(net, p, (xb,)).square().mean(), opt, mesh, stage=3
    )
    step(state, torch.ones(2, D, dtype=torch.float64))


@pytest.mark.parametrize("what", ["precision", "layout"])
def test_states_built_differently_across_ranks_raise_on_every_rank(what: str) -> None:
    raised_together(outcomes(2, _state_differs, what), ValueError)


def test_a_mesh_shape_that_differs_across_ranks_raises_on_every_rank() -> None:
    def mesh_of(mesh: fzero.Mesh) -> None:
        fzero.ProcessGroupMesh(shard_size=2 if mesh.rank == 0 else 4)

    raised_together(outcomes(4, mesh_of), ValueError, "shard_size", "rank 0: 2")


# -- found by a second reader -------------------------------------------------------------------
class DataError(Exception):
    """A user's own exception class, deriving from Exception alone."""


def _user_exception(mesh: fzero.Mesh) -> None:
    state, opt, net = setup(mesh, 2)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        if mesh.rank == 1:
            raise DataError("shard 17 is unreadable")
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=2, units=UNITS)
    step(state, torch.ones(2, D, dtype=torch.float64))


def test_a_users_own_exception_class_reaches_every_rank() -> None:
    outs = outcomes(2, _user_exception)
    raised_together(outs, Exception, "shard 17 is unreadable")
    assert outs[0].isinstance(fzero.PeerError) and outs[1].error is DataError


def _same_mistake_then_right(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    net = model()
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    with contextlib.suppress(ValueError):  # every rank makes it: nothing is left pending
        fzero.shard_state(params, opt, mesh, stage=7)
    state = fzero.shard_state(params, opt, mesh, stage=1)
    step = fzero.sharded_step(
        lambda p, b: (functional_call(net, p, (b[0],)) - b[1]).square().mean(), opt, mesh, stage=1
    )
    x, y = batches(mesh.size, 4)
    x0 = (mine(x[0], mesh.rank), mine(y[0], mesh.rank))
    with contextlib.suppress(ValueError):  # the same consumed state on every rank
        new, _ = step(state, x0)
        step(state, x0)
    state = new
    state, _ = step(state, (mine(x[1], mesh.rank), mine(y[1], mesh.rank)))
    return fzero.gather_params(state.params, mesh)


def test_the_same_mistake_on_every_rank_leaves_the_job_usable() -> None:
    outs = outcomes(2, _same_mistake_then_right)
    for o in outs:
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, reference([0, 1], 2), rtol=1e-10, atol=1e-12)


def _one_against_two(mesh: fzero.Mesh) -> None:
    state, opt, net = setup(mesh, 1)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=1, units=UNITS, accumulate="local")
    x = torch.ones(2, D, dtype=torch.float64)
    state, _ = step(state, [x, x])
    step(state, [x] * (1 + mesh.rank))


def test_one_micro_batch_against_two_with_local_accumulation_raises_on_every_rank() -> None:
    raised_together(outcomes(2, _one_against_two), ValueError, "rank 0: 1, rank 1: 2")


def _refused_in_the_middle(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    state, opt, net = setup(mesh, 2)
    x, y = batches(mesh.size, 4)

    def loss_fn(p: dict, b: Any) -> Any:
        xb, yb, bad = b
        out = (functional_call(net, p, (xb,)) - yb).square()
        return (out.sum(), -1.0 if bad and mesh.rank == 1 else float(out.numel()))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=2, units=UNITS, accumulate="sharded")

    def three(t: int, bad: bool) -> list[Any]:
        xs, ys = mine(x[t], mesh.rank), mine(y[t], mesh.rank)
        return [(xs[:1], ys[:1], False), (xs[1:], ys[1:], bad), (xs[:0], ys[:0], False)]

    with contextlib.suppress(ValueError):
        step(state, three(0, True))
        raise AssertionError("the refused weight was not raised")
    state, _ = step(state, three(1, False))
    return fzero.gather_params(state.params, mesh)


def test_a_refused_loss_in_a_middle_micro_batch_is_agreed_and_the_run_goes_on() -> None:
    outs = outcomes(2, _refused_in_the_middle)
    for o in outs:
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, reference([1], 2), rtol=1e-10, atol=1e-12)


def _late_rank_big_unit(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    # A 9 MB unit: gloo reduce-scatters it with point-to-point messages, whose waits must
    # not be cut into slices (a timed-out slice breaks the group).
    torch.manual_seed(0)
    net = nn.Linear(1500, 1500)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=2)

    def loss_fn(p: dict, xb: torch.Tensor) -> torch.Tensor:
        if mesh.rank == 1:
            time.sleep(0.3)
        return functional_call(net, p, (xb,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=2)
    x = torch.randn(4, 1500, generator=torch.Generator().manual_seed(2))
    state, _ = step(state, x[2 * mesh.rank : 2 * mesh.rank + 2])
    # The whole unit: the flat layout puts the bias in rank 0's shard, the weight across
    # both, so rank 1's reduced part is all weight.
    return dict(fzero.gather_params(state.params, mesh))


def test_a_late_rank_with_a_unit_reduced_point_to_point_trains() -> None:
    outs = outcomes(2, _late_rank_big_unit)
    torch.manual_seed(0)
    net = nn.Linear(1500, 1500)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 1500, generator=torch.Generator().manual_seed(2))
    net(x).square().mean().backward()
    opt.step()
    for o in outs:
        assert o.error is None, o.message
        for k, p in net.named_parameters():
            torch.testing.assert_close(o.value[k], p.detach(), rtol=1e-5, atol=1e-6, msg=k)


def _alone_then_again(mesh: fzero.Mesh) -> None:
    """Rank 0 fails alone before any collective and goes on; its peer was left waiting."""
    with contextlib.suppress(ValueError):
        _consumed_on_one_rank(mesh)
    setup(mesh, 2)  # collectives rank 0's peer will never join


def test_a_rank_that_failed_alone_learns_its_peers_were_left_waiting() -> None:
    outs = outcomes(2, _alone_then_again)
    raised_together(outs, ValueError, "rank 0", "already donated")
    assert all(o.peer for o in outs)


# -- an exception inside one rank's `bind` block: the others' gathers do not wait it out --
def _bind_raises_on_rank_1(mesh: fzero.Mesh) -> None:
    state, _opt, net = setup(mesh, 3)
    x, _ = batches(mesh.size, 4)
    with fzero.bind(net, state, mesh):
        for t in range(3):  # an evaluation loop: a forward per batch
            if mesh.rank == 1 and t == 1:
                raise ValueError("rank 1's metric got a label it does not know")
            net(mine(x[t], mesh.rank))


def test_an_exception_inside_one_ranks_bind_block_raises_on_every_rank() -> None:
    outs = outcomes(3, _bind_raises_on_rank_1)
    raised_together(outs, ValueError, "label it does not know")
    assert [o.peer for o in outs] == [True, False, True]


def _closed_generator(mesh: fzero.Mesh) -> Any:
    """A streaming evaluation: a generator yielding from inside `bind`, which every rank
    stops after its first batch (`close()` raises GeneratorExit inside the block), then
    a step; the parameters after it."""
    state, opt, net = setup(mesh, 3)

    def predictions(batches: list) -> Any:
        with fzero.bind(net, state, mesh) as m:
            for x in batches:
                yield m(x)

    x, y = batches(mesh.size, 4)
    gen = predictions([mine(x[0], mesh.rank)] * 3)
    next(gen)
    gen.close()
    step = fzero.sharded_step(
        lambda p, b: (functional_call(net, p, (b[0],)) - b[1]).square().mean(),
        opt, mesh, stage=3, units=UNITS,
    )  # fmt: skip
    state, _ = step(state, (mine(x[1], mesh.rank), mine(y[1], mesh.rank)))
    return fzero.gather_params(state.params, mesh)


def test_a_generator_closed_inside_bind_is_no_failure() -> None:
    """GeneratorExit inside a call is every rank stopping its consumer, not one rank
    failing: published as a failure, it failed every later call (a second reader's find,
    after the interrupt above was made to publish)."""
    want = reference([1], 2)
    for o in outcomes(2, _closed_generator):
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, want, rtol=1e-10, atol=1e-12)
