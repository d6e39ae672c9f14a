"""The update of an offloaded state: the optimizer run unit by unit where each unit's
state lies, the gradients carried there and the new masters carried back.

One call of the optimizer over every piece would need every unit's state in memory at
once (the disk tier) and every gradient on the host before the first unit steps. Instead
the pieces are cut by bucket (`fzero.optim._pieces`): the device's pieces step first, as
one call that the device runs while the host works; then each offloaded bucket, its
gradient copied to the host ahead of it and its disk state read ahead. Elementwise
arithmetic makes the units independent; what looks across them (the global norm of
`clip_by_global_norm`) is computed once, over every piece in order, by `UnitByUnit`. The
values are those of the one call, bitwise (docs/design.md, [Note: offload]).
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
from ..optim._pieces import assemble, by_piece, pieces_spec, select, walk


def streamed_update(
    optimizer: Optimizer,
    target: Shards,
    grads: Shards,
    opt_state: Any,
    mesh: Mesh,
    donate: bool,
    placement: Placement,
    deliver: Callable[[int, torch.Tensor], torch.Tensor],
) -> tuple[Shards, Any, dict[int, torch.Tensor]]:
    """`sharded_update` of an offloaded state: the same values, unit by unit.

    Args:
      optimizer: the state's optimizer.
      target: the masters (offloaded buckets on the host or disk, the others on the
        device).
      grads: the gradient shards, on the device, in the masters' dtypes.
      opt_state: the optimizer state of `target.pieces()`.
      mesh: the mesh (for the global norm).
      donate: update `target` and `opt_state` in place.
      placement: the state's Placement.
      deliver: `(bucket, new master) -> its value on the device`, called for each
        offloaded bucket as soon as it is updated, before its disk pages are dropped.

    Returns:
      `(new_target, new_opt_state, delivered)`, the last each offloaded bucket's value
      on the device.
    """
    lay, rank = target.layout, target.rank
    pieces, gpieces = target.pieces(), grads.pieces()
    n = len(pieces)
    owner = piece_buckets(lay, rank)
    segments = lay.piece_segments(rank)
    offloaded = set(placement.buckets)
    units = [[j for j in range(n) if owner[j] not in offloaded]]
    for k in placement.buckets:
        units.append([j for j in range(n) if owner[j] == k])
    # A rank without pieces still calls the optimizer once: what looks across ranks (the
    # global norm's all-reduce) must run on every rank.
    units = [u for u in units if u] or [[]]
    whole = UnitByUnit(gpieces, device_of(gpieces))
    update = optimizer.update_ if donate and optimizer.update_ is not None else optimizer.update
    nodes, globals_ = by_piece(opt_state, n)
    new_pieces = list(pieces)
    new_globals: dict[str, torch.Tensor] | None = None
    delivered: dict[int, torch.Tensor] = {}
    carried = _carry(units[0], gpieces, pieces)

    def call(g: tuple, sub: Any, p: tuple, segs: tuple) -> tuple[Any, Any]:
        """One call of the optimizer, its global tensors fresh copies of the state's."""
        whole.unit = g
        ctx = ShardContext(mesh, True, segs, lay.world_size, whole)
        with shard_context(ctx):
            return update(g, _fresh_globals(sub, len(p)), p)

    for u, idx in enumerate(units):
        if u + 1 < len(units):  # the next unit's state read and gradient sent ahead
            # (units after the first are offloaded buckets, never empty)
            placement.prefetch(owner[units[u + 1][0]])
            ahead = _carry(units[u + 1], gpieces, pieces)
        g = tuple(_arrived(x) for x in carried)
        blocked = [j for j in idx if donate and _blockable(optimizer, nodes, j, pieces, g, idx)]
        rest = [j for j in idx if j not in blocked]
        for j in blocked:  # in place, a cache-sized block at a time
            sub_j = select(opt_state, n, [j], lambda _, t: t)
            flat_p, flat_g = pieces[j].view(-1), g[idx.index(j)].view(-1)
            for a in range(0, flat_p.numel(), BLOCK):
                b = min(a + BLOCK, flat_p.numel())
                segs = (_segment(segments[j], a, b),)
                block_state = _block(sub_j, a, b)
                _, s_new = call((flat_g[a:b],), block_state, (flat_p[a:b],), segs)
                new_globals = _same_globals(new_globals, by_piece(s_new, 1)[1], rank)
        if rest or not blocked:
            gs = tuple(g[idx.index(j)] for j in rest)
            sub = select(opt_state, n, rest, lambda _, t: t)
            p_new, s_new = call(
                gs, sub, tuple(pieces[j] for j in rest), tuple(segments[j] for j in rest)
            )
            unit_nodes, unit_globals = by_piece(s_new, len(rest))
            for path, entries in unit_nodes.items():
                for j, e in zip(rest, entries):
                    nodes[path][j] = _kept(nodes[path][j], e, donate)
            for j, p in zip(rest, p_new):
                new_pieces[j] = _kept(pieces[j], p, donate)
            new_globals = _same_globals(new_globals, unit_globals, rank)
        k = owner[idx[0]] if idx else -1
        if k in offloaded:
            delivered[k] = deliver(k, _bucket(target, k, [new_pieces[j] for j in idx], donate))
            placement.release(k)
        if u + 1 < len(units):
            carried = ahead
    if new_globals is not None:
        globals_ = new_globals
    new_state = assemble(opt_state, n, nodes, globals_)
    if donate:
        return target, new_state, delivered
    return target.replace_pieces(tuple(new_pieces)), new_state, delivered


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
    """Whether piece j can be updated a block at a time: an elementwise optimizer that
    updates in place (a block's values are written through views; nothing returned is
    kept), a contiguous host piece larger than a block, and every one of its state
    entries a contiguous tensor of its shape (not a dict, a per-piece scalar such as
    from_torch's step, or a state made on the first update)."""
    p = pieces[j]
    if optimizer.update_ is None or optimizer.whole_tensors is not None:
        return False
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


def _carry(
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


def _arrived(x: Any) -> torch.Tensor:
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
