"""Pool: the host buffers a step function's collectives reuse from one call to the next,
as DDP keeps its buckets (docs/design.md, [Note: the pool]).

A buffer is free when nothing but the pool refers to its memory: the pool lends a tensor
of its own on it, and every tensor that shares the memory (that one, views of it, what
autograd saved of them, a collective's work in flight) holds a reference to its storage,
which the pool counts. So a buffer comes back by itself when the last of them goes,
whoever held it: a burst once its reduce-scatter is done, a gathered unit once its
backward is over, a failed step's buffers once its traceback is gone. A buffer the
step's result keeps (stage 1's gradient, to an optimizer holding on to it, as a pure
function may) is simply never free again, and the pool lets go of it at the end of the
next step that did not take it. The pool holds at most the buffers a step had alive at
once, reserved for reuse (not free for the update's temporaries meanwhile: a little more
peak memory). Device buffers are not pooled: the caching allocator reuses them already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_Key = tuple[int, torch.dtype, torch.device]


def _refs(buf: torch.Tensor) -> int:
    """How many references the memory of `buf` has (its storage's use count)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)


def _lend(buf: torch.Tensor) -> torch.Tensor:
    """A tensor of its own on `buf`'s memory, not a view of `buf`: views of it keep it
    alive (a view's base is the root of its chain), as they would a fresh tensor, so
    whoever watches it (`_gatherer` follows gathered buffers weakly) sees it live as long
    as anything reads it."""
    return buf.new_empty(0).set_(buf.untyped_storage(), 0, buf.shape)


@dataclass
class _Kept:
    buf: torch.Tensor
    own: int  # its storage's references when only the pool holds it
    taken: bool = True  # lent since the last `reclaim`


class Pool:
    """Host buffers by (elements, dtype, device), each lent while anything refers to it."""

    def __init__(self) -> None:
        self._bufs: dict[_Key, list[_Kept]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of `numel` elements (contents undefined), free again once it and
        every tensor sharing its memory are gone.

        Args:
          numel: its number of elements.
          dtype: its dtype.
          device: its device; off the host, a fresh tensor (not pooled).

        Returns:
          A tensor on the memory of a pooled buffer nothing else refers to, or of a new
          one (`_lend`).
        """
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        entries = self._bufs.setdefault((numel, dtype, device), [])
        for entry in entries:
            if _refs(entry.buf) == entry.own:
                entry.taken = True
                return _lend(entry.buf)
        buf = torch.empty(numel, dtype=dtype, device=device)
        entries.append(_Kept(buf, _refs(buf)))
        return _lend(buf)

    def pools(self, buf: torch.Tensor) -> bool:
        """Whether `take` pools buffers like `buf` (host memory), so that one must never
        be freed under the pool (`resize_`)."""
        return buf.device.type == "cpu"

    def reclaim(self) -> None:
        """The end of a step: lets go of the buffers it did not take (the sizes a step
        asks for change only with its layout, and one the step's result still holds can
        never be taken again); the rest wait for the next step."""
        for key, entries in list(self._bufs.items()):
            kept = [e for e in entries if e.taken]
            for e in kept:
                e.taken = False
            if kept:
                self._bufs[key] = kept
            else:
                del self._bufs[key]

    def nbytes(self) -> int:
        """The bytes of every buffer the pool holds, lent or free."""
        return sum(e.buf.numel() * e.buf.element_size() for es in self._bufs.values() for e in es)
