"""Stage 3's forward gathers start in the order the forward waits for them."""

from typing import Any

import pytest
import torch

import fzero
import fzero._engine._gatherer as gatherer_module
from tests.engine.test_units import make_case, reference, train
from tests.support import run

DIMS = [3, 4, 4, 4, 2]
UNITS = [f"layers.{i}" for i in range(len(DIMS) - 1)]


class _Logged:
    """A gather in flight that notes when it is waited for."""

    def __init__(self, work: Any, log: list[tuple[str, str]], unit: str) -> None:
        self.work, self.log, self.unit = work, log, unit

    def wait(self) -> None:
        self.log.append(("wait", self.unit))
        if self.work is not None:
            self.work.wait()


def logged_training(mesh: fzero.Mesh, case: dict, **options: Any) -> tuple[Any, list[list[Any]]]:
    """`train` with every step's parameter gathers logged, start and wait, by unit (the
    root is ""), read from the message fzero attaches to each."""
    real = gatherer_module._comm.all_gather_async
    steps: list[list[tuple[str, str]]] = []

    def gather(*args: Any, what: str | None = None, **kwargs: Any) -> Any:
        out, work = real(*args, what=what, **kwargs)
        if what is None or "the parameters of unit " not in what:  # not a step's gather
            return out, work
        unit = what.split("unit ")[-1].strip("'")
        steps[-1].append(("start", unit))
        return out, _Logged(work, steps[-1], unit)

    real_step = fzero.sharded_step

    def sharded_step(*args: Any, **kwargs: Any) -> Any:
        inner = real_step(*args, **kwargs)

        def step(state: Any, batch: Any) -> Any:
            steps.append([])
            return inner(state, batch)

        return step

    gatherer_module._comm.all_gather_async = gather
    fzero.sharded_step = sharded_step
    try:
        params, _, _ = train(mesh, case, UNITS, 3, **options)
    finally:
        gatherer_module._comm.all_gather_async = real
        fzero.sharded_step = real_step
    return params, steps


@pytest.mark.multiprocess
def test_units_entered_up_front_are_gathered_together() -> None:
    # No module= and no just_in_time: every unit enters before the forward. Their gathers
    # used to start one at a time, each waited for before the next began (one round trip
    # per unit before the forward could start); they all start, then are waited for.
    case = make_case(DIMS, 2, seed=3)
    expected = reference(case)
    for params, steps in run(2, logged_training, case):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        assert not torch.equal(params["layers.0.weight"], case["model"].layers[0].weight)
        for log in steps:
            starts = [u for what, u in log if what == "start"]
            assert sorted(starts) == sorted(["", *UNITS]), log
            first_wait = next(k for k, (what, _) in enumerate(log) if what == "wait")
            assert first_wait == len(starts), log  # every start before any wait


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [True, False])
def test_the_root_is_gathered_before_the_first_units_are_prefetched(prefetch: bool) -> None:
    # With module hooks the root (the scale and the unused layer) enters before the
    # forward and every layer just in time. Gloo runs a group's collectives in the order
    # they start: a root gathered behind the prefetch of the first layers waited for them.
    case = make_case(DIMS, 2, seed=4)
    expected = reference(case)
    for params, steps in run(2, logged_training, case, module=case["model"], prefetch=prefetch):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        for t, log in enumerate(steps):
            assert log[0] == ("start", ""), log
            ahead = [u for what, u in log[1 : log.index(("wait", ""))] if what == "start"]
            # From the second step on, last step's order is known: the first layers go
            # ahead (up to the largest unit's size), started while the root travels.
            assert ahead == (["layers.0", "layers.1"] if prefetch and t > 0 else []), log
