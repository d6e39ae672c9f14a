"""Simulation: N real ranks (forked processes over gloo on 127.0.0.1) from one call."""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ._mesh import ProcessGroupMesh

# Ranks are processes, not threads: `torch.func.functional_call` swaps a module's
# parameters in place for the duration of a call, so threads sharing one module race and
# compute gradients on each other's tensors. Forked processes each own a copy of the
# module, and run the very code path torchrun runs (ProcessGroupMesh over gloo). Fork,
# not spawn, so closures defined in a notebook need no pickling.


class RankFailure(RuntimeError):
    """A simulated rank died without raising a Python exception (signal, os._exit, timeout)."""


@dataclass(frozen=True)
class Simulation:
    """How `simulate` runs its ranks.

    Attributes:
      world_size: number of ranks.
      collective_timeout: seconds a collective may wait for its peers before failing;
        a mismatched collective (a bug) fails instead of hanging.
      timeout: seconds the whole run may take (None: no limit).
    """

    world_size: int
    collective_timeout: float = 120.0
    timeout: float | None = None

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs `fn(mesh, *args, **kwargs)` on every rank; returns the results in rank order.

        An exception on any rank is re-raised here (with a note naming the rank and the
        remote traceback) after every other rank has been killed.
        """
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if sys.platform == "win32":
            raise RuntimeError("fzero.simulate forks its ranks, which Windows cannot do")
        ctx = mp.get_context("fork")
        store_dir = tempfile.mkdtemp(prefix="fzero-sim-")
        conns, procs = [], []
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns about fork in a threaded parent; the child touches no
                # lock of the parent's and resets torch's thread pool first (see _rank_main).
                warnings.simplefilter("ignore", DeprecationWarning)
                for rank in range(self.world_size):
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(
                        target=_rank_main,
                        args=(rank, self, store_dir, send, fn, args, kwargs),
                        name=f"fzero-rank-{rank}",
                        daemon=True,
                    )
                    proc.start()
                    send.close()
                    conns.append(recv)
                    procs.append(proc)
            return self._collect(conns, procs)
        finally:
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.join()
            for conn in conns:
                conn.close()
            shutil.rmtree(store_dir, ignore_errors=True)

    def _collect(self, conns: list[Any], procs: list[Any]) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        pending = {rank: (conns[rank], procs[rank]) for rank in range(self.world_size)}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            waitables = [c for c, _ in pending.values()] + [p.sentinel for _, p in pending.values()]
            ready = mpc.wait(waitables, timeout=remaining)
            if not ready:
                raise TimeoutError(
                    f"fzero.simulate: ranks {sorted(pending)} of {self.world_size} did not finish "
                    f"within {self.timeout} s"
                )
            for rank, (conn, proc) in list(pending.items()):
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        kind, payload = _load(conn.recv_bytes())
                    except EOFError:
                        kind, payload = "died", None
                    if kind == "ok":
                        results[rank] = payload
                        del pending[rank]
                        continue
                    if kind == "err":
                        _raise_remote(rank, self.world_size, *payload)
                if proc.sentinel in ready and rank in pending and not conn.poll():
                    proc.join()
                    code = proc.exitcode
                    how = (
                        f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    )
                    raise RankFailure(
                        f"fzero.simulate: rank {rank} of {self.world_size} died ({how}) before "
                        "returning a result"
                    )
        return [results[r] for r in range(self.world_size)]


def simulate(world_size: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
    """Runs `fn(mesh, *args, **kwargs)` on `world_size` simulated ranks; no launcher needed.

    Each rank is a forked process with its own `ProcessGroupMesh` over gloo on 127.0.0.1,
    so data really moves between ranks and the code path is the one torchrun runs. Usable
    in a notebook: `fn` may be a closure over local objects (including one shared
    `nn.Module` called through `torch.func.functional_call`: every rank has its own copy).

    Args:
      world_size: number of ranks.
      fn: called as `fn(mesh, *args, **kwargs)` on every rank.
      *args: passed to `fn` (each rank gets its own copy, inherited through fork).
      **kwargs: passed to `fn`.

    Returns:
      The per-rank return values, in rank order (sent back with `torch.save`).

    Raises:
      The first exception raised on any rank (annotated with the rank and its remote
      traceback), after every other rank has been killed; `RankFailure` if a rank dies.
      Use `Simulation(world_size, collective_timeout=..., timeout=...).run(fn, ...)` to
      choose the timeouts.
    """
    return Simulation(world_size).run(fn, *args, **kwargs)


def _dump(kind: str, payload: Any) -> bytes:
    buf = io.BytesIO()
    torch.save((kind, payload), buf)
    return buf.getvalue()


def _load(data: bytes) -> tuple[str, Any]:
    # Our own child's bytes, so full unpickling is fine here (never for files on disk).
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(
    rank: int,
    sim: Simulation,
    store_dir: str,
    conn: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    # GNU OpenMP is not fork-safe: a child of a parent that already ran a multi-threaded
    # op hangs in its first parallel region unless it drops to one thread first.
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    try:
        import torch.distributed as dist

        store = dist.FileStore(os.path.join(store_dir, "store"), sim.world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=sim.world_size,
            timeout=timedelta(seconds=sim.collective_timeout),
        )
        result = fn(ProcessGroupMesh(), *args, **kwargs)
        data = _dump("ok", result)
    except BaseException as exc:
        tb = traceback.format_exc()
        try:
            pickle.dumps(exc)
            err = exc
        except Exception:
            err = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send_bytes(_dump("err", (err, tb)))
        # Stay alive with sockets open until the parent kills us: peers blocked in a
        # collective then keep waiting instead of racing to report "connection closed",
        # so the error the caller sees is this one, the cause.
        while True:
            time.sleep(60)
    conn.send_bytes(data)
    conn.close()
    # Skip atexit handlers and buffered-IO flushes inherited from the parent (pytest,
    # Jupyter): they belong to the parent process.
    os._exit(0)


def _raise_remote(rank: int, world_size: int, exc: BaseException, tb: str) -> None:
    exc.add_note(f"raised on simulated rank {rank} of {world_size}; remote traceback:\n{tb}")
    raise exc
