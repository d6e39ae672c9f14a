"""Polled waits: a CPU collective's wait that looks for a peer's published failure.

A rank whose peer failed inside an fzero call would otherwise wait in a collective the
failed rank never joins until the process group's timeout ([Note: failing together]).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from ._failure import failed, peer_error, published

# How long a wait blocks before it first looks at the store: a wait that ends sooner never
# asks it. Later slices double up to POLL_MAX, so that a long wait (a slow peer, rank 0
# writing a file) asks the store at most every POLL_MAX: the bound on how late a peer
# learns of a failure, and what N waiting ranks cost the store's host.
POLL, POLL_MAX = 0.1, 0.4


def wait(work: Any, within: float | None = None) -> None:
    """`work.wait()`, looking for a peer's published failure every `POLL` while it waits,
    and when the wait fails (a peer gone or timed out): its failure is what is raised.
    `within`: seconds after which it gives up with a TimeoutError, the work still in
    flight (None: the process group's timeout)."""
    slice_ = POLL
    start = time.monotonic()
    while True:
        try:
            work.wait(timedelta(seconds=slice_))
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
        if within is not None and time.monotonic() - start > within:
            raise TimeoutError(f"fzero: a control collective still waited for after {within} s")
        slice_ = min(2 * slice_, POLL_MAX)


def _finish(work: Any) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        peer = published()
        if peer is not None:
            raise peer from exc
        raise


class Polled:
    """A CPU collective in flight whose `wait()` polls for peers' failures (`wait`).

    Not for gloo's point-to-point works: a send or receive that outlives a timed wait
    signals the timeout to the whole context, breaking the group; those are waited for
    plainly."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        wait(self.work)
