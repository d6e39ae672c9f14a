"""The sharding context of an update: what a transform needs to act on a shard, not a tree.

`fzero.sharded_update` runs the optimizer on a rank's *pieces* (flat slices of buckets, or
owned tensors), not on the parameter tree. Two things need to know more than the pieces:
global-norm clipping needs the other ranks' share of the norm (a collective on the mesh),
and weight-decay masks, written against parameter paths, need to know which parameter
each element of a piece belongs to. sharded_update sets this context for the duration of
the update; without it (an optimizer called on a plain tree) both act on the tree itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

Segments = tuple[tuple[str, int, int], ...]  # (leaf path, first element, end) within a piece


@dataclass(frozen=True)
class ShardContext:
    """Where the pieces being updated come from.

    Attributes:
      mesh: the mesh, for collectives over all ranks' pieces (None: no communication).
      sharded: whether each rank holds a different part of the parameters (stages 1-3);
        replicated trees (stage 0) already hold everything.
      segments: per piece, the parameter elements it holds; None when the update runs on
        the parameter tree itself (stage 0).
      world_size: how many ranks share the pieces.
      whole: when the update runs a unit of pieces at a time (offload), every piece's
        gradient (`UnitByUnit`): what a transform that looks across pieces must see.
    """

    mesh: Any
    sharded: bool
    segments: tuple[Segments, ...] | None
    world_size: int = 1
    whole: UnitByUnit | None = None


class UnitByUnit:
    """An update called once per unit of pieces (offload's driver), and what a transform
    that looks across pieces needs from the whole: the gradient's global squared norm.

    `unit` is the gradient pieces of the current call, as the optimizer receives them;
    `norm_sq(leaves)` is the global squared norm of all the pieces, summed in piece order
    exactly as one call over them all would (computed once, then reused by every unit).
    `grads` None: the units step as the backward reduces them, before the whole gradient
    exists, and asking for its norm raises. `looked` says whether anything asked.
    """

    def __init__(self, grads: tuple[torch.Tensor, ...] | None, device: torch.device | None) -> None:
        self.grads, self.device = grads, device
        self.unit: tuple[torch.Tensor, ...] = ()
        self._norm_sq: torch.Tensor | None = None
        self.looked = False

    def norm_sq(self, leaves: list[torch.Tensor]) -> torch.Tensor:
        """The squared global norm of the whole gradient, `leaves` being this unit's."""
        self.looked = True
        if self.grads is None:
            raise ValueError(
                "the optimizer asked for the gradient's global norm (clip_by_global_norm), "
                "which its earlier offloaded steps never did, so this step updated offloaded "
                "units as the backward reduced them, before the whole gradient existed. An "
                "optimizer that clips only sometimes must clip (or not) from the first step, "
                "or use Offload(overlap=False)"
            )
        if self._norm_sq is None:  # first: every rank joins the all-reduce, then checks
            self._norm_sq = global_sum(sum_of_squares(self.grads, self.device), whole=True)
        if len(leaves) != len(self.unit) or any(a is not b for a, b in zip(leaves, self.unit)):
            raise ValueError(
                "clip_by_global_norm after a transformation that changes the gradient cannot "
                "run a unit of pieces at a time (offload= steps unit by unit): put it first in "
                "chain(...)"
            )
        return self._norm_sq


def sum_of_squares(leaves: Any, device: torch.device | None) -> torch.Tensor:
    """The float64 sum of the leaves' squares, leaf after leaf, where the leaves are."""
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in leaves:
        local = local + _squares(g.detach()).to(local.device)
    return local


_CHUNK = 1 << 16  # elements: a float64 copy of a chunk stays in the CPU's cache


def _squares(g: torch.Tensor) -> torch.Tensor:
    """`g`'s sum of squares in float64. On the CPU a dot product per cache-sized chunk:
    `g.double().pow(2).sum()` wrote two float64 copies of the tensor, 13 times slower
    (37 against 2.9 ms for 5.3M fp32 elements, one thread); elsewhere one reduction that
    casts as it reads (no copy of the gradient in device memory)."""
    if g.is_complex():
        g = torch.view_as_real(g)
    if g.device.type != "cpu":
        return torch.linalg.vector_norm(g, dtype=torch.float64).square()
    flat = g.reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device="cpu")
    for chunk in flat.split(_CHUNK):
        c = chunk.double()
        total += torch.dot(c, c)
    return total


_OWNED: ContextVar[bool] = ContextVar("fzero_grads_owned", default=False)


@contextlib.contextmanager
def grads_owned(owned: bool = True) -> Iterator[None]:
    """Within the block, the gradients an update receives are its caller's scratch (a
    step's reduced buffers, used once): a transformation may scale them in place rather
    than copy them. A fresh copy of the gradient per step cost the benchmark GPT's
    clipped step 6 ms of its 135 (allocation and first touch, `aten::mul`, profiled).
    `owned=False` withdraws it (what a transformation returned in their place)."""
    token = _OWNED.set(owned)
    try:
        yield
    finally:
        _OWNED.reset(token)


def owns_grads() -> bool:
    """Whether the update being run may write into its gradients (`grads_owned`)."""
    return _OWNED.get()


def current() -> ShardContext | None:
    """The sharding context of the update being run, if any."""
    return _CONTEXT.get()


_CONTEXT: ContextVar[ShardContext | None] = ContextVar("fzero_shard_context", default=None)


@contextlib.contextmanager
def shard_context(ctx: ShardContext) -> Iterator[None]:
    """Makes `ctx` the current sharding context within the block."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def global_sum(local: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """`local` summed over every rank's shard, if the update runs on a shard; else itself.

    `local` must cover every piece this rank updates: an update run a unit at a time
    (offload) refuses, unless `whole` says it does."""
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.whole is not None and not whole:
        raise ValueError(
            "this optimizer sums over every piece of the update (global_sum), and offload= "
            "steps a unit of pieces at a time: it would sum over one unit. Offload supports "
            "elementwise optimizers and clip_by_global_norm first in chain(...)"
        )
    if ctx is None or not ctx.sharded or ctx.world_size == 1:
        return local
    if ctx.mesh is None:
        raise ValueError(
            "this optimizer needs the other ranks' shards (e.g. clip_by_global_norm): "
            "pass mesh= to sharded_update"
        )
    from .._comm import all_reduce_sum

    # Over the shard axis only: on a 2-D mesh the other groups hold the same shards.
    return all_reduce_sum(local, ctx.mesh.shard)


class Spans(NamedTuple):
    """A piece mixing parameters with and without weight decay, as runs of its flat
    elements: `(first, end, decayed)` in order, covering the piece (a shard's padding,
    held by no parameter, is not decayed), neighbours of one flag merged."""

    runs: tuple[tuple[int, int, bool], ...]

    def mask(self, like: torch.Tensor) -> torch.Tensor:
        """The runs as a 0/1 tensor of `like`'s shape, dtype and device (1: decayed)."""
        m = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        for lo, hi, on in self.runs:
            if on:
                m[lo:hi] = 1
        return m.view(like.shape)


def resolve_mask(mask: Any, params: Any) -> list[bool | Spans]:
    """Per leaf of `params`: True/False, or the `Spans` of a piece mixing parameters.

    Args:
      mask: a predicate on parameter paths, or a pytree of bools shaped like the full
        parameter tree (True = apply).
      params: what the optimizer updates: the parameter tree, or a rank's pieces.

    Returns:
      One entry per leaf of `params`, in flatten order.
    """
    predicate = _predicate(mask)
    ctx = _CONTEXT.get()
    leaves = optree.tree_leaves(params)
    if ctx is None or ctx.segments is None:
        from .._core import leaf_paths

        return [bool(predicate(p)) for p in leaf_paths(params)]
    out: list[bool | Spans] = []
    for piece, segments in zip(leaves, ctx.segments, strict=True):
        flags = {bool(predicate(path)) for path, _, _ in segments}
        if len(flags) <= 1:
            out.append(flags.pop() if flags else False)
            continue
        runs: list[tuple[int, int, bool]] = []
        at = 0
        for path, lo, hi in sorted(segments, key=lambda s: s[1]):
            assert lo >= at, f"segments of one piece overlap at {path!r}: {segments}"
            _extend(runs, at, lo, False)  # a gap: padding
            _extend(runs, lo, hi, bool(predicate(path)))
            at = hi
        _extend(runs, at, piece.numel(), False)
        out.append(Spans(tuple(runs)))
    return out


def _extend(runs: list[tuple[int, int, bool]], lo: int, hi: int, on: bool) -> None:
    """`runs` with `[lo, hi)` flagged `on` after them, merged into the last run of its
    flag; nothing where the span is empty."""
    if hi <= lo:
        return
    if runs and runs[-1][2] == on and runs[-1][1] == lo:
        runs[-1] = (runs[-1][0], hi, on)
    else:
        runs.append((lo, hi, on))


def _predicate(mask: Any) -> Callable[[str], bool]:
    if callable(mask):
        return mask
    from .._core import leaf_paths

    flags = dict(zip(leaf_paths(mask), optree.tree_leaves(mask)))
    if not all(isinstance(f, bool) for f in flags.values()):
        raise ValueError("a mask is a predicate on parameter paths or a pytree of bools")

    def lookup(path: str) -> bool:
        if path not in flags:
            raise ValueError(f"the mask has no entry for parameter {path!r}")
        return flags[path]

    return lookup
