"""Simulation: N real ranks (forked processes over gloo on 127.0.0.1) from one call."""

from __future__ import annotations

import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _comm
from .._comm import ProcessGroupMesh
from ._rank_process import linger, settle_in
from ._sim_store import make_store, remove_store

# Ranks are processes, not threads: `torch.func.functional_call` swaps a module's
# parameters in place for the duration of a call, so threads sharing one module race and
# compute gradients on each other's tensors. Forked processes each own a copy of the
# module, and run the very code path torchrun runs (ProcessGroupMesh over gloo). Fork,
# not spawn, so closures defined in a notebook need no pickling; but a forked child
# cannot use CUDA once its parent has initialised it, so then the ranks are spawned.


class RankFailure(RuntimeError):
    """A simulated rank died without raising a Python exception (signal, os._exit, timeout)
    or exited (sys.exit)."""


@dataclass(frozen=True)
class Simulation:
    """How `simulate` runs its ranks.

    Attributes:
      world_size: number of ranks.
      collective_timeout: seconds a collective may wait for its peers before failing;
        a mismatched collective (a bug) fails instead of hanging.
      timeout: seconds the whole run may take (None: no limit).
      shard_size: the meshes' `shard_size` (groups of that many ranks shard, the groups
        replicate; None: every rank shards).
      device: the meshes' `device` (e.g. "cuda": the ranks share one GPU, their tensors
        travel over gloo; None: the CPU). Parameters made on a GPU work either way; the
        mesh's device is where `checkpoint.load` builds a state by default.

    Ranks are forked, so `fn` may be a closure from a notebook. If this process has
    already initialised CUDA (a forked child could not use it) they are spawned instead,
    and `fn` and its arguments must be picklable: defined at module level, not in a
    notebook's cell (refused, saying so). Ranks die with this process (on Linux), even
    killed by a signal; the next run removes such a run's store directory.
    """

    world_size: int
    collective_timeout: float = 120.0
    timeout: float | None = None
    shard_size: int | None = None
    device: Any = None

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs `fn(mesh, *args, **kwargs)` on every rank; returns the results in rank order.

        An exception on any rank is re-raised here (with a note naming the rank and the
        remote traceback) after every other rank has been killed.
        """
        if (
            isinstance(self.world_size, bool)
            or not isinstance(self.world_size, int)
            or (self.world_size < 1)
        ):
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        _check_timeouts(self.collective_timeout, self.timeout)
        if sys.platform == "win32":
            raise RuntimeError("fzero.simulate forks its ranks, which Windows cannot do")
        method = "spawn" if torch.cuda.is_initialized() else "fork"
        if method == "spawn":
            _check_picklable(fn, args, kwargs)
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RuntimeError(
                "fzero.simulate: this process already has a default process group "
                "(torch.distributed.init_process_group), which forked ranks would inherit "
                "and could not make their own; simulate from a process without one, or "
                "call torch.distributed.destroy_process_group() first"
            )
        ctx = mp.get_context(method)
        store_dir, lock = make_store()
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
            return self._collect(conns, procs, method)
        finally:
            for proc in procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
            for proc in procs:
                proc.join()
            for conn in conns:
                conn.close()
            remove_store(store_dir, lock)

    def _collect(self, conns: list[Any], procs: list[Any], method: str) -> list[Any]:
        n = self.world_size
        results: dict[int, Any] = {}
        errors: list[BaseException] = []  # in order of arrival
        died: list[tuple[int, str]] = []
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        grace = None  # after a failure: a moment for the other ranks to report theirs
        pending, closed = set(range(n)), set()
        while pending:
            limits = [t for t in (deadline, grace) if t is not None]
            remaining = max(0.0, min(limits) - time.monotonic()) if limits else None
            waitables = [conns[r] for r in pending - closed] + [procs[r].sentinel for r in pending]
            ready = set(mpc.wait(waitables, timeout=remaining))
            if not ready:
                if errors or died:
                    break
                raise TimeoutError(
                    f"fzero.simulate: ranks {sorted(pending)} of {n} did not finish within "
                    f"{self.timeout} s"
                )
            for r in sorted(pending):
                conn, proc = conns[r], procs[r]
                if conn in ready and r not in closed:
                    msg = _receive(conn)
                    if msg is None:
                        closed.add(r)  # end of file: the process is exiting without a word
                    elif msg[0] == "ok":
                        results[r] = msg[1]
                        pending.discard(r)
                        continue
                    else:
                        errors.append(_remote_error(r, n, *msg[1]))
                        pending.discard(r)
                        continue
                if proc.sentinel in ready:
                    msg = _receive(conn) if r not in closed else None
                    if msg is not None and msg[0] == "ok":
                        results[r] = msg[1]
                    elif msg is not None:
                        errors.append(_remote_error(r, n, *msg[1]))
                    else:
                        proc.join()
                        died.append((r, _exit_reason(proc.exitcode)))
                    pending.discard(r)
            if (errors or died) and grace is None:
                # A rank that dies makes its peers' collectives fail with "connection
                # closed": wait briefly so the death, the cause, is what gets reported.
                grace = time.monotonic() + 2.0
        if died:
            rank, how = died[0]
            hint = ""
            if method == "spawn" and how != "exit code 0" and not how.startswith("signal"):
                hint = (  # its own stderr says why: a notebook's is the server's terminal
                    "; a spawned rank that cannot unpickle fn or its arguments exits so"
                )
            failure = RankFailure(
                f"fzero.simulate: rank {rank} of {n} died ({how}) before returning a result{hint}"
            )
            raise failure from (errors[0] if errors else None)
        if errors:
            # Where one rank's failure made the others raise it too, the cause is its own.
            raise next((e for e in errors if not isinstance(e, _comm.PeerError)), errors[0])
        return [results[r] for r in range(n)]


def simulate(
    world_size: int,
    fn: Callable[..., Any],
    /,
    *args: Any,
    shard_size: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs `fn(mesh, *args, **kwargs)` on `world_size` simulated ranks; no launcher needed.

    Each rank is a forked process with its own `ProcessGroupMesh` over gloo on 127.0.0.1,
    so data really moves between ranks and the code path is the one torchrun runs. Usable
    in a notebook: `fn` may be a closure over local objects (including one shared
    `nn.Module` called through `torch.func.functional_call`: every rank has its own copy).

    Args:
      world_size: number of ranks.
      fn: called as `fn(mesh, *args, **kwargs)` on every rank.
      *args: passed to `fn` (each rank gets its own copy, inherited through fork).
      shard_size: a 2-D mesh (hybrid sharding): groups of `shard_size` consecutive ranks
        shard, the groups replicate (`fzero.ProcessGroupMesh`); taken by `simulate`,
        not passed to `fn`.
      **kwargs: passed to `fn`.

    Returns:
      The per-rank return values, in rank order (sent back with `torch.save`).

    Raises:
      The first exception raised on any rank (annotated with the rank and its remote
      traceback), after every other rank has been killed; `RankFailure` if a rank dies.
      Use `Simulation(world_size, collective_timeout=..., timeout=...).run(fn, ...)` to
      choose the timeouts.
    """
    return Simulation(world_size, shard_size=shard_size).run(fn, *args, **kwargs)


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
    parent = os.getppid()
    settle_in(parent)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    try:
        try:
            _comm.init_process_group(
                "gloo",
                sim.collective_timeout,
                store_file=os.path.join(store_dir, "store"),
                rank=rank,
                world_size=sim.world_size,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"gloo could not connect the ranks: {exc}") from exc
        mesh = ProcessGroupMesh(shard_size=sim.shard_size, device=sim.device)
        result = fn(mesh, *args, **kwargs)
        data = _dump("ok", result)
    except BaseException as exc:
        tb = traceback.format_exc()
        try:  # only send an exception the parent can rebuild; its text always goes along
            exc_bytes: bytes | None = pickle.dumps(exc)
            pickle.loads(exc_bytes)
        except Exception:
            exc_bytes = None
        data = _dump("err", (exc_bytes, f"{type(exc).__name__}: {exc}", tb))
    conn.send_bytes(data)
    conn.close()
    linger(parent)


def _check_timeouts(collective: Any, whole: Any) -> None:
    if isinstance(collective, bool) or not isinstance(collective, (int, float)) or collective <= 0:
        raise ValueError(
            f"collective_timeout must be a positive number of seconds, got {collective!r}"
        )
    if whole is not None and (
        isinstance(whole, bool) or not isinstance(whole, (int, float)) or whole <= 0
    ):
        raise ValueError(f"timeout must be None or a positive number of seconds, got {whole!r}")


class _SpawnPickler(pickle.Pickler):
    """Refuses what a spawned rank could not unpickle: a function or class of an
    interactive `__main__` (a notebook's cell), pickled by a name its `__main__` lacks."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            raise pickle.PicklingError(f"{obj.__qualname__} is defined in this session's __main__")
        return NotImplemented


def _check_picklable(fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    interactive = not hasattr(sys.modules.get("__main__"), "__file__")
    try:
        (_SpawnPickler if interactive else pickle.Pickler)(io.BytesIO()).dump((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            "fzero.simulate: CUDA is already initialised in this process, and a forked rank "
            "cannot use it, so the ranks are spawned; fn and its arguments must then be "
            f"picklable (defined at module level, not in a notebook cell): {exc}. Or make "
            "the CUDA tensors inside fn, before this process touches CUDA"
        ) from exc


def _receive(conn: Any) -> tuple[str, Any] | None:
    """The rank's message, or None at end of file (it closed its pipe without one)."""
    if not conn.poll():
        return None
    try:
        return _load(conn.recv_bytes())
    except EOFError:
        return None


def _exit_reason(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _remote_error(
    rank: int, world_size: int, exc_bytes: bytes | None, summary: str, tb: str
) -> BaseException:
    """The rank's exception, rebuilt (or a RuntimeError with its text), noting the rank."""
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        exc = RuntimeError(summary)
    if isinstance(exc, SystemExit):
        # Raised in the caller it would end the program with the rank's status and no
        # word (status 0 for sys.exit(0): a failed run that CI sees pass).
        exc = RankFailure(
            f"fzero.simulate: rank {rank} of {world_size} called sys.exit({exc.code!r}) "
            "before returning a result"
        )
    exc.add_note(f"raised on simulated rank {rank} of {world_size}; remote traceback:\n{tb}")
    return exc
