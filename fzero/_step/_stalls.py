"""Stalls: what a collective that failed or timed out inside a step, a forward or a `bind`
block usually means, said where gloo's or NCCL's own message names only the wait."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._comm import PeerError, is_peer_failure, published

# Per call: what a peer stops calling, and the promise every rank keeps in it.
_KEPT = {
    "sharded_step": (
        "step",
        "every rank must call it the same number of times: a rank without data this step "
        "calls step(state, None)",
    ),
    "sharded_forward": (
        "forward",
        "every rank must call it the same number of times: a rank without data calls "
        "forward(state, None)",
    ),
    "bind": (
        "the bound model",
        "every rank must make the same unit calls inside the block: a rank whose "
        "generation ended keeps running the model until every rank's has "
        "(model.generate(..., synced_gpus=True))",
    ),
}


def stalled(exc: BaseException, where: str, rank: int, step: int | None = None) -> RuntimeError:
    """A collective inside `where` (a key of `_KEPT`) failed: say what usually causes it."""
    at = f"step {step}: " if step is not None else f"{where}: "
    what, kept = _KEPT[where]
    return RuntimeError(
        f"rank {rank}: {at}a collective failed or timed out ({exc}). Usually a peer "
        f"stopped calling {what} ({kept}), died, or took longer than the process group's "
        "timeout"
    )


@contextlib.contextmanager
def said_stalled(where: str, rank: int, step: int | None = None) -> Iterator[None]:
    """Within the block, a collective that fails or times out (other than a `PeerError`)
    is raised as a peer's published failure if there is one, else as `stalled`'s
    RuntimeError."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, PeerError) or not is_peer_failure(exc):
            raise
        # A compiled graph's collectives wait inside the graph, where a peer's published
        # failure cannot be seen, and an eager wait may end before its poll looked: it is
        # what ended the wait, if there is one.
        peer = published()
        if peer is not None:
            raise peer from exc
        raise stalled(exc, where, rank, step) from exc
