"""The update of an offloaded state: the optimizer run unit by unit where each unit's
state lies, the gradients carried there and the new masters carried back.

One call of the optimizer over every piece would need every unit's state in memory at
once (the disk tier) and every gradient on the host before the first unit steps. Instead
the pieces are cut by bucket (`fzero.optim._pieces`): the device's pieces step first, as
one call that the device runs while the host works; then each offloaded bucket, its
gradient copied to the host ahead of it and its disk state read ahead. Elementwise
arithmetic makes the units independent; what looks across them (the global norm of
`clip_by_global_norm`) is computed once, over every piece in order, by `UnitByUnit`. The
values are those of the one call, bitwise (docs/design.md, [Note: offload]). Where
nothing looks across them, offloaded buckets step while the backward goes on, each as
soon as its gradient is final (`_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from .._comm import Mesh
from .._core import Shards, device_of
from .._state import Placement, piece_buckets
from ..optim import Optimizer
from ..optim._context import ShardContext, UnitByUnit, shard_context
from ..optim._fused import FUSED_DTYPES, backend_for
from ..optim._pieces import assemble, by_piece, pieces_spec, select, walk


class Streamer:
    """One step's update of an offloaded state, a unit at a time: offloaded buckets as
    their gradients are final (`step_bucket`, from `_overlap`'s host thread while the
    backward goes on), then, once the backward is done, the device's pieces and every
    bucket not stepped yet (`finish`). The values are `sharded_update`'s, bitwise.

    Args:
      optimizer: the state's optimizer.
      target: the masters (offloaded buckets on the host or disk, the others on the
        device).
      opt_state: the optimizer state of `target.pieces()`.
      mesh: the mesh (for the global norm).
      donate: update `target` and `opt_state` in place.
      placement: the state's Placement.
      deliver: `(bucket, new master) -> its value on the device`, called for each
        offloaded bucket as soon as it is updated, before its disk pages are dropped.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        target: Shards,
        opt_state: Any,
        mesh: Mesh,
        donate: bool,
        placement: Placement,
        deliver: Callable[[int, torch.Tensor], torch.Tensor],
    ) -> None:
        self.optimizer, self.target, self.opt_state = optimizer, target, opt_state
        self.mesh, self.donate, self.placement, self.deliver = mesh, donate, placement, deliver
        lay = target.layout
        self.offloaded = frozenset(placement.buckets)
        self.pieces = target.pieces()
        self.n = len(self.pieces)
        self.owner = piece_buckets(lay, target.rank)
        self.segments = lay.piece_segments(target.rank)
        inplace = donate and optimizer.update_ is not None
        self.update = optimizer.update_ if inplace else optimizer.update
        self.nodes, self.globals_ = by_piece(opt_state, self.n)
        self.new_pieces = list(self.pieces)
        self.delivered: dict[int, torch.Tensor] = {}
        self.stepped: list[dict[str, torch.Tensor]] = []  # each call's new globals
        self.done: set[int] = set()  # offloaded buckets stepped before `finish`
        self.looked = False  # the optimizer asked for the gradient's global norm
        self.ran = False  # `finish` ran (not a step the loss scaler skipped)
        self.written: set[int] = set()  # buckets a call may have written (-1: the device)

    def unit(self, k: int) -> list[int]:
        """The pieces of offloaded bucket k (-1: the device's pieces)."""
        if k == -1:
            return [j for j in range(self.n) if self.owner[j] not in self.offloaded]
        return [j for j in range(self.n) if self.owner[j] == k]

    def step_bucket(self, k: int, g: tuple[torch.Tensor, ...]) -> None:
        """Offloaded bucket k stepped ahead of the others, its gradient pieces `g` final
        and where its pieces are; a transform that needs the whole gradient raises."""
        self._step(self.unit(k), g, UnitByUnit(None, None))
        self.done.add(k)

    def finish(
        self, grads: Shards, overlapped: bool = False
    ) -> tuple[Shards, Any, dict[int, torch.Tensor]]:
        """The device's pieces and every offloaded bucket not stepped yet, with `grads`
        (the gradient shards, on the device, in the masters' dtypes; those of the buckets
        already stepped are not read). `overlapped`: the step handed buckets to the host
        thread during its backward (on every rank alike, whether or not this rank had
        any to hand over), so nothing may ask for the whole gradient's norm.

        Returns:
          `(new_target, new_opt_state, delivered)`, the last each offloaded bucket's
          value on the device.
        """
        gpieces = grads.pieces()
        later = [k for k in self.placement.buckets if k not in self.done]
        units = [self.unit(-1)] + [self.unit(k) for k in later]
        # A rank without pieces still calls the optimizer once: what looks across ranks
        # (the global norm's all-reduce) must run on every rank.
        units = [u for u in units if u] or [[]]
        # With buckets stepped early there is no whole gradient: nothing may ask for it.
        self.ran = True
        whole = UnitByUnit(None if overlapped else gpieces, device_of(gpieces))
        carried = carry(units[0], gpieces, self.pieces)
        for u, idx in enumerate(units):
            if u + 1 < len(units):  # the next unit's state read and gradient sent ahead
                # (units after the first are offloaded buckets, never empty)
                self.placement.prefetch(self.owner[units[u + 1][0]])
                ahead = carry(units[u + 1], gpieces, self.pieces)
            self._step(idx, tuple(arrived(x) for x in carried), whole)
            if u + 1 < len(units):
                carried = ahead
        self.looked = self.looked or whole.looked
        globals_ = None
        for now in self.stepped:  # every call must leave the same
            globals_ = _same_globals(globals_, now, self.target.rank)
        if globals_ is None:
            globals_ = self.globals_
        new_state = assemble(self.opt_state, self.n, self.nodes, globals_)
        if self.donate:
            return self.target, new_state, self.delivered
        return self.target.replace_pieces(tuple(self.new_pieces)), new_state, self.delivered

    def _step(self, idx: list[int], g: tuple[torch.Tensor, ...], whole: UnitByUnit) -> None:
        """One unit's pieces `idx` updated with their gradients `g`; an offloaded bucket's
        new master delivered to the device and its pages dropped."""
        lay, pieces, n = self.target.layout, self.pieces, self.n
        k = self.owner[idx[0]] if idx else -1

        def call(gs: tuple, sub: Any, p: tuple, segs: tuple) -> tuple[Any, Any]:
            """One call of the optimizer, its global tensors fresh copies of the state's."""
            whole.unit = gs
            ctx = ShardContext(self.mesh, True, segs, lay.world_size, whole)
            with shard_context(ctx):
                out = self.update(gs, _fresh_globals(sub, len(p)), p)
            self.written.add(k)
            return out

        blocked = [
            j
            for j in idx
            if self.donate and _blockable(self.optimizer, self.nodes, j, pieces, g, idx)
        ]
        rest = [j for j in idx if j not in blocked]
        try:
            for j in blocked:  # in place, a cache-sized block at a time
                sub_j = select(self.opt_state, n, [j], lambda _, t: t)
                flat_p, flat_g = pieces[j].view(-1), g[idx.index(j)].view(-1)
                for a in range(0, flat_p.numel(), BLOCK):
                    b = min(a + BLOCK, flat_p.numel())
                    segs = (_segment(self.segments[j], a, b),)
                    block_state = _block(sub_j, a, b)
                    _, s_new = call((flat_g[a:b],), block_state, (flat_p[a:b],), segs)
                    self.stepped.append(by_piece(s_new, 1)[1])
            if rest or not blocked:
                gs = tuple(g[idx.index(j)] for j in rest)
                sub = select(self.opt_state, n, rest, lambda _, t: t)
                p_new, s_new = call(
                    gs, sub, tuple(pieces[j] for j in rest), tuple(self.segments[j] for j in rest)
                )
                unit_nodes, unit_globals = by_piece(s_new, len(rest))
                for path, entries in unit_nodes.items():
                    for j, e in zip(rest, entries):
                        self.nodes[path][j] = _kept(self.nodes[path][j], e, self.donate)
                for j, p in zip(rest, p_new):
                    self.new_pieces[j] = _kept(pieces[j], p, self.donate)
                self.stepped.append(unit_globals)
        finally:
            self.looked = self.looked or whole.looked
        if k in self.offloaded:
            new = _bucket(self.target, k, [self.new_pieces[j] for j in idx], self.donate)
            self.delivered[k] = self.deliver(k, new)
            self.placement.release(k)


# Elements of a host piece the optimizer updates in one call: each of its passes (Adam
# makes about seven) then runs over a few MiB that stay in the cache, not over the whole
# shard from memory. Measured on a 50M-element fp32 shard (benchmarks/host_adam.py):
# 1.8-3.0x faster than one call on this 2-vCPU host, and bitwise the same (elementwise
# ops on any sub-range).
BLOCK = 1 << 20


def _blockable(
    optimizer: Optimizer,
    nodes: dict[str, list[Any]],
    j: int,
    pieces: tuple[torch.Tensor, ...],
    g: tuple[torch.Tensor, ...],
    idx: list[int],
) -> bool:
    """Whether piece j is updated a block at a time: an elementwise optimizer that
    updates in place (a block's values are written through views; nothing returned is
    kept) with unfused ops, a contiguous host piece larger than a block, and every one
    of its state entries a contiguous tensor of its shape (not a dict, a per-piece
    scalar such as from_torch's step, or a state made on the first update). A fused
    optimizer's kernel is one pass over memory, which blocks cannot shorten: it runs
    the whole piece in one call (in 2^20 blocks it stepped 1.28 G params/s against 1.67
    in one, each call a kernel launch and its threads' start; `benchmarks/host_adam.py`)."""
    p = pieces[j]
    if optimizer.update_ is None or optimizer.whole_tensors is not None:
        return False
    if backend_for(optimizer.fused) is not None and p.dtype in FUSED_DTYPES:
        return False  # one kernel (a 16-bit piece keeps the unfused ops, and blocks)
    if p.device.type != "cpu" or p.numel() <= BLOCK:
        return False
    if not (p.is_contiguous() and g[idx.index(j)].is_contiguous()):
        return False
    for entries in nodes.values():
        e = entries[j]
        if not (isinstance(e, torch.Tensor) and e.shape == p.shape and e.is_contiguous()):
            return False
    return True


def _block(sub: Any, a: int, b: int) -> Any:
    """A one-piece state cut to elements [a, b) of its piece (views: written in place)."""
    spec = pieces_spec(1)

    def node(_: str, tree: Any) -> Any:
        (entry,) = spec.flatten_up_to(tree)
        cut = optree.tree_map(lambda x: x.view(-1)[a:b], entry)
        return optree.tree_unflatten(spec, [cut])

    return walk(sub, spec, node, lambda _, t: t)


def _segment(segments: Any, a: int, b: int) -> tuple[tuple[str, int, int], ...]:
    """A piece's (path, first, end) segments seen from its elements [a, b)."""
    return tuple(
        (path, max(lo, a) - a, min(hi, b) - a)
        for path, lo, hi in segments
        if max(lo, a) < min(hi, b)
    )


def _fresh_globals(sub: Any, n: int) -> Any:
    """`sub` with copies of its global tensors: each call steps its own (the step count)."""
    return walk(sub, pieces_spec(n), lambda _, t: t, lambda _, t: t.clone())


def _bucket(target: Shards, k: int, pieces: list[torch.Tensor], donate: bool) -> torch.Tensor:
    """Bucket k's new shard buffer from its new pieces (donating, the pieces were updated
    in place as views of it)."""
    lay, old = target.layout, target.buffers[k]
    if donate:
        return old
    if lay.kind == "flat":
        return pieces[0]
    flat = [p.reshape(-1) for p in pieces]
    used = sum(p.numel() for p in flat)
    pad = torch.zeros(lay.buckets[k].shard_numel - used, dtype=old.dtype, device=old.device)
    return torch.cat([*flat, pad])


class _InFlight:
    """A gradient on its way to the host: the pinned copy and the event that says it is
    there (a GPU's copy runs on the device's stream while the host steps another unit)."""

    def __init__(self, host: torch.Tensor, event: Any) -> None:
        self.host, self.event = host, event


def carry(
    idx: list[int], grads: tuple[torch.Tensor, ...], pieces: tuple[torch.Tensor, ...]
) -> list[Any]:
    """Unit `idx`'s gradients, started towards their pieces' device."""
    out: list[Any] = []
    for j in idx:
        g, where = grads[j], pieces[j].device
        if g.device == where:
            out.append(g)
        elif g.device.type == "cuda":  # device to pinned host memory, asynchronously
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            host.copy_(g, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            out.append(_InFlight(host, event))
        else:
            out.append(g.to(where))
    return out


def arrived(x: Any) -> torch.Tensor:
    """The gradient, once its copy finished."""
    if isinstance(x, _InFlight):
        x.event.synchronize()
        return x.host
    return x


def _kept(old: Any, new: Any, donate: bool) -> Any:
    """The new value of an entry: written into the old tensors when donating (an
    optimizer without an in-place update returns new ones; the disk's must stay where
    they are mapped), else the new one."""
    if not donate:
        return new
    if isinstance(old, torch.Tensor):
        if new is not old:
            old.copy_(new)
        return old
    if optree.tree_structure(old) != optree.tree_structure(new):
        return new  # a state made on the first update (from_torch's): kept as made
    optree.tree_map(lambda a, b: a.copy_(b) if a is not b else a, old, new)
    return old


def _same_globals(
    before: dict[str, torch.Tensor] | None, now: dict[str, torch.Tensor], rank: int
) -> dict[str, torch.Tensor]:
    """The update's global tensors (the step count, a norm): every unit must give the
    same, or the optimizer's state depends on which pieces it saw."""
    if before is None:
        return now
    for path, value in now.items():
        old = before[path]
        if old.shape != value.shape or not _same(old, value.to(old.device)):
            raise ValueError(
                f"rank {rank}: the optimizer's state {path!r} differs between units after "
                "the same update, so it depends on which pieces it saw; offload steps a unit "
                "at a time and supports elementwise optimizers"
            )
    return before


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN included (a NaN gradient's norm is NaN in every unit alike)."""
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)
