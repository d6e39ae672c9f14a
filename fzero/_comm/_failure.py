"""Failure: an error on one rank raised on every rank, at once, with that rank's message.

Two kinds ([Note: failing together]):

- **Agreed** errors: a check whose outcome every rank learns from the same exchange (the
  call check, the first step's configuration), so every rank raises the same error at
  the same point, with no collective left half-done: the process group stays usable.
  `agreed(exc)` marks one, where it is raised from what the exchange said.
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
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

# The store outlives a torchrun attempt (the agent's store serves every restart): keys
# name the attempt, so a restarted job's call n never reads the failed attempt's.
_ATTEMPT = "{}/{}".format(
    os.environ.get("TORCHELASTIC_RUN_ID", "-"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
)
_KEY = "fzero/" + _ATTEMPT + "/failed/{}"  # per call (see `together`): its first failure
_STUCK = "fzero/" + _ATTEMPT + "/stuck/{}"  # per call: a rank was left waiting in it
_COUNT = "fzero/" + _ATTEMPT + "/failures/{}"  # per call: ranks that failed in it themselves
# The job's first failure that left its rank's collectives pending: that rank joins no
# later call, so a peer waiting in one (the step after, which the failed step's last
# collective let it reach) finds it here.
_BROKEN = "fzero/" + _ATTEMPT + "/broken"
# The last failure of a call its rank issued no collective in (every rank of a forward
# at stages 0-2, say): its peers that left that call whole wait in a later one for a
# rank that will not come, unless every rank failed in it too (`_lone_failure`).
_LONE = "fzero/" + _ATTEMPT + "/lone"

# The fzero calls this process is inside, innermost last, each by its number: every rank
# makes the same calls in the same order (they are collective), so a call's number is the
# same on every rank, and a failure published under it concerns only the ranks inside it.
_calls: list[tuple[int, int]] = []
_made = 0  # numbered calls (those that send: `together`) entered so far
_between = 0  # outermost calls that send nothing entered since the last numbered one


def _key(call: tuple[int, int]) -> str:
    """A call's number as the store's keys name it."""
    return f"{call[0]}.{call[1]}"


_issued = 0  # collectives issued so far (`check_alive` counts them)
# Calls this rank failed in before issuing any collective, with what it published: if a
# peer was left waiting in one, this rank's own later collectives cannot pair either.
_alone: dict[tuple[int, int], dict[str, Any]] = {}

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


def is_agreed(exc: BaseException) -> bool:
    """Whether every rank raises `exc` without being told (agreed, a peer's, or already
    published by an inner call)."""
    d = exc.__dict__
    return isinstance(exc, PeerError) or d.get("fzero_agreed", False) or "fzero_published" in d


def _store() -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:  # private but stable: the default group's store, shared by every rank of the job
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def publish(exc: BaseException, rank: int, where: str, issued: bool, size: int = 0) -> None:
    """Tells the ranks inside this call that this one (`rank`) failed with `exc` inside
    `where` (the first failure of a call wins). `issued`: this rank issued collectives in
    the call, which may be left pending, so its own later calls raise it at once."""
    global _failed
    call = _calls[-1] if _calls else (0, 0)
    record = {
        "rank": rank,
        "where": where,
        # A KeyboardInterrupt says nothing: its peers' error names it instead.
        "message": str(exc) or type(exc).__name__,
        "type": _builtin_base(exc),
        "name": f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        "call": list(call),
        "size": size,
    }
    if isinstance(exc, OSError):
        record.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    first = "fzero_published" not in exc.__dict__
    exc.__dict__.setdefault("fzero_published", []).append(call)
    if issued and _failed is None:
        _failed = record
    elif not issued:
        _alone[call] = record
    store = _store()
    if store is None or not _calls:
        return
    with contextlib.suppress(Exception):  # a store that is gone too: the peers time out
        said = json.dumps(record, default=str)
        store.compare_set(_KEY.format(_key(call)), "", said)
        store.add(_COUNT.format(_key(call)), 1)
        if issued:
            store.compare_set(_BROKEN, "", said)
        else:
            store.set(_LONE, said)
    if not first:
        return
    _note(
        exc,
        f"fzero: rank {rank} raised this inside {where}; every other rank waiting there "
        "raises it too (as fzero.PeerError)",
    )


def failed() -> dict[str, Any] | None:
    """A failure published in a call this process is inside (or one it already knows of):
    a peer stuck in a call a rank left by failing finds it; a failure of a call every
    rank has left (all raised the same error before any collective) is ignored. And this
    rank's own failure of an earlier call, if a peer was left waiting in it."""
    global _failed
    store = _store()
    if _failed is not None or store is None:
        return _failed
    try:
        # One key at a time: a store's check([...]) says whether all of them exist.
        for n in _calls:
            if store.check([_KEY.format(_key(n))]):
                _failed = json.loads(store.get(_KEY.format(_key(n))))
                store.set(_STUCK.format(_key(n)), "1")  # a rank that failed alone: `_settle`
                return _failed
        for n, record in _alone.items():
            if store.check([_STUCK.format(_key(n))]):
                _failed = record
                return _failed
        if _calls and store.check([_BROKEN]):
            _failed = json.loads(store.get(_BROKEN))
            return _failed
        if _calls and store.check([_LONE]):
            _failed = _lone_failure(store, json.loads(store.get(_LONE)))
    except Exception:
        return None
    return _failed


def _lone_failure(store: Any, record: dict[str, Any]) -> dict[str, Any] | None:
    """`record`, a failure of an earlier call than this rank's, if its rank failed there
    alone (not every rank: then nothing is pending and the job goes on): this rank left
    that call whole and waits in a later one for a rank that will not come. Said in the
    store as a rank left waiting in that call (`_STUCK`), which the failed rank's next
    call reads (`_settle`): the job has failed, on every rank alike."""
    n = tuple(record["call"])
    left = n not in _calls and n < _calls[-1]  # a call before this rank's current one
    if not left or int(store.add(_COUNT.format(_key(n)), 0)) >= int(record.get("size", 0)):
        return None
    store.set(_STUCK.format(_key(n)), "1")
    return record


def peer_error(record: dict[str, Any]) -> PeerError:
    """The exception a rank raises for a peer's published failure: a `PeerError` of the
    failing exception's builtin class, with its message. This rank's own collectives are
    left pending: its later calls raise it too."""
    global _failed
    if _failed is None:
        _failed = record
    cls = _peer_class(record.get("type", ""))
    try:
        if issubclass(cls, OSError) and record.get("errno") is not None:
            exc = cls(record["errno"], record["strerror"], record["filename"])
        else:
            exc = cls(record["message"])
    except Exception:  # a class whose constructor wants more (UnicodeDecodeError, ...)
        exc = PeerError(record["message"])
    exc.rank = int(record["rank"])
    name = record.get("name", record.get("type", ""))
    _note(
        exc,
        f"fzero: rank {exc.rank} failed inside {record['where']} ({name}); this rank raises it too",
    )
    return exc


def published() -> PeerError | None:
    """A peer's published failure as this rank's `PeerError`, if there is one: for a wait
    that could not look for it (a compiled graph's collectives wait inside the graph)
    and ended in a timeout or a closed connection instead."""
    record = failed()
    return None if record is None else peer_error(record)


def _peer_class(name: str) -> type[PeerError]:
    """`PeerError` for a RuntimeError, else a class deriving from both it and the builtin
    exception class `name` (made once, and found by pickle as this module's attribute)."""
    base = getattr(builtins, name, None)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        return PeerError
    if base in (Exception, RuntimeError) or name.endswith("ExceptionGroup"):
        return PeerError
    attr = f"PeerError_{name}"
    if attr not in globals():
        try:
            # A KeyError's str() is its key's repr: the peer's, made from the message,
            # says the message as it is.
            body = {"__module__": __name__, "__str__": BaseException.__str__}
            if not issubclass(base, KeyError):
                del body["__str__"]
            cls = type(attr, (base, PeerError), body)
        except TypeError:  # no consistent class order with it: a plain PeerError
            return PeerError
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


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(text)


def _builtin_base(exc: BaseException) -> str:
    """The first builtin exception class in `exc`'s MRO (a torch or user error travels as
    the builtin class it derives from)."""
    for cls in type(exc).__mro__:
        if getattr(builtins, cls.__name__, None) is cls and issubclass(cls, Exception):
            return cls.__name__
    return "RuntimeError"


def raise_if_failed() -> None:
    """Raises the job's failure if one is known or published for a call this process is
    inside: for a wait that is not a collective's (a host thread's, behind a GPU's copies
    that may wait on a collective a failed peer never joins)."""
    record = failed()
    if record is not None:
        raise peer_error(record)


def check_alive(counted: bool = True) -> None:
    """Before a collective: raises the job's failure if this process knows of one (a
    collective after it would pair with ones that can never complete). `counted`: the
    collective may be left pending by a failure after it (not one waited for at once)."""
    global _issued
    if _failed is not None:
        raise peer_error(_failed)
    if _before:  # a call's check waited for before its first collective (`_calls`)
        _before.pop()()
    _issued += int(counted)


def left_in_flight() -> None:
    """Counts a collective this call issued and left in flight (a check it gave up
    waiting for): a failure of the call then leaves the job failed, as after any
    collective."""
    global _issued
    _issued += 1


def before_next_collective(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """Has `check_alive` run `fn` once, before the next collective (None: drops the one
    set); returns the one it replaces, if it has not run."""
    was = _before.pop() if _before else None
    if fn is not None:
        _before.append(fn)
    return was


_before: list[Callable[[], None]] = []


@contextlib.contextmanager
def together(rank: int, size: int, where: str, numbered: bool = True) -> Iterator[None]:
    """Runs an fzero call (`where`) so that it fails on every rank: an error this rank
    raises that its peers cannot know of is published (`publish`) as it leaves. Raises
    at once if the job already failed. `numbered`: the call sends something, and so has
    a number of its own, the same on every rank, (n, 0); one that sends nothing (a
    forward at stages 0-2, which one rank may make alone) is the k-th after call n, (n,
    k), so that the numbers of the calls that send stay the same on every rank."""
    global _made, _between
    if _alone:
        _settle(size)
    if _failed is not None:
        raise peer_error(_failed)
    if numbered:
        _made, _between = _made + 1, 0
        _calls.append((_made, 0))
    elif _calls:  # inside another call: its part
        _calls.append(_calls[-1])
    else:
        # Between two calls that send, the k-th that sends nothing: (n, k). Its failure is
        # found by peers that left it (or never made it: one rank sampling alone) as a
        # lone one, and one every rank made in it alike leaves nothing pending.
        _between += 1
        _calls.append((_made, _between))
    issued = _issued
    _outermost.append(_outermost[-1] if _outermost else where)
    try:
        yield
    except BaseException as exc:  # KeyboardInterrupt too: a handler's save comes next
        # Not a generator closed around a `bind` block: every rank's consumer stopped.
        # Published in each call it leaves, not only the innermost: a peer that left an
        # inner call whole (a step's update) waits in the outer one's next collective.
        d = exc.__dict__
        mine = not (isinstance(exc, (PeerError, GeneratorExit)) or d.get("fzero_agreed"))
        if size > 1 and mine and _calls[-1] not in d.get("fzero_published", ()):
            # Named as the call the user made (a step, not its update inside).
            publish(exc, rank, _outermost[-1], _issued > issued, size)
        raise
    finally:
        _calls.pop()
        _outermost.pop()


_outermost: list[str] = []  # per call this process is inside: the outermost one's name


def _settle(size: int) -> None:
    """Before this rank's next call after failing alone (before issuing a collective):
    waits until its peers say whether they were left waiting in the calls it failed in
    (then the job has failed: `_failed`) or failed in them too (then nothing is pending).
    A collective issued while a peer still has one pending in the group would pair with
    it. One failure leaves several calls at once (a call and the ones nested in it), and a
    peer marks only the one it waited in: all are settled together, each pass looking at
    every one."""
    global _failed
    store = _store()
    deadline = time.monotonic() + _SETTLE
    left = dict(_alone)
    _alone.clear()
    while store is not None and left and _failed is None:
        try:
            for n, record in list(left.items()):
                if store.check([_STUCK.format(_key(n))]):
                    _failed = record
                    break
                if int(store.add(_COUNT.format(_key(n)), 0)) >= size:
                    del left[n]  # every rank failed in it: nothing pending there
            if _failed is None and left and store.check([_BROKEN]):
                _failed = json.loads(store.get(_BROKEN))  # a peer's left collectives pending
        except Exception:  # a store that cannot answer: assume the worst
            _failed = next(iter(left.values()))
        if _failed is None and left and time.monotonic() > deadline:
            _failed = next(iter(left.values()))
        if _failed is None and left:
            time.sleep(0.02)


_SETTLE = 60.0  # seconds `_settle` waits for slow peers to fail alike or report
