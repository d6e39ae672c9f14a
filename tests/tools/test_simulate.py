"""fzero.simulate: real ranks from one call, results in rank order, failures that never hang."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fzero
from tests.support import run

# --- helpers ---------------------------------------------------------------------------------


def _child_pids() -> list[int]:
    """Pids of every live or zombie process whose parent is this one (read from /proc)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # The command name is in parentheses and may hold spaces: fields follow the last ")".
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me:
            out.append(int(entry.name))
    return out


def _assert_no_ranks_left(before: set[int]) -> None:
    """Every simulated rank has been killed and reaped: no orphan, no zombie.

    Children that existed before the test (another module's worker pool, say) are not
    the test's to judge.
    """
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("fzero-rank")]
    if Path("/proc/self/stat").exists():
        assert set(_child_pids()) - before == set(), "simulate left child processes behind"


@pytest.fixture(autouse=True)
def _no_stray_children() -> Any:
    # Each test starts and ends without simulated ranks, so a leak is pinned on its test.
    before = set(_child_pids())
    _assert_no_ranks_left(before)
    yield
    _assert_no_ranks_left(before)


# --- results, arguments, closures ------------------------------------------------------------


@pytest.mark.multiprocess
def test_results_come_back_in_rank_order_with_tensors_and_nested_objects() -> None:
    def fn(mesh: fzero.Mesh, scale: float, *, tag: str) -> dict[str, Any]:
        # Later ranks finish first, so rank order cannot be completion order by accident.
        time.sleep(0.05 * (mesh.size - 1 - mesh.rank))
        return {
            "rank": mesh.rank,
            "size": mesh.size,
            "tensor": torch.arange(3, dtype=torch.float64) * scale + mesh.rank,
            "nested": [(mesh.rank, f"{tag}{mesh.rank}"), {"set": {mesh.rank}, "none": None}],
            "dtype": torch.float16,
        }

    results = run(4, fn, 2.0, tag="r")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for rank, r in enumerate(results):
        assert r["size"] == 4
        torch.testing.assert_close(
            r["tensor"], torch.tensor([0.0, 2.0, 4.0], dtype=torch.float64) + rank
        )
        assert r["nested"] == [(rank, f"r{rank}"), {"set": {rank}, "none": None}]
        assert r["dtype"] is torch.float16


@pytest.mark.multiprocess
def test_closures_over_local_objects_and_per_rank_copies_of_arguments() -> None:
    offsets = {"base": 10}  # a local object the closure captures, never pickled

    def local_helper(x: int) -> int:
        return x * 100

    def fn(mesh: fzero.Mesh, seen: list[int]) -> list[int]:
        # Every rank mutates its own forked copy of `seen`; nobody sees anyone else's append.
        seen.append(local_helper(mesh.rank) + offsets["base"])
        return seen

    seen: list[int] = [-1]
    assert run(3, fn, seen) == [[-1, 10], [-1, 110], [-1, 210]]
    assert seen == [-1], "a rank's mutation leaked into the caller"


@pytest.mark.multiprocess
def test_world_size_one_runs_on_a_real_mesh() -> None:
    assert run(1, lambda mesh: (mesh.rank, mesh.size, mesh.backend)) == [(0, 1, "gloo")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_data_really_moves_between_ranks(world_size: int) -> None:
    def fn(mesh: fzero.Mesh) -> tuple[list[float], list[int], list[float]]:
        me = torch.tensor([float(mesh.rank)], dtype=torch.float64)
        gathered = fzero._comm.all_gather(me, mesh).tolist()
        objects = fzero._comm.all_gather_object(mesh.rank, mesh)
        mean = fzero._comm.all_reduce_mean(me, mesh).tolist()
        return gathered, objects, mean

    ranks = list(range(world_size))
    expected_mean = [sum(ranks) / world_size]
    for gathered, objects, mean in run(world_size, fn):
        assert gathered == [float(r) for r in ranks]
        assert objects == ranks
        assert mean == expected_mean


# --- the functional_call race the process design exists for --------------------------------


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    # bias=False: the attention key bias has a mathematically zero gradient (softmax is
    # shift-invariant), so its computed gradient is round-off noise, which Adam divides by
    # eps and turns into ~1e-12 steps of arbitrary sign: not something to compare at 1e-10.
    layer = nn.TransformerEncoderLayer(
        d_model=8,
        nhead=2,
        dim_feedforward=16,
        dropout=0.0,
        batch_first=True,
        bias=False,
        dtype=torch.float64,
    )
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_one_shared_module_through_functional_call_matches_single_process(stage: int) -> None:
    world_size, micro, steps, lr, wd = 3, 2, 3, 0.01, 0.1
    model = _transformer()  # ONE module, closed over by every rank's loss_fn

    def loss_fn(params: dict[str, torch.Tensor], batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(steps, world_size * micro, 5, 8, generator=g, dtype=torch.float64)
    ys = torch.randn(steps, world_size * micro, 5, 8, generator=g, dtype=torch.float64)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}

    # The independent reference: plain torch.optim.AdamW, one process, the whole batch.
    ref = {k: v.clone().requires_grad_() for k, v in init.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=lr, weight_decay=wd, foreach=False)
    for t in range(steps):
        opt.zero_grad()
        loss_fn(ref, (xs[t], ys[t])).backward()
        opt.step()
    expected = {k: v.detach() for k, v in ref.items()}

    def train(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        optimizer = fzero.optim.adamw(lr=lr, weight_decay=wd)
        state = fzero.shard_state(init, optimizer, mesh, stage=stage)
        step = fzero.sharded_step(loss_fn, optimizer, mesh, stage=stage)
        mine = slice(mesh.rank * micro, (mesh.rank + 1) * micro)
        for t in range(steps):
            state, _ = step(state, (xs[t, mine], ys[t, mine]))
        return fzero.gather_params(state.params, mesh)

    # Training moved every parameter, so agreeing with the reference is not vacuous.
    assert all((expected[k] - init[k]).abs().max() > 1e-4 for k in init)
    for rank, params in enumerate(run(world_size, train)):
        fzero.assert_trees_close(
            params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage} rank {rank}"
        )
    # The caller's module was never touched by the ranks (they had their own copies).
    fzero.assert_trees_close(dict(model.named_parameters()), init, rtol=0, atol=0)


# --- failures: raised promptly, attributed to a rank, nothing left running --------------------


def _exits(mesh: fzero.Mesh, code: int) -> int:
    if mesh.rank == 1:
        sys.exit(code)  # argparse's --help, in code shared with a command line
    return mesh.rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("code", [0, 2])
def test_a_rank_that_calls_sys_exit_is_a_rank_failure_not_the_callers_exit(code: int) -> None:
    """Re-raised in the caller, the rank's SystemExit ended the caller's program without a
    word, with status 0 for sys.exit(0): a failed run CI would see pass."""
    with pytest.raises(fzero.RankFailure, match=rf"rank 1 of 2 called sys.exit\({code}\)"):
        fzero.Simulation(2, timeout=60).run(_exits, code)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_exception_on_one_rank_is_raised_promptly_with_its_type_and_rank() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        if mesh.rank == 2:
            raise ValueError("boom")
        # The others block in a collective rank 2 never joins.
        fzero._comm.all_gather(torch.ones(1), mesh)

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        fzero.Simulation(4, collective_timeout=60).run(fn)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"took {elapsed:.1f} s: waited for the collective timeout?"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 2 of 4" in notes
    assert 'raise ValueError("boom")' in notes, "the remote traceback is missing"


class _TwoArgError(Exception):
    """An exception whose constructor `pickle` cannot call again from its args."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_exception_that_does_not_unpickle_still_names_the_rank_and_message() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        if mesh.rank == 1:
            raise _TwoArgError("load", "disk full")

    # The type may degrade (e.g. to RuntimeError); the message and the rank must not.
    with pytest.raises(Exception) as info:
        run(2, fn)
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    assert "load failed: disk full" in text
    assert "_TwoArgError" in text or isinstance(info.value, _TwoArgError)
    assert "rank 1 of 2" in text


@pytest.mark.multiprocess
def test_unpicklable_result_is_an_error_naming_the_rank() -> None:
    def fn(mesh: fzero.Mesh) -> Any:
        return (lambda: None) if mesh.rank == 1 else 0

    # Whatever pickle raises (its type varies across Python versions), naming the rank.
    with pytest.raises(Exception, match="pickle") as info:
        run(2, fn)
    assert "rank 1 of 2" in "\n".join(getattr(info.value, "__notes__", []))


def _die(mesh: fzero.Mesh, how: str, peers: str) -> int:
    if mesh.rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    if peers == "in_collective":
        # The realistic case: peers wait in a collective and see the dead rank's socket
        # close. The caller must still be told about the cause (the dead rank), not about
        # a peer's "connection closed".
        fzero._comm.all_gather(torch.ones(1), mesh)
    return mesh.rank


@pytest.mark.multiprocess
@pytest.mark.timeout(15)  # a lost death must fail this test, not stall the suite
@pytest.mark.parametrize("peers", ["idle", "in_collective"])
@pytest.mark.parametrize(
    ("how", "expected"), [("exit", "exit code 3"), ("kill", f"signal {int(signal.SIGKILL)}")]
)
def test_a_rank_that_dies_is_a_rank_failure_naming_rank_and_cause(
    how: str, expected: str, peers: str
) -> None:
    start = time.monotonic()
    with pytest.raises(fzero.RankFailure, match=rf"rank 1 of 3 died \({expected}\)"):
        fzero.Simulation(3, collective_timeout=60).run(_die, how, peers)
    assert time.monotonic() - start < 10


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(30)
def test_run_timeout_names_the_ranks_still_running() -> None:
    def fn(mesh: fzero.Mesh) -> int:
        if mesh.rank == 1:
            time.sleep(3600)
        return mesh.rank

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not finish within 1\.0 s"):
        fzero.Simulation(2, collective_timeout=60, timeout=1.0).run(fn)
    assert time.monotonic() - start < 10


# --- fork safety and validation ---------------------------------------------------------------


@pytest.mark.multiprocess
def test_ranks_forked_after_a_multithreaded_parent_op_do_not_hang() -> None:
    # GNU OpenMP is not fork-safe: a child forked after the parent ran a parallel region
    # hangs in its own first one unless simulate resets the child's thread pool.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(600, 600)
        _ = a @ a

        def fn(mesh: fzero.Mesh) -> float:
            b = torch.ones(600, 600)
            return (b @ b)[0, 0].item()  # 600 exactly, even in float32

        results = fzero.Simulation(3, collective_timeout=30, timeout=60).run(fn)
    finally:
        torch.set_num_threads(threads)
    assert results == [600.0] * 3


_KILLED_HOLDING_TQDMS_LOCK = """
import time, tqdm, fzero
tqdm.tqdm(total=1, disable=True).close()  # this process made a bar: tqdm's locks exist

def fn(mesh):
    if mesh.rank == 1:  # inside a bar's making, as torch.fx is many times a compile
        tqdm.tqdm.get_lock().acquire()
        time.sleep(60)
    raise ValueError("rank 0 fails; rank 1, holding the lock, is killed")

try:
    fzero.Simulation(2, collective_timeout=30, timeout=60).run(fn)
except ValueError:
    pass
tqdm.tqdm(total=1, disable=True).close()
print("made a bar")
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_killed_inside_tqdms_lock_leaves_the_parent_able_to_compile() -> None:
    # A forked rank inherited tqdm's lock, a semaphore shared with its parent, which
    # torch.fx takes for every graph it runs; a rank killed holding it (its peer had
    # failed) left the parent's next bar, so its next compile, waiting forever. In a
    # process of its own: the hang must not reach this one.
    import subprocess

    try:
        out = subprocess.run(
            [sys.executable, "-c", _KILLED_HOLDING_TQDMS_LOCK],
            capture_output=True,
            text=True,
            timeout=45,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the parent's next tqdm bar waited for a lock its killed rank held")
    assert out.stdout.strip() == "made a bar", (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("world_size", [0, -1, "2", 2.0])
def test_world_size_must_be_a_positive_int(world_size: Any) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        fzero.simulate(world_size, lambda mesh: None)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        fzero.Simulation(world_size).run(lambda mesh: None)


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"collective_timeout": 0}, "collective_timeout must be a positive number"),
        ({"collective_timeout": -5}, "collective_timeout must be a positive number"),
        ({"timeout": -1}, "timeout must be None or a positive number"),
    ],
)
def test_timeouts_must_be_positive(settings: dict[str, Any], said: str) -> None:
    # They were reported as gloo failing to connect the ranks, or a run not done in -1 s.
    with pytest.raises(ValueError, match=said):
        fzero.Simulation(2, **settings).run(lambda mesh: None)


@pytest.mark.multiprocess
def test_a_bad_mesh_is_its_own_error_not_a_connection_failure() -> None:
    with pytest.raises(RuntimeError, match="nonsense") as info:
        fzero.Simulation(2, collective_timeout=10, timeout=30, device="nonsense").run(
            lambda mesh: None
        )
    assert "could not connect" not in str(info.value)


_WITH_A_GROUP = """
import os, tempfile
import torch.distributed as dist
import fzero
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
try:
    fzero.simulate(2, lambda mesh: mesh.rank)
except RuntimeError as exc:
    print(exc)
"""

_SPAWNED_FROM_A_SESSION = """
import torch
import fzero
torch.cuda.is_initialized = lambda: True  # as after a notebook touched CUDA: spawned ranks

def fn(mesh):  # a notebook cell's: the spawned rank's __main__ has no such name
    return mesh.rank

try:
    fzero.Simulation(2, collective_timeout=10, timeout=60).run(fn)
except TypeError as exc:
    print(exc)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "said"),
    [
        (_WITH_A_GROUP, "already has a default process group"),
        (_SPAWNED_FROM_A_SESSION, "fn is defined in this session's __main__"),
    ],
)
def test_what_a_session_cannot_simulate_is_said_before_any_rank_runs(
    program: str, said: str
) -> None:
    # A process group inherited by the forked ranks failed in torch's words; a notebook's
    # function passed pickling by name, and the spawned rank died with "exit code 1".
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert said in out.stdout, (out.stdout, out.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_that_finish_at_once_leave_no_peer_still_connecting() -> None:
    # A rank that returned used to exit, closing its sockets under a peer still inside
    # gloo's mesh setup: about one run in five at three ranks failed "connection closed by
    # peer" (once retried, which ran fn twice on the ranks that had finished).
    for _ in range(25):
        assert fzero.Simulation(3, collective_timeout=30).run(lambda mesh: mesh.rank) == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_failed_gloo_setup_is_reported_naming_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    real = dist.init_process_group

    def refuse_rank_1(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("rank") == 1:  # the forked ranks inherit this patch
            raise RuntimeError("Gloo connectFullMesh failed: Connection closed by peer")
        real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", refuse_rank_1)
    with pytest.raises(RuntimeError, match="gloo could not connect the ranks") as info:
        fzero.Simulation(2, collective_timeout=5, timeout=20).run(lambda mesh: mesh.rank)
    assert "rank 1 of 2" in "\n".join(getattr(info.value, "__notes__", []))


_ORPHAN_PARENT = """
import os, sys, time
import fzero

def fn(mesh):
    os.write(1, f"{os.getpid()}\\n".encode())  # one write: the ranks' lines never interleave
    if mesh.rank == 0:
        return 0  # rank 0 is done and waits for its parent
    time.sleep(60)  # rank 1 computes; the parent is killed meanwhile
    return 1

fzero.Simulation(2, collective_timeout=30).run(fn)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_waiting_on_a_killed_parent_leave_on_their_own() -> None:
    import fcntl
    import subprocess
    import sys
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("fzero-sim-*"))
    with subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE) as parent:
        assert parent.stdout is not None
        ranks = [int(parent.stdout.readline()) for _ in range(2)]
        os.kill(parent.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(map(_running, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The busy rank too: it went on computing for its loop's length.
    assert not any(map(_running, ranks)), "a rank outlived its killed parent"
    store = set(Path(tempfile.gettempdir()).glob("fzero-sim-*")) - before
    assert store, "the killed run's store is where the next run looks for it"
    # A killed rank shows as a zombie once its main thread is gone; its lock goes with its
    # last thread (a gloo thread may still be closing its sockets): wait for that.
    for lock in (p / "lock" for p in store):
        with open(lock) as f:
            deadline = time.monotonic() + 10
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(f, fcntl.LOCK_UN)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "a killed run's lock is still held"
                    time.sleep(0.05)
    fzero.Simulation(1, collective_timeout=10).run(lambda mesh: None)
    assert not any(p.exists() for p in store), "the next run removes a killed run's store"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits on whichever process reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
