"""Overlap: an offloaded state's buckets stepped on the host while the backward goes on.

A bucket's gradient is final once every entry of the forward that holds it is reduced
(`_engine.Reductions`' watch), and the backward reduces the last units first: the ones
offload puts on the host first (`chosen_buckets`). Where nothing in the step needs the
whole gradient before an update (no loss scaler and its inf check, no qgZ check, an
optimizer that never asked for the global norm), and the step's loss weights are agreed
(the call check's words), such a bucket steps at once, on the step function's host
thread: its gradient taken to the mean and scaled by the step's factor exactly as after
the backward, carried to the host (from a GPU: pinned memory, on a side stream, two
buckets ahead at most), updated, and its new master sent back on a return stream that
the step's stream waits for at `join`. The device meanwhile runs the rest of the
backward. The values are those of the update after
the backward, bitwise: the same operations on the same values, with units that do not
interact taken in another order (docs/design.md, [Note: offload]).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .._comm import raise_if_failed
from .._state import mark_consumed
from ._streamed import Streamer

AHEAD = 2  # buckets whose gradients are carried to the host before their update ends


class Overlap:
    """One step's offloaded buckets, each stepped on `thread` as soon as its gradient is
    final; called as the backward's watch (`mean_grad`'s `watch=`).

    Args:
      streamer: the step's offloaded update.
      factor: the step's gradient factor (`Tally.factor`), or None if the ranks' loss
        weights are not known to be usable; asked once, at the first final bucket.
      thread: the step function's host thread (one worker: buckets in the order their
        gradients are final).
      device: where the parameters are (a GPU's current stream is the step's, captured
        here on the caller's thread: it waits, at `join`, for the masters sent back).
    """

    def __init__(
        self,
        streamer: Streamer,
        factor: Callable[[], float | None],
        thread: ThreadPoolExecutor,
        device: torch.device | None,
    ) -> None:
        self.streamer, self.ask, self.thread = streamer, factor, thread
        self.device = device if device is not None and device.type == "cuda" else None
        self.stream = None if self.device is None else torch.cuda.current_stream(self.device)
        # A GPU's side streams: gradients to the host, masters back. Neither waits behind
        # the backward's kernels queued on the step's stream, only for what it needs.
        self.copies: Any = None
        self.back: Any = None
        self.factor: float | None = None
        self.asked = False
        self.taken: set[int] = set()  # buckets handed over (`apply_update` skips them)
        self.lock = threading.Lock()
        self.waiting: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()
        self.carried: dict[int, list[Any]] = {}  # bucket -> its gradient pieces, underway
        self.futures: list[Future[None]] = []
        self.cancelled = False  # the step failed: the host thread stops at once
        self.failed = False  # a bucket's update raised: the others are not begun

    def __call__(self, k: int, g: torch.Tensor) -> None:
        st = self.streamer
        if k not in st.offloaded or not st.unit(k):  # not here, or none of it this rank's
            return
        if not self.asked:
            self.asked, self.factor = True, self.ask()
        if self.factor is None:  # a refused loss or no weight: decided after the backward
            return
        ready = None
        if g.device.type == "cuda":  # what the side streams wait for: g is reduced
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(g.device))
        self.taken.add(k)
        with self.lock:
            self.waiting.append((k, g, ready))
            self._carry_ahead()
        self.futures.append(self.thread.submit(self._run))

    def _carry_ahead(self) -> None:
        """Starts carrying the next waiting buckets' gradients to the host, up to `AHEAD`
        underway (pinned memory for two units, not for every unit the backward is done
        with), and reads their disk state ahead. Under `lock`."""
        for k, g, ready in self.waiting:
            if len(self.carried) >= AHEAD:
                return
            if k not in self.carried:
                self.carried[k] = self._carry(k, g, ready)
                self.streamer.placement.prefetch(k)

    def _carry(self, k: int, g: torch.Tensor, ready: Any) -> list[Any]:
        """Bucket k's gradient in the master's dtype, scaled by the step's factor (as
        `apply_update` makes it), cut into its pieces and started towards the host. On a
        GPU the cast is made on the carry's stream and freed once copied: the device never
        holds more than `AHEAD` of them."""
        st = self.streamer
        dtype, factor = st.target.buffers[k].dtype, self.factor
        assert factor is not None
        if g.device.type != "cuda":  # on the host already: the update reads it in place
            x = g.to(dtype)
            if factor != 1.0:
                x.mul_(factor)
            return list(st.target.layout.bucket_pieces(k, x, st.target.rank))
        if self.copies is None:
            self.copies = torch.cuda.Stream(g.device)
        out: list[Any] = []
        with torch.cuda.device(g.device), torch.cuda.stream(self.copies):
            self.copies.wait_event(ready)
            x = g.to(dtype)
            if factor != 1.0:
                x.mul_(factor)
            for p in st.target.layout.bucket_pieces(k, x, st.target.rank):
                host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                host.copy_(p, non_blocking=True)
                out.append(host)
            g.record_stream(self.copies)  # read here: not reused before the copy is done
            done = torch.cuda.Event()
            done.record(self.copies)
        return [(host, done) for host in out]

    def _run(self) -> None:
        """On the host thread: the oldest waiting bucket, updated."""
        with self.lock:
            k, g, ready = self.waiting.popleft()
            if k not in self.carried and not (self.cancelled or self.failed):
                self.carried[k] = self._carry(k, g, ready)
                self.streamer.placement.prefetch(k)
        try:
            if self.cancelled or self.failed:
                return
            pieces = tuple(self._arrived(c) for c in self.carried[k])
            with self._sending_back(ready):
                self.streamer.step_bucket(k, pieces)
        except BaseException:
            self.failed = True
            raise
        finally:
            with self.lock:
                self.carried.pop(k, None)  # its pinned memory goes back to torch's cache
                if not (self.cancelled or self.failed):
                    self._carry_ahead()

    @contextlib.contextmanager
    def _sending_back(self, ready: Any) -> Iterator[None]:
        """A GPU's masters sent back on the return stream, once the step's stream has
        reduced the bucket (a stage-3 shard is written in place: whatever read it in this
        backward came before)."""
        if self.device is None:
            yield
            return
        if self.back is None:
            self.back = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self.back):
            if ready is not None:
                self.back.wait_event(ready)
            else:  # a gradient on the host: order after all the step's stream has queued
                self.back.wait_stream(self.stream)
            yield

    def _arrived(self, carried: Any) -> torch.Tensor:
        """A gradient piece once on the host; raises `_Cancelled` if the step failed
        meanwhile (a copy behind a collective that never ends must not hold it)."""
        if not isinstance(carried, tuple):
            return carried
        host, done = carried
        while not done.query():
            if self.cancelled:
                raise _Cancelled
            time.sleep(2e-4)
        return host

    def join(self) -> None:
        """Waits for every bucket handed over (looking for a peer's published failure
        meanwhile: a GPU's copies may wait behind a collective that never ends), raises
        the first one's error, and has the step's stream wait for the masters sent back
        (the values on the device are the return stream's until then)."""
        pending = set(self.futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=_POLL)
            if pending:
                raise_if_failed()
        for f in self.futures:
            f.result()
        if self.back is not None:
            assert self.stream is not None
            self.stream.wait_stream(self.back)
            for k in self.taken:  # made on the return stream, used on the step's
                value = self.streamer.delivered[k]
                if value.device.type == "cuda":  # `Offload(params=True)`: the host's
                    value.record_stream(self.stream)

    def abort(self) -> None:
        """The step failed: stops the host thread as soon as it can (a bucket being
        updated is finished)."""
        self.cancelled = True
        for f in self.futures:
            f.cancel()
        concurrent.futures.wait(self.futures, timeout=_ABORT_WAIT)


_POLL = 0.2  # seconds between looks for a peer's failure while the host thread works
_ABORT_WAIT = 60.0  # seconds a failed step waits for the host thread's current bucket


class _Cancelled(Exception):
    """The step failed while a bucket's gradient was on its way to the host."""


@contextlib.contextmanager
def overlapping(
    streamed: Streamer | None,
    factor: Callable[[], float | None],
    thread: ThreadPoolExecutor | None,
    state: Any,
    device: torch.device | None,
    rank: int,
) -> Iterator[Overlap | None]:
    """A step's `Overlap` for the block (None: nothing offloaded, or no `thread`: the
    step may not overlap). A block that raises stops the host thread first; if it had
    begun updating buckets in place (a donating step), the state given to the step is
    marked consumed and the error says so: the step neither finished nor left the state
    as it was."""
    early = None
    if thread is not None and streamed is not None:
        early = Overlap(streamed, factor, thread, device)
    try:
        yield early
    except BaseException as exc:
        # Stepped unit by unit (on the host thread, or after the backward), a donating
        # update may have written some units when a later one failed.
        if early is not None:
            early.abort()
        begun = sorted(streamed.written) if streamed is not None else []
        if begun and streamed is not None and streamed.donate:
            mark_consumed(state)
            if hasattr(exc, "add_note"):  # Python 3.11
                which = ["the device's" if k < 0 else k for k in begun]
                exc.add_note(
                    f"rank {rank}: the step had updated buckets {which} in place, unit by "
                    "unit, when it failed: the state it was given is partly updated and "
                    "consumed. Resume from a checkpoint"
                )
        raise
    finally:
        if early is not None and not early.cancelled:
            concurrent.futures.wait(early.futures)
