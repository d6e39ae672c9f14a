"""Control: a few host values per rank, all-gathered on the control axis (agreement
checks, loss weights, the first step's configuration), from the CPU: waiting for them
never waits for a GPU's queue, and every wait looks for a peer's failure (`_failure`)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._failure import check_alive
from ._ledger import record
from ._mesh import Mesh
from ._polled import wait as _wait

BITS = 62  # flags per int64 word, clear of the sign bit


def pack_flags(flags: Sequence[bool]) -> list[int]:
    """Bools as int64 words, `BITS` to a word: a flag per leaf or unit in a few values."""
    words = [0] * -(-len(flags) // BITS)
    for k, f in enumerate(flags):
        words[k // BITS] |= int(f) << (k % BITS)
    return words


def unpack_flags(words: Sequence[int], n: int) -> list[bool]:
    """The `n` bools `pack_flags` packed into `words`."""
    return [bool(words[k // BITS] >> (k % BITS) & 1) for k in range(n)]


def all_gather_ints_async(
    values: list[int], mesh: Mesh, counted: bool = True
) -> Callable[..., list[list[int]]]:
    """Starts gathering every rank's short list of int64 `values` (the same length on every
    rank); the returned function waits and gives them in rank order. One small all-gather
    (not `all_gather_async`, which on gloo broadcasts once per rank), for checks that run
    every step behind other work. Sent from the CPU on the control axis, so waiting for
    it never waits for the GPU's queue. `counted`: see `check_alive`; the wait's `within`:
    see `_polled.wait`."""
    check_alive(counted)
    mine = torch.tensor(values, dtype=torch.int64, device="cpu")
    if mesh.size == 1:
        return lambda within=None: [values]
    out = [torch.empty_like(mine) for _ in range(mesh.size)]
    record("all_gather", mine.dtype, mine.numel() * mesh.size, "control", control=True)
    work = dist.all_gather(out, mine, group=mesh.control.group, async_op=True)

    def wait(within: float | None = None) -> list[list[int]]:
        _wait(work, within)
        return [t.tolist() for t in out]

    return wait


def barrier(mesh: Mesh) -> None:
    """Returns once every rank has called it: one small all-gather on the control axis,
    whose wait looks for a peer's failure, so a rank that failed before calling it (a
    compiled loss's trace that raised) ends its peers' wait at once."""
    all_gather_ints_async([0], mesh)()


def all_gather_object(obj: Any, mesh: Mesh, counted: bool = True) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (small metadata only; on the control
    axis, from the CPU). `counted`: see `check_alive`."""
    check_alive(counted)
    if mesh.size == 1:
        return [obj]
    # torch's all_gather_object waits where no peer's failure can be seen: the same two
    # collectives (sizes, then the padded bytes), waited for as every other.
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather_ints_async([data.numel()], mesh, counted)()
    most = max(s[0] for s in sizes)
    mine = torch.zeros(most, dtype=torch.uint8, device="cpu")
    mine[: data.numel()] = data
    rows = [torch.empty_like(mine) for _ in range(mesh.size)]
    record("all_gather", mine.dtype, most * mesh.size, "control", control=True)
    _wait(dist.all_gather(rows, mine, group=mesh.control.group, async_op=True))
    return [pickle.loads(r[: s[0]].numpy().tobytes()) for r, s in zip(rows, sizes)]
