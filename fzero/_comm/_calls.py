"""Calls: an fzero call entered on every rank of a mesh, checked to be the same call.

Every rank must make the same collective fzero calls in the same order. A rank whose
data ran out a batch early breaks that: it saves, or evaluates, while its peers step,
and the two calls' collectives pair wrongly (a hang, or gloo aborting the process on
sizes that differ; on NCCL, data of equal sizes exchanged between unrelated calls).
So each outermost call that communicates opens with one small exchange on the control
axis of what it is ([Note: the same call]): ranks in different calls all raise at once,
before either call issued anything else, and the job stays usable.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from ._control import all_gather_ints_async
from ._failure import agreed, outermost, together

_WORDS = 8  # int64 words of a call's name (64 bytes, longer names cut: never a false alarm)


@contextlib.contextmanager
def call(mesh: Any, where: str, sends: bool = True) -> Iterator[None]:
    """Runs the fzero call `where` on `mesh` so that it fails on every rank (`together`)
    and, where it is the outermost call and `sends` (it issues collectives), first checks
    that every rank of the mesh is in a call of the same name.

    Raises:
      ValueError: on every rank alike, when the ranks' calls differ.
    """
    with together(mesh.rank, mesh.size, where):
        if sends and mesh.size > 1 and hasattr(mesh, "control") and outermost():
            same_call(mesh, where)
        yield


def same_call(mesh: Any, where: str) -> None:
    """Raises on every rank alike unless every rank of `mesh` is in a call named `where`."""
    words = _words(where)
    # Not a pending collective of the call: a failure after it is still the rank's alone.
    everyone = all_gather_ints_async(words, mesh, counted=False)()
    if all(w == words for w in everyone):
        return
    listed = ", ".join(f"rank {r} in {_name(w)}" for r, w in enumerate(everyone))
    raise agreed(
        ValueError(
            f"fzero: the ranks are in different fzero calls ({listed}). Every rank must "
            "make the same collective calls in the same order: a rank whose data ran out "
            "early, or a call made on one rank only (`if rank == 0:` around a save or "
            "master_params), is the usual cause. A rank without data steps with "
            "step(state, None) (docs/training.md, Uneven work)"
        )
    )


def _words(where: str) -> list[int]:
    raw = where.encode()[: 8 * _WORDS].ljust(8 * _WORDS, b"\0")
    return [int.from_bytes(raw[k : k + 8], "little", signed=True) for k in range(0, len(raw), 8)]


def _name(words: list[int]) -> str:
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="replace")


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def collective(where: str, sends: bool = True) -> Decorator:
    """Decorates a collective function with a `mesh` argument: its calls are `call`s named
    `where` (fail together, checked to be the same call on every rank)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                mesh = signature.bind_partial(*args, **kwargs).arguments.get("mesh")
            except TypeError:  # the call's own error says it better
                mesh = None
            if not (hasattr(mesh, "rank") and hasattr(mesh, "size")):
                return fn(*args, **kwargs)
            with call(mesh, where, sends):
                return fn(*args, **kwargs)

        return run

    return wrap
