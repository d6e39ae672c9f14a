"""Failure: an error on one rank raised on every rank, at once, with that rank's message.

Two kinds ([Note: failing together]):

- **Agreed** errors: a check whose outcome every rank learns from the same exchange (the
  call check, the first step's configuration), so every rank raises the same error at
  the same point, with no collective left half-done: the process group stays usable.
  `agreed(exc)` marks one (`agreement` every error of a function).
- **Published** errors: an exception on one rank where its peers cannot know (the
  user's loss raising, a disk filling mid-export). The failing rank writes it into the
  job's store (`publish`); every wait of a CPU collective (`wait`) polls the store while
  it waits, so a peer stuck in a collective the failing rank will never join raises the
  same exception class and message (`PeerError`) within a poll's time, instead of
  waiting out the process group's timeout. The process group is left with collectives
  that can never complete: the job must be restarted (from its last checkpoint).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long a wait blocks before it looks at the store again: the bound on how late a peer
# learns of a failure, and how often a rank waiting on a slow peer asks the store.
POLL = timedelta(seconds=0.1)
_KEY = "fzero/failed"

_failed: dict[str, Any] | None = None  # what this process knows failed (its own or a peer's)


class PeerError(RuntimeError):
    """Raised on a rank because another rank failed inside an fzero call.

    The exception every other rank raises is of the failing rank's exception class as
    well (a ValueError there is a `PeerError` and a `ValueError` here, with the same
    message; an OSError keeps its errno and file name), so a handler written for the
    error catches it on every rank. `rank` is the rank that failed.
    """

    rank: int = -1


def agreed(exc: BaseException) -> BaseException:
    """Marks `exc` as raised on every rank at the same point (nothing to publish)."""
    exc.__dict__["fzero_agreed"] = True
    return exc


def agreement(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a function whose every error is raised on every rank alike (it compares
    what the ranks exchanged before it raises): its errors are marked `agreed`."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            agreed(exc)
            raise

    return call


def is_agreed(exc: BaseException) -> bool:
    return isinstance(exc, PeerError) or exc.__dict__.get("fzero_agreed", False)


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:  # private but stable: the default group's store, shared by every rank of the job
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def publish(exc: BaseException, rank: int, where: str) -> None:
    """Tells every rank that this one (`rank`) failed with `exc` inside `where` (the first
    failure of the job wins; later ones keep their own message locally)."""
    global _failed
    record = {"rank": rank, "where": where, "message": str(exc), "type": _builtin_base(exc)}
    if isinstance(exc, OSError):
        record.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    if _failed is None:
        _failed = record
    store = _store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # a store that is gone too: the peers time out
        store.compare_set(_KEY, "", json.dumps(record, default=str))
    exc.add_note(
        f"fzero: rank {rank} raised this inside {where}; every other rank raises it too "
        "(as fzero.PeerError). The process group is left unusable: restart the job"
    )


def failed() -> dict[str, Any] | None:
    """The job's published failure, if any (asking the store until one is known)."""
    global _failed
    if _failed is None:
        store = _store()
        try:
            if store is not None and store.check([_KEY]):
                _failed = json.loads(store.get(_KEY))
        except Exception:
            return None
    return _failed


def peer_error(record: dict[str, Any]) -> PeerError:
    """The exception a rank raises for a peer's published failure: a `PeerError` of the
    failing exception's builtin class, with its message."""
    cls = _peer_class(record.get("type", ""))
    if issubclass(cls, OSError) and record.get("errno") is not None:
        exc = cls(record["errno"], record["strerror"], record["filename"])
    else:
        exc = cls(record["message"])
    exc.rank = int(record["rank"])
    exc.add_note(f"fzero: rank {exc.rank} failed inside {record['where']}; this rank raises it too")
    return exc


def _peer_class(name: str) -> type[PeerError]:
    """`PeerError` for a RuntimeError, else a class deriving from both it and the builtin
    exception class `name` (made once, and found by pickle as this module's attribute)."""
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or base is RuntimeError:
        return PeerError
    attr = f"PeerError_{name}"
    if attr not in globals():
        cls = type(attr, (base, PeerError), {"__module__": __name__})
        cls.__doc__ = f"A peer's {name}, raised on this rank too (see `PeerError`)."
        globals()[attr] = cls
    return globals()[attr]


def __getattr__(attr: str) -> Any:
    # Unpickling a peer's error in another process (fzero.simulate's parent) finds its
    # class here before any was made in that process.
    if attr.startswith("PeerError_"):
        cls = _peer_class(attr.removeprefix("PeerError_"))
        if cls is not PeerError:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def _builtin_base(exc: BaseException) -> str:
    """The first builtin exception class in `exc`'s MRO (a torch or user error travels as
    the builtin class it derives from)."""
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls and issubclass(cls, Exception):
            return cls.__name__
    return "RuntimeError"


def check_alive() -> None:
    """Raises the job's failure if this process already knows of one (a step called
    again after a failure would wait on collectives that can never complete)."""
    if _failed is not None:
        raise peer_error(_failed)


@contextlib.contextmanager
def together(rank: int, size: int, where: str) -> Iterator[None]:
    """Runs an fzero call (`where`) so that it fails on every rank: an error this rank
    raises that its peers cannot know of is published (`publish`) as it leaves. Raises
    at once if the job already failed."""
    check_alive()
    try:
        yield
    except Exception as exc:
        if size > 1 and not is_agreed(exc):
            publish(exc, rank, where)
        raise


def collective(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorates a collective function with a `mesh` argument: its calls fail together
    (`together`) under the name `where`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                mesh = signature.bind_partial(*args, **kwargs).arguments.get("mesh")
            except TypeError:  # the call's own error says it better
                mesh = None
            if not (hasattr(mesh, "rank") and hasattr(mesh, "size")):
                return fn(*args, **kwargs)
            with together(mesh.rank, mesh.size, where):
                return fn(*args, **kwargs)

        return call

    return wrap


def wait(work: Any) -> None:
    """`work.wait()`, looking for a peer's published failure every `POLL` while it waits,
    and when the wait fails (a peer gone or timed out): its failure is what is raised."""
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            # The slice ran out (c10d's "Operation timed out!"), unless the collective is
            # complete: then it failed, or ended just now, and a plain wait says which.
            if work.is_completed():
                _finish(work)
                return
        record = failed()
        if record is not None:
            raise peer_error(record)


def _finish(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        record = failed()
        if record is not None:
            raise peer_error(record) from exc
        raise


class Polled:
    """A CPU collective in flight whose `wait()` polls for peers' failures (`wait`)."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        wait(self.work)
