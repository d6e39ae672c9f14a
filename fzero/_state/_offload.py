"""Offload: where the optimizer's half of a state lives (device, host or disk), unit by unit.

`Offload` is the user's choice; `Placement` is what a state records of it (static: which
buckets, and the disk file); `place` moves a built state's masters and optimizer state of
the chosen buckets off the device. The step's update then runs unit by unit where each
unit's state lies (`fzero._step._streamed`), bitwise the same arithmetic
(docs/design.md, [Note: offload]).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

import optree
import torch

from .._comm import Mesh
from .._core import ShardLayout, Shards, device_of, stage_of
from ..optim import Optimizer
from ..optim._pieces import assemble, by_piece, pieces_spec, walk
from ._precision import gather_rounded
from ._spill import Spill

TIERS = ("host", "disk")


@dataclass(frozen=True)
class Offload:
    """Optimizer state and master copies off the device (ZeRO-Offload, ZeRO-Infinity).

    Attributes:
      to: "host" (CPU memory, pinned when the parameters are on a GPU) or "disk" (one
        file per rank under `directory`, mapped; a unit's state is paged in for its
        update and dropped after it).
      fraction: the share of the trainable elements whose state is offloaded, in (0, 1];
        whole buckets (a unit's, per dtype) are taken from the last unit backwards, the
        first whose gradients a backward completes.
      directory: where the disk tier's files go (local disk); required for "disk".
      overlap: step an offloaded bucket on a host thread as soon as the backward has
        reduced its gradient, while the backward goes on, wherever the values stay those
        of the update after the backward (no loss scaler, no global-norm clipping, no
        qgZ). It pays where units enter just in time: units entered before the forward
        complete their gradients only at the backward's end. False: every unit after the
        backward.
      params: stage 3: the offloaded buckets' parameter shards on the host too (pinned
        where the parameters are on a GPU; ZeRO-Infinity's parameter offload), copied to
        the device for each gather; the device then holds nothing of those buckets
        between their gathers. Without `Precision` the host shard is the master itself,
        with it a copy in the compute dtype (what the gather sends).
    """

    to: str = "host"
    fraction: float = 1.0
    directory: str | None = None
    overlap: bool = True
    params: bool = False

    def __post_init__(self) -> None:
        if self.to not in TIERS:
            raise ValueError(f"Offload.to must be one of {TIERS}, got {self.to!r}")
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, Real):
            raise TypeError(f"Offload.fraction must be a number, got {self.fraction!r}")
        if not 0.0 < float(self.fraction) <= 1.0:
            raise ValueError(f"Offload.fraction must be in (0, 1], got {self.fraction!r}")
        if self.to == "disk" and not self.directory:
            raise ValueError("Offload(to='disk') needs directory= (a local disk's path)")
        if self.to == "host" and self.directory is not None:
            raise ValueError("Offload(to='host') takes no directory (that is to='disk')")


@dataclass(frozen=True)
class Placement:
    """What a state records of its offload: the config, the offloaded buckets (by index
    in the layout), for the disk tier the file and each bucket's region in it, and with
    `Offload(params=True)` the device the parameters compute on (their shards of the
    offloaded buckets being on the host)."""

    offload: Offload
    buckets: tuple[int, ...]
    spill: Spill | None = field(default=None, compare=False, repr=False)
    regions: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    device: torch.device | None = None

    def prefetch(self, bucket: int) -> None:
        """Reads a disk bucket's state ahead (nothing for the host)."""
        if self.spill is not None and bucket in self.regions:
            self.spill.prefetch(self.regions[bucket])

    def release(self, bucket: int) -> None:
        """Drops a disk bucket's state from memory once its update wrote it."""
        if self.spill is not None and bucket in self.regions:
            self.spill.release(self.regions[bucket])

    def release_all(self) -> None:
        """Drops every disk bucket from memory (after a checkpoint read them all)."""
        if self.spill is not None:
            self.spill.release_all()


def chosen_buckets(layout: ShardLayout, fraction: float) -> tuple[int, ...]:
    """The trainable buckets to offload: from the last backwards until they hold at least
    `fraction` of the trainable elements (every rank chooses the same)."""
    live = [k for k, b in enumerate(layout.buckets) if not b.frozen]
    total = sum(layout.buckets[k].full_numel for k in live)
    out, held = [], 0
    for k in reversed(live):
        if held >= fraction * total and out:
            break
        out.append(k)
        held += layout.buckets[k].full_numel
    return tuple(sorted(out))


def piece_buckets(layout: ShardLayout, rank: int) -> tuple[int, ...]:
    """The bucket of each of `Shards.pieces()` on `rank` (`ShardLayout.pieces`' order)."""
    out = []
    for k, b in enumerate(layout.buckets):
        if b.frozen:
            continue
        if layout.kind == "flat":
            out.append(k)
        else:
            out += [k for s in b.slots if s.owner == rank]
    return tuple(out)


def check_offload(offload: Any, stage: int, donate: bool | None = None) -> None:
    """Raises ValueError for an offload the stage (or a pure step) cannot do."""
    if offload is None:
        return
    if not isinstance(offload, Offload):
        raise TypeError(f"offload must be a fzero.Offload, got {type(offload).__name__}")
    if not stage_of(stage).shards_optimizer:
        raise ValueError(
            "offload needs stage 1, 2 or 3: stage 0 keeps every rank's optimizer state "
            "whole and replicated (at one rank, stage 1 holds the same bytes and offloads)"
        )
    if offload.params and not stage_of(stage).shards_params:
        raise ValueError(
            f"Offload(params=True) needs stage 3: at stage {stage} every rank holds the "
            "full parameters, which the forward reads where they are (stage 3 holds "
            "shards, gathered unit by unit, whose host copies a gather can send)"
        )
    if donate is False and offload.to == "disk":
        raise ValueError(
            "a step with donate=False returns a new state and keeps the old one, but the "
            "disk tier updates its files in place; use donate=True with Offload(to='disk')"
        )


def place(state: Any, offload: Offload, mesh: Mesh, optimizer: Optimizer | None = None) -> Any:
    """`state` with the masters and optimizer state of the chosen buckets off the device.

    A state without masters gets them at the parameters' own precision (the optimizer
    updates them off the device; the device keeps the parameters). At stage 3 an
    offloaded trainable shard stays on the device as the parameters, in the compute
    dtype, beside its master.

    Args:
      state: a ShardedState of stage 1-3, not offloaded; its `opt_state` None to have
        `optimizer` initialize it here, a unit at a time, each unit's made where it goes
        (the disk tier never holds more than one unit's in memory).
      offload: where, and how much.
      mesh: the mesh.
      optimizer: the optimizer, when `state.opt_state` is None.

    Returns:
      The ShardedState, its `offload` recording the Placement.
    """
    check_offload(offload, state.stage)
    lay, rank = state.layout, mesh.shard_rank
    spec = stage_of(state.stage)
    master = state.master if state.master is not None else _own_masters(state, rank)
    buckets = chosen_buckets(lay, offload.fraction)
    owner = piece_buckets(lay, rank)
    like = state.opt_state
    if like is None:  # shapes only, to size the file: made on the meta device
        assert optimizer is not None, "place: no opt_state and no optimizer to make it"
        like = optimizer.init(tuple(p.to("meta") for p in master.pieces()))
    nodes = _node_entries(like, len(owner))
    if offload.to == "disk" and any(
        not optree.tree_leaves(e) for entries in nodes for e in entries
    ):
        raise ValueError(
            "the optimizer makes its state on its first update (from_torch's torch.optim "
            "state), so its size is unknown when the offload file is made; "
            "Offload(to='disk') needs a state init makes whole (fzero.optim's sgd, adam, "
            "adamw), or use Offload(to='host')"
        )
    mlay = master.layout
    on_gpu = any(x.device.type == "cuda" for x in master.buffers)

    spill, regions = None, {}
    if offload.to == "disk":
        sizes = [_round(master.buffers[k]) + _state_bytes(nodes, owner, k) for k in buckets]
        spill = Spill(str(offload.directory), sizes, rank)
        regions = {k: r for r, k in enumerate(buckets)}
    offsets = dict.fromkeys(buckets, 0)

    def move(k: int, x: torch.Tensor) -> torch.Tensor:
        if spill is None:  # host memory, pinned for asynchronous copies to a GPU
            host = x.detach().to("cpu", copy=True)
            return host.pin_memory() if on_gpu else host
        out = spill.tensor(regions[k], offsets[k], x.detach())
        offsets[k] += _round(x)
        return out

    new_master = list(master.buffers)
    for k in buckets:
        new_master[k] = move(k, master.buffers[k])
        if spill is not None:  # written: its pages go (the disk keeps them)
            spill.release(regions[k])
    sp = pieces_spec(len(owner))

    def on_node(_: str, tree: Any) -> Any:
        entries = sp.flatten_up_to(tree)
        moved = [
            optree.tree_map(lambda x, k=k: move(k, x), e) if k in offsets else e
            for e, k in zip(entries, owner)
        ]
        return optree.tree_unflatten(sp, moved)

    if state.opt_state is not None:
        opt_state = walk(state.opt_state, sp, on_node, lambda _, g: g)
    else:
        assert optimizer is not None
        pieces = Shards(tuple(new_master), mlay, rank).pieces()
        opt_state = _init_by_unit(optimizer, pieces, owner, buckets, like, move, spill, regions)
    params, device = state.params, None
    if spec.shards_params:  # what is gathered, in the compute dtype: on the device, or
        # with `params` on the host (the master itself where it is in that dtype)
        bufs = list(params.buffers)
        if offload.params:  # where the shards compute, recorded before they leave it
            device = next((b.device for b in bufs if b.numel()), bufs[0].device)
        for k in buckets:
            m, dtype = new_master[k], lay.buckets[k].dtype
            # A copy holds what a gather of its master delivers (`gather_rounded`).
            if offload.params:  # a disk master is paged out after its update: copied
                if m.dtype != dtype or spill is not None:
                    copy = gather_rounded(m, dtype, state.precision).to(dtype, copy=True)
                    m = _pinned(copy, on_gpu)
                bufs[k] = m
            elif bufs[k] is master.buffers[k] or bufs[k].dtype != dtype:
                source = gather_rounded(master.buffers[k], dtype, state.precision)
                bufs[k] = source.to(dtype, copy=True)
        params = Shards(tuple(bufs), lay, rank)
    placement = Placement(offload, buckets, spill, regions, device)
    placement.release_all()
    return dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        master=Shards(tuple(new_master), mlay, rank),
        offload=placement,
    )


def _pinned(x: torch.Tensor, pin: bool) -> torch.Tensor:
    """`x` (a host tensor) in pinned memory where copies go to a GPU."""
    return x.pin_memory() if pin else x


def params_apart(state: Any) -> torch.device | None:
    """With `Offload(params=True)`, the device the host-held parameter shards are copied
    to for each gather; None where every shard is where it computes."""
    return None if state.offload is None else state.offload.device


def compute_device(state: Any) -> torch.device | None:
    """Where a state's parameters compute: their own device, or the one their host-held
    shards are gathered on (`params_apart`)."""
    return params_apart(state) or device_of(state.params)


def offloaded_param_bytes(state: Any) -> int:
    """Bytes of parameter shards a state holds on the host beside its masters
    (`Offload(params=True)` under `Precision`; without it the shards are the masters)."""
    placement = state.offload
    if params_apart(state) is None:
        return 0
    masters = {m.untyped_storage().data_ptr() for m in state.master.buffers if m.numel()}
    return sum(
        _bytes(x)
        for k, x in enumerate(state.params.buffers)
        if k in placement.buckets and x.untyped_storage().data_ptr() not in masters
    )


def _init_by_unit(
    optimizer: Optimizer,
    pieces: tuple[torch.Tensor, ...],
    owner: tuple[int, ...],
    buckets: tuple[int, ...],
    like: Any,
    move: Any,
    spill: Spill | None,
    regions: dict[int, int],
) -> Any:
    """`optimizer.init(pieces)`, made a unit at a time: the device's pieces together, then
    each offloaded bucket's, moved off (`move`) as soon as it is made. Elementwise states
    are the same made whole or in parts (`_step._streamed` steps them in parts too)."""
    n = len(pieces)
    groups = [[j for j in range(n) if owner[j] not in buckets]]
    groups += [[j for j in range(n) if owner[j] == k] for k in buckets]
    nodes: dict[str, list[Any]] = {}
    globals_: dict[str, torch.Tensor] | None = None
    for idx in (g for g in groups if g):
        made = optimizer.init(tuple(pieces[j] for j in idx))
        unit_nodes, unit_globals = by_piece(made, len(idx))
        for path, entries in unit_nodes.items():
            column = nodes.setdefault(path, [None] * n)
            for j, e in zip(idx, entries):
                k = owner[j]
                column[j] = (
                    optree.tree_map(lambda x, k=k: move(k, x), e)
                    if k in regions or (spill is None and k in buckets)
                    else e
                )
        globals_ = unit_globals if globals_ is None else globals_
        del made, unit_nodes
        if spill is not None and owner[idx[0]] in regions:
            spill.release(regions[owner[idx[0]]])
    if globals_ is None:  # no pieces on this rank
        globals_ = by_piece(optimizer.init(()), 0)[1]
    for path in by_piece(like, n)[0]:
        nodes.setdefault(path, [None] * n)
    return assemble(like, n, nodes, globals_)


def _own_masters(state: Any, rank: int) -> Shards:
    """Masters at the parameters' precision: stage 3's trainable shards themselves;
    stages 1-2 a copy of this rank's slice of each trainable bucket (frozen: empty)."""
    lay = state.layout
    if stage_of(state.stage).shards_params:
        bufs = state.params.buffers
    else:
        bufs = lay.shard(state.params, rank)
    return Shards(
        tuple(x.new_empty(0) if b.frozen else x for x, b in zip(bufs, lay.buckets)), lay, rank
    )


def _node_entries(opt_state: Any, n: int) -> list[list[Any]]:
    sp, out = pieces_spec(n), []
    walk(opt_state, sp, lambda _, t: out.append(sp.flatten_up_to(t)), lambda _, g: g)
    return out


def _state_bytes(
    nodes: list[list[Any]], owner: tuple[int, ...], bucket: int, exact: bool = False
) -> int:
    """Bytes of the optimizer state of `bucket`'s pieces (each tensor rounded up to 64, as
    laid out in a file, unless `exact`)."""
    size = _bytes if exact else _round
    total = 0
    for entries in nodes:
        for e, k in zip(entries, owner):
            if k == bucket:
                total += sum(size(x) for x in optree.tree_leaves(e))
    return total


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _round(x: torch.Tensor) -> int:
    """`x`'s bytes rounded up to 64: each tensor in a file starts on a cache line."""
    return -(-_bytes(x) // 64) * 64


def offloaded_bytes(state: Any) -> int:
    """Bytes of masters and optimizer state the state holds off the device."""
    placement = state.offload
    if placement is None:
        return 0
    lay, rank = state.layout, state.master.rank
    owner = piece_buckets(lay, rank)
    nodes = _node_entries(state.opt_state, len(owner))
    chosen = set(placement.buckets)
    return sum(
        _bytes(state.master.buffers[k]) + _state_bytes(nodes, owner, k, exact=True) for k in chosen
    )
