"""Calls: an fzero call entered on every rank of a mesh, checked to be the same call.

Every rank must make the same collective fzero calls in the same order. A rank whose
data ran out a batch early breaks that: it saves, or evaluates, while its peers step,
and the two calls' collectives pair wrongly (a hang, or gloo aborting the process on
sizes that differ; on NCCL, data of equal sizes exchanged between unrelated calls).
So each outermost call that communicates exchanges what it is on the control axis
([Note: the same call]), started as it is entered and waited for before its first
collective: ranks in different calls all raise at once, before either call issued
anything else, and the job stays usable.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from ._control import all_gather_ints_async, all_gather_object
from ._failure import agreed, before_next_collective, is_agreed, left_in_flight, together

_WORDS = 8  # int64 words of a call's name (64 bytes, longer names cut: never a false alarm)
_open = 0  # sending calls this process is inside: only the outermost checks


@contextlib.contextmanager
def call(
    mesh: Any, where: str, sends: bool = True, problem: str | Callable[[], str] | None = None
) -> Iterator[None]:
    """Runs the fzero call `where` on `mesh` so that it fails on every rank (`together`)
    and, where it is the outermost call that sends anything (`sends`), checks that every
    rank of the mesh is in a call of the same name before its first collective.

    Args:
      mesh: the call's mesh.
      where: the call's name.
      sends: whether the call issues collectives (a forward at stages 0-2 does not, and
        one rank may make it alone).
      problem: for a call that may be refused: this rank's reason ("" if none), or what
        finds it (called inside the call, so that an error finding it fails every rank),
        raised on every rank alike (with the name check, or in an exchange of its own
        where the call is inside another).

    Raises:
      ValueError: on every rank alike, when the ranks' calls differ or a rank's
        `problem` is not "".
    """
    global _open
    several = mesh.size > 1 and hasattr(mesh, "control")
    check = sends and _open == 0 and several
    with together(mesh.rank, mesh.size, where, numbered=sends):
        if callable(problem):
            problem = problem()
        if problem and mesh.size == 1:
            raise agreed(ValueError(problem))
        if problem is not None and sends and several and not check:
            # Inside a call that checked its name: the same exchange, whose shape every
            # call's first on the control axis has (a rank not nested pairs with it).
            _start(mesh, where, problem)()
        pending = _start(mesh, where, problem or "") if check else None
        _open += int(sends)
        try:
            if pending is not None and problem:
                pending()  # this rank refuses: no need to run the call's first part
            elif pending is not None:
                before_next_collective(pending)
            yield
        except BaseException as exc:
            if pending is not None and before_next_collective(None) is pending:
                _settled(pending, exc)
            raise
        else:
            if pending is not None and before_next_collective(None) is pending:
                pending()  # a call that issued nothing still pairs its check
        finally:
            _open -= int(sends)


_EXIT_WAIT = 10.0  # seconds a failing call waits for its unchecked name's exchange


def _settled(pending: Callable[..., None], exc: BaseException) -> None:
    """A call that raised before its first collective: its name's exchange is in flight.
    Waited for a while: peers in the same call complete it at once (and a failure every
    rank made alike leaves nothing pending); where they do not come (not in an fzero call,
    or interrupted) the call's own error goes on, and the exchange left in flight counts
    as a collective of the call, which a later one would pair with."""
    if not isinstance(exc, Exception):  # KeyboardInterrupt: at once
        left_in_flight()
        return
    try:
        pending(within=_EXIT_WAIT)
    except TimeoutError:
        left_in_flight()
    except Exception as said:
        if is_agreed(said):  # different calls: what every rank raises, the job usable
            raise said from exc
        # A peer's failure: the call's own error goes on.


def _start(mesh: Any, where: str, problem: str) -> Callable[[], None]:
    """Starts the all-gather of this call's name (and whether this rank refuses it);
    returns what waits for it and raises as every rank alike."""
    # Not a pending collective of the call once waited: a failure after it is the rank's own.
    wait = all_gather_ints_async([*_words(where), int(bool(problem))], mesh, counted=False)

    def check(within: float | None = None) -> None:
        everyone = wait(within)
        if any(w[:_WORDS] != everyone[0][:_WORDS] for w in everyone):
            listed = ", ".join(f"rank {r} in {_name(w[:_WORDS])}" for r, w in enumerate(everyone))
            raise agreed(
                ValueError(
                    f"fzero: the ranks are in different fzero calls ({listed}). Every rank "
                    "must make the same collective calls in the same order: a rank whose "
                    "data ran out early, or a call made on one rank only (`if rank == 0:` "
                    "around a save or master_params), is the usual cause. A rank without "
                    "data steps with step(state, None) (docs/training.md, Uneven work)"
                )
            )
        if any(w[_WORDS] for w in everyone):
            said = all_gather_object(problem, mesh, counted=False)
            raise agreed(ValueError("; ".join(p for p in said if p)))

    return check


def _words(where: str) -> list[int]:
    raw = where.encode()[: 8 * _WORDS].ljust(8 * _WORDS, b"\0")
    return [int.from_bytes(raw[k : k + 8], "little", signed=True) for k in range(0, len(raw), 8)]


def _name(words: list[int]) -> str:
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def collective(where: str, sends: Callable[..., bool] | bool = True) -> Decorator:
    """Decorates a collective function with a `mesh` argument: its calls are `call`s named
    `where` (fail together, checked to be the same call on every rank). `sends`: whether
    a call issues collectives, or a function of the call's arguments saying so."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:  # the call's own error says it better
                bound = {}
            mesh = bound.get("mesh")
            if not (hasattr(mesh, "rank") and hasattr(mesh, "size")):
                return fn(*args, **kwargs)
            with call(mesh, where, sends(**bound) if callable(sends) else sends):
                return fn(*args, **kwargs)

        return run

    return wrap
