"""Offloaded buckets stepped while the backward goes on: the same training, bitwise, as the
update after the backward (and as without offload), torch's to 1e-10 over uneven work, and
the host's update provably running before the backward is done."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
from tests.engine.test_gathered import gathered_mlp_loss
from tests.state.test_offload import DIMS as MLP_DIMS
from tests.state.test_offload import LAYER_UNITS, batches
from tests.step.test_weights import (
    UNITS,
    _weighs,
    make_data,
    pair_loss,
    reference,
    scalar_loss,
    uneven,
)
from tests.support import make_optimizer, make_params, run

OFFLOAD_THREAD = "fzero-offload"


def spied(opt: fzero.optim.Optimizer, threads: list[str]) -> fzero.optim.Optimizer:
    """`opt`, recording the thread of each in-place update."""
    assert opt.update_ is not None

    def update_(g: Any, s: Any, p: Any) -> Any:
        threads.append(threading.current_thread().name)
        return opt.update_(g, s, p)

    return opt._replace(update_=update_)


def train(
    mesh: fzero.Mesh,
    params: Any,
    data: list,
    kind: str,
    stage: int,
    layout: str,
    accumulate: str | None,
    jit: bool,
    offload: fzero.Offload | None,
) -> tuple[Any, list[list[str]], bool]:
    """The masters after the steps, per step the threads that updated, and whether this
    rank owns a piece of an offloaded bucket."""
    threads: list[str] = []
    opt = spied(make_optimizer("adamw"), threads)
    units = UNITS
    state = fzero.shard_state(
        params, opt, mesh, stage=stage, units=units, layout=layout, offload=offload
    )
    base = pair_loss if kind == "pair" else scalar_loss

    def loss_fn(p: Any, batch: tuple) -> Any:
        return base(p, batch, jit)

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=units, accumulate=accumulate, just_in_time=jit
    )
    per_step = []
    for t, per_rank in enumerate(data):
        micro = per_rank[mesh.rank]
        if accumulate is None:
            batch = micro[0]
        else:
            batch = None if t and all(mb is None for mb in micro) else micro
        with warnings.catch_warnings():  # a step where nothing counts says so
            warnings.filterwarnings("ignore", "fzero: step .* weights sum to 0")
            state, _ = step(state, batch)
        per_step.append(list(threads))
        threads.clear()
    owns = state.offload is not None and owns_offloaded(state)
    return fzero.master_params(state, mesh), per_step, owns


def owns_offloaded(state: fzero.ShardedState) -> bool:
    """Whether this rank updates any piece of an offloaded bucket (the tensor layout
    gives a rank whole tensors, possibly none of an offloaded bucket)."""
    assert state.offload is not None
    lay, rank = state.layout, state.master.rank
    return any(lay.bucket_pieces(k, state.master.buffers[k], rank) for k in state.offload.buckets)


@st.composite
def overlapping(draw: Any) -> dict[str, Any]:
    """test_weights' uneven work, at stages 1-3, offloaded."""
    c = draw(uneven())
    return c | {
        "stage": draw(st.integers(1, 3)),
        "layout": draw(st.sampled_from(["flat", "tensor"])),
        "tier": draw(st.sampled_from(["host", "disk"])),
        "fraction": draw(st.sampled_from([1.0, 0.5])),
    }


@pytest.mark.multiprocess
@settings(max_examples=10)
@given(overlapping())
def test_buckets_stepped_during_the_backward_train_as_after_it_and_as_torch(
    tmp_path_factory: Any, c: dict[str, Any]
) -> None:
    """Float64 AdamW over uneven work (pairs and scalars, ranks and steps without data,
    accumulation): the masters equal torch.optim's on the global mean (1e-10) and, bitwise,
    those without offload. The first step that updates runs after its backward (it shows
    the optimizer never asks for the global norm); every later one that updates steps
    offloaded buckets on the host thread."""
    directory = str(tmp_path_factory.mktemp("overlap")) if c["tier"] == "disk" else None
    offload = fzero.Offload(c["tier"], c["fraction"], directory)
    params = make_params([3, 4, 4, 2], torch.float64, c["seed"])
    data = make_data(c["sizes"], c["seed"])
    want = reference(params, data, c["kind"], "adamw")
    args = (params, data, c["kind"], c["stage"], c["layout"], c["accumulate"], c["jit"])
    plain = run(c["world"], train, *args, None)
    got = run(c["world"], train, *args, offload)
    weighs = [_weighs(step, c["kind"]) for step in data]
    first = weighs.index(True) if any(weighs) else len(data)
    for rank, ((masters, threads, owns), (same, _, _)) in enumerate(zip(got, plain)):
        fzero.assert_trees_close(masters, same, rtol=0, atol=0, what=f"rank {rank} {c}")
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12, what=f"rank {rank} {c}")
        for t, names in enumerate(threads):
            early = OFFLOAD_THREAD in "".join(names)
            assert early == (t > first and weighs[t] and owns), (t, names, c)
    if any(weighs):
        assert fzero._core._tree.max_abs_diff(got[0][0], params) > 1e-4


def rank_batch(mesh: fzero.Mesh, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    """This rank's rows of a step's global batch."""
    n = x.shape[0] // mesh.size
    return x[mesh.rank * n : (mesh.rank + 1) * n], y[mesh.rank * n : (mesh.rank + 1) * n]


class Gate(torch.autograd.Function):
    """Identity whose backward waits (up to `wait` s) until `opened` is set and records
    whether it was: an offloaded bucket updated before the backward reached here. Then
    raises `fail` if given (a backward failing after buckets were handed over)."""

    @staticmethod
    def forward(
        x: torch.Tensor, opened: threading.Event, seen: list, fail: Any, wait: float
    ) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.opened, ctx.seen, ctx.fail, ctx.wait = inputs[1:]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, None, None, None, None]:
        ctx.seen.append(ctx.opened.wait(timeout=ctx.wait))
        if ctx.fail is not None:
            raise ctx.fail
        return g, None, None, None, None


def gated(
    mesh: fzero.Mesh,
    params: Any,
    xs: Any,
    ys: Any,
    stage: int,
    offload: Any,
    fail_at: int = -1,
    wait: float = 20.0,
) -> Any:
    """Three tanh layers entered just in time (a unit's gradient is complete when its
    backward is: units entered before the forward complete theirs only at the end, as
    autograd runs their nodes last), the backward between the first and second waiting
    for the host thread's first update (from the second step on). At step `fail_at`, rank
    0's backward raises there: returns that error, and what a later use of the state
    given to that step is told (after a failure every fzero call raises it again anyway:
    docs/failures.md)."""
    opened, seen, threads = threading.Event(), [], []
    adamw = fzero.optim.adamw(lr=0.05, weight_decay=0.1)
    state = fzero.shard_state(params, adamw, mesh, stage=stage, units=LAYER_UNITS, offload=offload)

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        h = x
        for i in range(len(LAYER_UNITS)):
            layer = fzero.gathered(p, f"layers.{i}")
            h = torch.tanh(h @ layer["w"] + layer["b"])
            if i == 0 and offload is not None and state.step > 0:
                boom = RuntimeError("boom") if state.step == fail_at and mesh.rank == 0 else None
                h = Gate.apply(h, opened, seen, boom, wait)
        return ((h * p["scale"] + p["shift"] - y) ** 2).mean()

    def opens(g: Any, s: Any, p: Any) -> Any:
        if threading.current_thread().name.startswith(OFFLOAD_THREAD):
            opened.set()
        return spied_update(g, s, p)

    spied_update = spied(adamw, threads).update_
    opt = adamw._replace(update_=opens)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=LAYER_UNITS, just_in_time=True)
    for t in range(xs.shape[0]):
        opened.clear()
        try:
            new, _ = step(state, rank_batch(mesh, xs[t], ys[t]))
        except RuntimeError as exc:
            if t != fail_at:
                raise
            with pytest.raises(ValueError) as again:  # any later use refuses it
                fzero._state.check_live(state, mesh.rank, "a later step")
            return exc, str(again.value)
        state = new
    return fzero.master_params(state, mesh), seen


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_the_host_updates_a_bucket_before_the_backward_is_done(stage: int) -> None:
    """The backward of the first layer cannot finish until the host thread has updated an
    offloaded bucket (the last layer's, reduced first): it waits for it (20 s at most)
    and sees it, on every rank, at steps 2 and 3. The result is bitwise the run with
    every unit stepped after the backward, and the run without offload."""
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(3, 2, 1)
    got = run(2, gated, params, xs, ys, stage, fzero.Offload("host"))
    late = run(2, gated, params, xs, ys, stage, fzero.Offload("host", overlap=False), wait=0.5)
    plain = run(2, gated, params, xs, ys, stage, None)
    for (masters, seen), (after, never), (same, _) in zip(got, late, plain):
        assert seen == [True, True] and never == [False, False]
        fzero.assert_trees_close(masters, after, rtol=0, atol=0)
        fzero.assert_trees_close(masters, same, rtol=0, atol=0)


@pytest.mark.multiprocess
def test_a_backward_that_fails_after_buckets_were_updated_consumes_the_state() -> None:
    """Rank 0's backward raises after the host thread updated a bucket in place: every
    rank raises (rank 0 its error, rank 1 the peer's), each saying which buckets it had
    begun updating, and the state given to the step is refused from then on (it is
    neither the old state nor the new)."""
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(3, 2, 1)
    for rank, (exc, again) in enumerate(run(2, gated, params, xs, ys, 3, fzero.Offload(), 1)):
        assert "boom" in str(exc) and (rank == 0) != isinstance(exc, fzero.PeerError)
        notes = " ".join(getattr(exc, "__notes__", []))
        assert "had updated buckets" in notes and "consumed" in notes
        assert "already donated" in again


def half_updated(mesh: fzero.Mesh, params: Any, xs: Any, ys: Any, overlap: bool) -> Any:
    """An optimizer whose second call of a step raises (a transform refusing a gradient,
    before adamw): the units are stepped one by one, the first already written then. The
    error's notes, and what a later use of the state given to the step is told."""
    calls = {"armed": False, "n": 0}

    def refuse_second(g: Any, s: Any, p: Any) -> Any:
        calls["n"] += calls["armed"]
        if calls["n"] == 2:
            raise FloatingPointError("refused")
        return g, s

    refusing = fzero.optim.GradientTransformation(lambda p: (), refuse_second)
    opt = fzero.optim.chain(refusing, fzero.optim.adamw(lr=0.05))
    offload = fzero.Offload("host", overlap=overlap)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=LAYER_UNITS, offload=offload)
    step = fzero.sharded_step(gathered_mlp_loss, opt, mesh, stage=3, units=LAYER_UNITS)
    state, _ = step(state, (xs[0], ys[0]))
    calls["armed"] = True
    with pytest.raises(FloatingPointError) as info:
        step(state, (xs[1], ys[1]))
    try:
        fzero._state.check_live(state, mesh.rank, "a later step")
    except ValueError as exc:
        return " ".join(getattr(info.value, "__notes__", [])), str(exc)
    return " ".join(getattr(info.value, "__notes__", [])), "live"


@pytest.mark.multiprocess
@pytest.mark.parametrize("overlap", [True, False])
def test_an_update_failing_after_a_unit_was_written_consumes_the_state(overlap: bool) -> None:
    # Updated after the backward (the first step that overlaps is the second; overlap
    # off), the units before the failing one were written in place and the state was
    # left usable: a retry or a save used a half-updated state, silently (one rank).
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(2, 1, 1)
    notes, again = run(1, half_updated, params, xs, ys, overlap)[0]
    assert "had updated buckets" in notes and "consumed" in notes, notes
    assert "already donated" in again


def refused_then_trained(mesh: fzero.Mesh, params: Any, xs: Any, ys: Any) -> Any:
    """(total, count) losses, rank 1's weight NaN at the third step: every rank raises
    there; the state, untouched, trains on. Units enter before the forward: the call
    check compares no calls, so it does not gate the backward, and the step learns of the
    refused loss from its words (`CallCheck.peek`) while buckets are being reduced.
    Returns the masters and the threads that updated, per step."""
    threads: list[str] = []
    opt = spied(fzero.optim.adamw(lr=0.05, weight_decay=0.1), threads)
    state = fzero.shard_state(
        params, opt, mesh, stage=3, units=LAYER_UNITS, offload=fzero.Offload("host")
    )
    before = None

    def loss_fn(p: Any, batch: Any) -> Any:
        x, y, bad = batch
        h = x
        for layer in p["layers"]:
            h = torch.tanh(h @ layer["w"] + layer["b"])
        total = ((h * p["scale"] + p["shift"] - y) ** 2).mean(-1).sum()
        return total, torch.tensor(float("nan") if bad else float(x.shape[0]))

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, units=LAYER_UNITS)
    per_step = []
    for t in range(xs.shape[0]):
        x, y = rank_batch(mesh, xs[t], ys[t])
        bad = t == 2 and mesh.rank == 1
        if t == 2:
            before = [b.clone() for b in state.master.buffers]
            with pytest.raises(ValueError, match="weight"):
                step(state, (x, y, bad))
            assert all(torch.equal(a, b) for a, b in zip(before, state.master.buffers))
        state, _ = step(state, (x, y, False))
        per_step.append(list(threads))
        threads.clear()
    return fzero.master_params(state, mesh), per_step


@pytest.mark.multiprocess
def test_a_refused_loss_leaves_an_overlapped_state_untouched() -> None:
    """The step's weights travel in the call check, which a refused loss fails: the host
    thread steps nothing early, every rank raises, the masters are bitwise as they were,
    and training goes on (overlapped again) to torch's result on the good batches."""
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(4, 2, 1)
    want = torch_reference_unclipped(params, xs, ys)
    for masters, per_step in run(2, refused_then_trained, params, xs, ys):
        fzero.assert_trees_close(masters, want, rtol=1e-10, atol=1e-12)
        assert [OFFLOAD_THREAD in "".join(names) for names in per_step] == [False, True, True, True]


def torch_reference_unclipped(params: Any, xs: torch.Tensor, ys: torch.Tensor) -> Any:
    """torch.optim.AdamW on one process over the whole batch of each step."""
    from tests.support import mlp_loss

    leaves, treedef = fzero._core._tree.tree_flatten(params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.AdamW(tensors, lr=0.05, weight_decay=0.1, foreach=False)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        mlp_loss(fzero._core._tree.tree_unflatten(treedef, tensors), (xs[t], ys[t])).backward()
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def clips_later(
    mesh: fzero.Mesh, params: Any, xs: Any, ys: Any, layout: str, fraction: float
) -> tuple[str, bool]:
    """An optimizer that asks for the global norm only from its second step: the error,
    and whether this rank owns a piece of an offloaded bucket."""
    adam, clip = fzero.optim.adamw(lr=0.05), fzero.optim.clip_by_global_norm(0.1)
    stepped = []

    def update_(g: Any, s: Any, p: Any) -> Any:
        if stepped:
            g, _ = clip.update(g, clip.init(p), p)
        return adam.update_(g, s, p)

    opt = adam._replace(update_=update_)
    kw: dict[str, Any] = dict(stage=2, units=LAYER_UNITS)
    offload = fzero.Offload("host", fraction)
    state = fzero.shard_state(params, opt, mesh, layout=layout, offload=offload, **kw)
    owns = owns_offloaded(state)
    step = fzero.sharded_step(gathered_mlp_loss, opt, mesh, just_in_time=True, **kw)
    with pytest.raises(ValueError) as caught:
        for t in range(xs.shape[0]):
            state, _ = step(state, rank_batch(mesh, xs[t], ys[t]))
            stepped.append(t)
    return str(caught.value), owns


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "layout", "fraction"), [(2, "flat", 1.0), (3, "tensor", 0.2)])
def test_an_optimizer_that_starts_asking_for_the_norm_fails_loudly(
    world: int, layout: str, fraction: float
) -> None:
    """Its first step ran after the backward and never asked; a later step, stepping
    buckets during the backward, cannot give it the whole gradient's norm: every rank
    raises, saying so, rather than clip by one unit's norm. Also a rank that owns no
    piece of an offloaded bucket (the tensor layout, the last unit alone offloaded),
    which hands nothing over: it refuses alike rather than enter the norm's all-reduce."""
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(3, world, 1)
    results = run(world, clips_later, params, xs, ys, layout, fraction)
    for message, _ in results:
        assert "global norm" in message and "overlap=False" in message
    assert any(owns for _, owns in results)
    assert layout == "flat" or not all(owns for _, owns in results)


class _Stuck:
    """A GPU copy's event queued behind a collective a failed peer never joins."""

    def query(self) -> bool:
        return False


def stuck_while_a_peer_fails(mesh: fzero.Mesh, params: Any, xs: Any, ys: Any) -> str:
    """Rank 0's host thread waits on copies that never complete (from the third step);
    rank 1's host thread fails there. Rank 0's step must end with rank 1's error."""
    from fzero._step import _overlap

    armed = {"on": False}
    if mesh.rank == 0:
        carry = _overlap.Overlap._carry

        def stuck(self: Any, k: int, g: Any, ready: Any) -> Any:
            pieces = carry(self, k, g, ready)
            return [(p, _Stuck()) for p in pieces] if armed["on"] else pieces

        _overlap.Overlap._carry = stuck  # type: ignore[method-assign]
    adamw = fzero.optim.adamw(lr=0.05, weight_decay=0.1)

    def update_(g: Any, s: Any, p: Any) -> Any:
        on_host = threading.current_thread().name.startswith(OFFLOAD_THREAD)
        if armed["on"] and mesh.rank == 1 and on_host:
            raise RuntimeError("rank 1's host update failed")
        return adamw.update_(g, s, p)  # type: ignore[misc]

    opt = adamw._replace(update_=update_)
    state = fzero.shard_state(
        params, opt, mesh, stage=3, units=LAYER_UNITS, offload=fzero.Offload("host")
    )
    step = fzero.sharded_step(
        gathered_mlp_loss, opt, mesh, stage=3, units=LAYER_UNITS, just_in_time=True
    )
    for t in range(3):
        armed["on"] = t == 2
        try:
            state, _ = step(state, rank_batch(mesh, xs[t], ys[t]))
        except RuntimeError as exc:
            return f"step {t}: {exc}"
    return "no error"


@pytest.mark.multiprocess
def test_a_step_waiting_for_its_host_thread_sees_a_peers_failure() -> None:
    # The wait for the host thread looked only at what this process knew: a rank whose
    # host thread waited on a GPU copy behind a collective the failed peer never joined
    # waited for the simulation's timeout (the CUDA case, its copies stood in for).
    params = make_params(MLP_DIMS, torch.float64, 5)
    xs, ys = batches(3, 2, 1)
    said = fzero.Simulation(2, collective_timeout=20, timeout=30).run(
        stuck_while_a_peer_fails, params, xs, ys
    )
    assert said == ["step 2: rank 1's host update failed"] * 2, said
