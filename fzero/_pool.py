"""Pool: the host buffers a step function's gradient bursts reuse from one call to the next.

DDP allocates its gradient buckets once and keeps them; on a GPU the caching allocator
does as much for any buffer. On the CPU, glibc returns the freed top of its heap to the
OS (once more than its trim threshold is free there), and the next allocation faults
every page back in, ~3 µs a page here: a step that allocates and frees tens of
megabytes of bursts, in a process whose heap top lies just there (decided by every
other allocation of the process: data loading, evaluation, a second model), took 5-25k
page faults a step, 10-40 % of the Linear stack's step at stages 0-1 in
benchmarks/RESULTS.md. Bursts come back in the same sizes every step, so they are kept.

A buffer is lent to a step (`take`) and comes back when nothing reads it any more: a
stage-1 burst when its reduce-scatter is done (`give`), so one burst's buffer serves the
next; the rows of sums those reduce-scatters return (stage 1's gradient), and stage 0's
bursts (whose all-reduced values *are* its gradient), at the end of the step
(`reclaim`), unless the state the step returns refers to them (an optimizer keeping the
gradient itself in its state, as a pure function may): those are left to the state. The
pool holds at most the buffers a step had alive at once. Stages 2-3 reduce the
gradients autograd assembles unit by unit, not bursts: nothing of theirs is pooled.
Device buffers are not pooled either: the caching allocator reuses them already.
"""

from __future__ import annotations

from typing import Any

import torch

from ._tree import tree_flatten

_Key = tuple[int, torch.dtype, torch.device]


class Pool:
    """Host buffers by (elements, dtype, device): free ones, and those lent this step."""

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lent: list[torch.Tensor] = []
        self._taken: list[torch.Tensor] = []  # lent this step, whether given back yet or not

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of `numel` elements (contents undefined), lent until given back."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        free = self._free.get((numel, dtype, device))
        buf = free.pop() if free else torch.empty(numel, dtype=dtype, device=device)
        self._lent.append(buf)
        self._taken.append(buf)
        return buf

    def give(self, buffers: list[torch.Tensor]) -> None:
        """`buffers` (lent by `take`) are no longer read or written by anything."""
        for buf in buffers:
            for k, lent in enumerate(self._lent):
                if lent is buf:
                    del self._lent[k]
                    self._free.setdefault(_key(buf), []).append(buf)
                    break

    def lent(self) -> list[torch.Tensor]:
        """The buffers lent and not given back yet."""
        return list(self._lent)

    def reclaim(self, *kept: Any) -> None:
        """The end of a step: every buffer still lent comes back, except those a tensor in
        the trees `kept` (what the step returns) lies in, which now belong to it. Free
        buffers this step did not take are let go: the sizes a step asks for change only
        with its layout (a resharded state), and then the old ones are not asked for again."""
        spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in self._lent]
        held: set[int] = set()
        for tree in kept if spans else ():
            for leaf in tree_flatten(tree)[0]:
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                    p = leaf.data_ptr()
                    held.update(k for k, (lo, hi) in enumerate(spans) if lo <= p < hi)
        lost = {id(b) for k, b in enumerate(self._lent) if k in held}
        self._free = {}
        for buf in {id(b): b for b in self._taken}.values():  # a buffer may be taken twice
            if id(buf) not in lost:
                self._free.setdefault(_key(buf), []).append(buf)
        self._lent, self._taken = [], []

    def forget(self) -> None:
        """The start of a step: buffers a failed step left lent are not lent any more, nor
        reused (the failure's traceback may still hold them); the free ones stay."""
        self._lent, self._taken = [], []


def _key(buf: torch.Tensor) -> _Key:
    return buf.numel(), buf.dtype, buf.device
