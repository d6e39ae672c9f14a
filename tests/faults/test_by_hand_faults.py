"""Faults around the primitives by hand (`gather_params`, `reduce_scatter_grads`,
`sharded_update`), `shard_state`'s own exchange, and a step's entry: each raises on every
rank at once, as a step does (a fault injector's finds: these waited out the collective
timeout, or let one rank return while another raised)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import fzero
from tests.faults.harness import BOUND, TIMEOUT, outcomes, raised_together, tiny_params
from tests.support import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

D = 6


def _params() -> dict[str, torch.Tensor]:
    return tiny_params(D)


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["w"] + p["b"]).square().mean()


def _batch(mesh: fzero.Mesh, t: int) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(10 * t + mesh.rank))


def _update_fails_then_gather(mesh: fzero.Mesh) -> Any:
    """Rank 0's update raises at stage 3 after the second step's last collective; rank 1
    leaves the step whole and gathers the parameters by hand, where rank 0 never comes."""
    opt = fzero.optim.adam(lr=0.01)
    armed = {"on": False}

    def update_(g: Any, s: Any, p: Any) -> Any:
        if mesh.rank == 0 and armed["on"]:
            raise OSError(5, "the update's disk failed")
        return opt.update_(g, s, p)  # type: ignore[misc]

    state = fzero.shard_state(_params(), opt, mesh, stage=3)
    step = fzero.sharded_step(_loss, opt._replace(update_=update_), mesh, stage=3)
    state, _ = step(state, _batch(mesh, 0).double())
    armed["on"] = True
    try:
        state, _ = step(state, _batch(mesh, 1).double())
    except OSError:
        time.sleep(BOUND + 1)  # alive, as a process that handles its error, calling no more
        raise
    return fzero.gather_params(state.params, mesh)


def test_a_step_failing_after_its_collectives_reaches_a_peer_gathering_by_hand() -> None:
    outs = outcomes(2, _update_fails_then_gather)
    assert outs[0].isinstance(OSError) and not outs[0].peer, outs
    assert outs[1].peer and outs[1].isinstance(OSError), outs
    assert "the update's disk failed" in outs[1].message, outs
    assert outs[1].at - outs[0].at < BOUND, outs  # not the collective timeout


def _primitive_fails_on_rank_1(mesh: fzero.Mesh, which: str) -> Any:
    opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(1.0), fzero.optim.adam(lr=0.01))
    state = fzero.shard_state(_params(), opt, mesh, stage=3)
    odd = mesh.rank == 1
    if which == "gather_params":  # a unit only rank 1 names: its own mistake
        return fzero.gather_params(state.params, mesh, unit="nope" if odd else None)
    full = fzero.gather_params(state.params, mesh)
    grads = torch.func.grad(_loss)(full, _batch(mesh, 0).double())
    if which == "reduce_scatter_grads":  # rank 1's gradient of another dtype
        grads = {k: v.float() if odd else v for k, v in grads.items()}
        return fzero.reduce_scatter_grads(grads, state.layout, mesh)
    shards = fzero.reduce_scatter_grads(grads, state.layout, mesh)
    # sharded_update: rank 1's gradients of another layout (a stage-2 state's), so the
    # clip's norm is never summed across the ranks
    bad = fzero.shard_state({"c": torch.zeros(3, dtype=torch.float64)}, opt, mesh, stage=3)
    shards = fzero.Shards(bad.params.buffers, bad.layout, bad.params.rank) if odd else shards
    return fzero.sharded_update(opt, state.params, shards, state.opt_state, mesh=mesh)


@pytest.mark.parametrize("which", ["gather_params", "reduce_scatter_grads", "sharded_update"])
def test_a_primitive_failing_on_one_rank_raises_on_every_rank(which: str) -> None:
    outs = outcomes(2, _primitive_fails_on_rank_1, which)
    assert outs[1].error is not None and not outs[1].peer, outs
    assert outs[0].peer and outs[0].isinstance(outs[1].error), outs  # its class, as a peer's
    assert outs[0].message == outs[1].message, outs
    assert abs(outs[0].at - outs[1].at) < BOUND, outs


def _layout_exchange_fails(mesh: fzero.Mesh) -> Any:
    """Rank 1's part of shard_state's layout exchange raises (a MemoryError, say), then
    every rank calls shard_state again."""
    real = fzero._comm.all_gather_object

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory for the layout's exchange")

    seen = []
    for attempt in range(2):
        if mesh.rank == 1 and attempt == 0:
            fzero._comm.all_gather_object = failing
        try:
            fzero.shard_state(_params(), fzero.optim.sgd(lr=0.1), mesh, stage=2)
        except Exception as exc:
            seen.append((type(exc).__name__, isinstance(exc, fzero.PeerError), time.time()))
        finally:
            fzero._comm.all_gather_object = real
    return seen


def test_a_rank_failing_in_shard_states_exchange_fails_its_peers_and_its_next_call() -> None:
    """Before, its error was taken for one every rank raised alike: its peer waited out
    the collective timeout, and its next shard_state paired with the peer's pending
    exchange (gloo aborted the peer's process)."""
    outs = outcomes(2, _layout_exchange_fails)
    (first0, again0), (first1, again1) = outs[0].value, outs[1].value
    assert first1[:2] == ("MemoryError", False) and first0[:2] == ("PeerError_MemoryError", True)
    assert abs(first0[2] - first1[2]) < BOUND, outs
    assert again0[1] and again1[1], outs  # the job has failed, on every rank alike
    assert max(again0[2], again1[2]) - first1[2] < TIMEOUT / 2, outs


def _steps_under_inference_mode_on_rank_1(mesh: fzero.Mesh) -> Any:
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=3)
    step = fzero.sharded_step(_loss, opt, mesh, stage=3)
    with torch.inference_mode(mesh.rank == 1):
        return step(state, _batch(mesh, 0).double())


def test_a_step_under_inference_mode_on_one_rank_raises_on_every_rank() -> None:
    outs = outcomes(2, _steps_under_inference_mode_on_rank_1)
    raised_together(outs, RuntimeError, "rank 1: sharded_step", "torch.inference_mode()")
    assert outs[0].peer and not outs[1].peer, outs


def _nested_gather_fails_on_rank_1(mesh: fzero.Mesh) -> Any:
    """Rank 1's gather inside master_params (stage 3) raises before any collective; then
    every rank calls master_params again, as a handler would."""
    state = fzero.shard_state(_params(), fzero.optim.sgd(lr=0.1), mesh, stage=3)
    real = fzero._engine._by_hand.enter

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory for the gather")

    seen = []
    for attempt in range(2):
        if mesh.rank == 1 and attempt == 0:
            fzero._engine._by_hand.enter = failing
        try:
            fzero.master_params(state, mesh)
        except MemoryError as exc:
            seen.append((isinstance(exc, fzero.PeerError), time.time()))
        finally:
            fzero._engine._by_hand.enter = real
    return seen


def test_a_rank_failing_alone_in_a_nested_call_learns_at_once_that_its_peer_waited() -> None:
    """The failure leaves two calls (the gather and master_params around it) and the
    peer marks only the one it waited in: the failing rank's next call waited 60 s for
    word of the other (a reader's find), and now settles both together."""
    outs = outcomes(2, _nested_gather_fails_on_rank_1)
    (first0, again0), (first1, again1) = outs[0].value, outs[1].value
    assert first0[0] and not first1[0] and again0[0] and again1[0], outs
    assert again1[1] - first1[1] < BOUND, outs


def _notes_of_a_failed_update(mesh: fzero.Mesh) -> list[str]:
    opt = fzero.optim.adam(lr=0.01)

    def update_(g: Any, s: Any, p: Any) -> Any:
        raise OSError(5, "the update's disk failed") if mesh.rank == 0 else MemoryError()

    state = fzero.shard_state(_params(), opt, mesh, stage=3)
    step = fzero.sharded_step(_loss, opt._replace(update_=update_), mesh, stage=3)
    try:
        step(state, _batch(mesh, 0).double())
    except (OSError, MemoryError) as exc:
        return list(getattr(exc, "__notes__", []))
    return []


def test_a_failure_is_named_as_the_call_the_user_made() -> None:
    """Not the call inside it: a step's update is `sharded_step`'s, on every rank."""
    notes = [n for ns in run(2, _notes_of_a_failed_update) for n in ns]
    if hasattr(BaseException, "add_note"):  # Python >= 3.11 carries notes
        assert notes and all("sharded_step" in n for n in notes), notes
    assert not any("sharded_update" in n for n in notes), notes


def _step_entry_fails_on_rank_1(mesh: fzero.Mesh) -> Any:
    """Rank 1's step raises as it is entered, before its name is exchanged (a
    KeyboardInterrupt, an out-of-memory in the step's own checks: here the check of
    `module=`'s frozen flags), at its second step; then every rank steps again."""
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(_params(), opt, mesh, stage=0)
    step = fzero.sharded_step(_loss, opt, mesh, stage=0)
    state, _ = step(state, _batch(mesh, 0).double())
    cache = fzero._step._cache.StepCache
    real = cache.flag_changed

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("no memory for the step's checks")

    seen = []
    for attempt in (1, 2):
        if mesh.rank == 1 and attempt == 1:
            cache.flag_changed = failing  # type: ignore[method-assign]
        try:
            state, _ = step(state, _batch(mesh, attempt).double())
            seen.append(("returned", time.time()))
        except MemoryError as exc:
            seen.append((type(exc).__name__, time.time()))
        finally:
            cache.flag_changed = real  # type: ignore[method-assign]
    return seen


def test_a_step_failing_as_it_is_entered_fails_every_rank() -> None:
    """Before, the error came before the step's call was entered: never published, the
    peer waited out the collective timeout, and the failing rank's next step paired with
    the peer's first (a fault injector's find)."""
    outs = outcomes(2, _step_entry_fails_on_rank_1)
    (first0, again0), (first1, again1) = outs[0].value, outs[1].value
    assert first1[0] == "MemoryError" and first0[0] == "PeerError_MemoryError", outs
    assert again0[0] == again1[0] == "PeerError_MemoryError", outs  # the job has failed
    assert abs(first0[1] - first1[1]) < BOUND and again1[1] - first1[1] < BOUND, outs
