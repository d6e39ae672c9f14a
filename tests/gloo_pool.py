"""GlooPool: spawned ranks over real torch.distributed (gloo), started once and reused."""

from __future__ import annotations

import atexit
import contextlib
import io
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

# Why a pool and not `fzero.simulate`: simulate forks, so its ranks inherit the parent's
# imports, objects and state. A torchrun user's ranks are fresh interpreters that meet only
# through an init_method. The pool reproduces that (the "spawn" start method, a tcp://
# init_method on a free port) and, because starting interpreters that import torch takes
# seconds, keeps the ranks alive across calls: a test module pays for it once.
#
# Protocol, one duplex Pipe per rank, every message a torch.save blob:
#   parent -> rank: (fn, args, kwargs) to run, or None to shut down
#   rank -> parent: ("ready", pid) once the process group is up, then per call
#                   ("ok", result) or ("err", (exception, remote traceback))


class GlooPoolError(RuntimeError):
    """The pool cannot serve a call: a rank died, it failed to start, or it was torn down."""


class GlooPool:
    """`world_size` spawned processes sharing one gloo process group, reused across calls.

    Args:
      world_size: number of ranks (processes).
      collective_timeout: seconds a collective may wait for its peers before failing, so a
        mismatched collective (a bug) errors instead of hanging.
      call_timeout: seconds one `run` (and the start-up) may take before the pool is killed
        and TimeoutError raised.

    Ranks are fresh interpreters: they get the parent's sys.path, environment and `-W`
    command-line warning filters, nothing else. Use as a context manager, or call
    `close()`. After any failed `run` the pool is dead (its process group may be stuck
    mid-collective) and further calls raise GlooPoolError; build a new pool.
    """

    def __init__(
        self, world_size: int, collective_timeout: float = 30.0, call_timeout: float = 120.0
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.call_timeout = call_timeout
        self.pids: list[int] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._dead: str | None = None  # why the pool can no longer serve calls
        # Registered before anything is spawned: whatever happens, interpreter exit kills
        # the ranks instead of waiting on them.
        atexit.register(self._kill)
        try:
            self._start()
        except BaseException:
            self._kill()
            raise

    def __repr__(self) -> str:
        state = "alive" if self.alive else f"dead ({self._dead})"
        return f"GlooPool(world_size={self.world_size}, {state})"

    def __enter__(self) -> GlooPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the pool can still run calls."""
        return self._dead is None

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list[Any]:
        """Runs `fn(mesh, *args, **kwargs)` on every rank; returns the results in rank order.

        `fn` travels by reference (pickle), so it must be a module-level function
        importable in a fresh interpreter; args, kwargs and results travel with torch.save.

        Raises:
          The first exception raised on a rank, with a note naming the rank and carrying
          the remote traceback (the pool is then killed); TimeoutError if the call takes
          longer than `call_timeout`; GlooPoolError if a rank dies or the pool is dead.
        """
        if self._dead is not None:
            raise GlooPoolError(
                f"GlooPool(world_size={self.world_size}) is dead ({self._dead}); create a new pool"
            )
        try:
            # Pickled here, once: a lambda or a closure fails in the caller, not on the ranks.
            blob = _dump((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"GlooPool.run: cannot send {fn!r} to spawned ranks (it must be a "
                f"module-level function, and its arguments picklable): {exc}"
            ) from exc
        try:
            for conn in self._conns:
                conn.send_bytes(blob)
            return self._collect(f"running {getattr(fn, '__qualname__', fn)!r}")
        except BaseException as exc:
            # Any failure (including KeyboardInterrupt) may leave ranks mid-collective.
            self._kill(f"{type(exc).__name__} during run")
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Asks every rank to destroy its process group and exit; kills stragglers."""
        if self._dead is None:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(_dump(None))
            deadline = time.monotonic() + timeout
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill("closed")

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, init_method, self.collective_timeout, child_end),
                name=f"gloo-pool-rank-{rank}",
                # Daemonic: multiprocessing's own exit hook terminates them too.
                daemon=True,
            )
            proc.start()
            child_end.close()  # so the parent sees EOF when the child dies
            self._procs.append(proc)
            self._conns.append(parent_end)
        self.pids = self._collect("starting")

    def _collect(self, what: str) -> list[Any]:
        """Waits for one reply per rank; raises (killing the pool) on error, death, timeout."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.call_timeout
        while len(results) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in results]
            waitables = [self._conns[r] for r in pending] + [
                self._procs[r].sentinel for r in pending
            ]
            if not mpc.wait(waitables, timeout=max(0.0, deadline - time.monotonic())):
                self._kill(f"timed out {what}")
                raise TimeoutError(
                    f"GlooPool(world_size={self.world_size}): ranks {pending} did not finish "
                    f"{what} within {self.call_timeout} s; the pool was killed"
                )
            died, errors = [], []
            for rank in pending:
                conn, proc = self._conns[rank], self._procs[rank]
                # A reply already in the pipe wins over the exit it may be racing with.
                if conn.poll():
                    try:
                        kind, payload = _load(conn.recv_bytes())
                    except EOFError:  # the rank closed its end: it is exiting
                        died.append(rank)
                        continue
                    if kind == "err":
                        errors.append((rank, payload))
                    else:
                        results[rank] = payload
                elif not proc.is_alive():
                    died.append(rank)
            # A death is reported before errors: a rank that vanished makes its peers'
            # collectives fail ("connection closed"), and those errors are only symptoms.
            if died:
                rank = died[0]
                proc = self._procs[rank]
                proc.join(5.0)  # bounded: a rank that closed its pipe may still be exiting
                code = proc.exitcode
                how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
                self._kill(f"rank {rank} died while {what}")
                raise GlooPoolError(
                    f"GlooPool(world_size={self.world_size}): rank {rank} died ({how}) "
                    f"while {what}; the pool was killed"
                )
            if errors:
                rank, (exc, tb) = errors[0]
                self._kill(f"rank {rank} raised {type(exc).__name__} while {what}")
                exc.add_note(
                    f"raised on GlooPool rank {rank} of {self.world_size} while {what}; "
                    f"remote traceback:\n{tb}"
                )
                raise exc
        return [results[r] for r in range(self.world_size)]

    def _kill(self, why: str = "killed at interpreter exit") -> None:
        """Kills every rank at once (SIGKILL) and releases the pipes; idempotent."""
        if self._dead is None:
            self._dead = why
        atexit.unregister(self._kill)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _free_port() -> int:
    # The OS picks a port that is free now; rank 0's TCPStore binds it moments later. A
    # collision in between fails start-up loudly (rank 0 dies), never silently.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes) -> Any:
    # Bytes from our own processes over a private pipe: full unpickling is intended here.
    return torch.load(io.BytesIO(data), weights_only=False)


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip (type preserved), else a RuntimeError copy."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__qualname__}: {exc} (original not picklable)")


def _worker(
    rank: int, world_size: int, init_method: str, collective_timeout: float, conn: Any
) -> None:
    """A rank's main loop: join the process group, then run calls until told to stop."""
    # One thread per rank: with N ranks on a 2-core machine, torch's default (one thread
    # per core, per process) oversubscribes the CPU and slows every collective.
    torch.set_num_threads(1)
    # Ctrl-C in a terminal signals the whole process group; the parent handles it (and
    # kills the ranks), so the ranks need not print a KeyboardInterrupt traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Gloo resolves the hostname to pick an interface, which sandboxes and CI runners
    # often map to nothing reachable; every rank is local here.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    import torch.distributed as dist

    try:
        import fzero

        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        mesh = fzero.ProcessGroupMesh()
        dist.barrier()  # every pair of ranks has connected before we report ready
    except BaseException as exc:
        conn.send_bytes(_dump(("err", (_portable(exc), traceback.format_exc()))))
        raise SystemExit(1) from None
    conn.send_bytes(_dump(("ready", os.getpid())))
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:  # the parent is gone: nothing left to serve
            break
        try:
            message = _load(data)  # may fail, e.g. fn's module does not import here
            if message is None:
                break
            fn, args, kwargs = message
            reply = _dump(("ok", fn(mesh, *args, **kwargs)))
        except BaseException as exc:
            # After replying we keep waiting (sockets open) until the parent kills us, so
            # peers stuck in a collective with this rank keep waiting rather than failing
            # with "connection closed" and racing this, the real error, to the parent.
            reply = _dump(("err", (_portable(exc), traceback.format_exc())))
        conn.send_bytes(reply)
    dist.destroy_process_group()
    conn.close()
    # Skip interpreter finalisation (a second or more with torch loaded, per rank, on a
    # busy machine): this process has nothing left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
