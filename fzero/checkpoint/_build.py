"""Building a ShardedState for any world size, stage and layout from a source of saved values."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .. import _comm
from .._comm import Mesh
from .._core import Bucket, ShardLayout, Shards, Stage
from .._state import Offload, Precision, ShardedState, full_precision_layout, place
from ..optim import Optimizer
from ..optim._base import check_slices
from ._extra import to_mixed
from ._schema import (
    CheckpointError,
    Entry,
    Piece,
    Schema,
    covered,
    dtype_of,
    piece_spec,
    pieces_of,
    walk,
)


class Source(Protocol):
    """Saved values, addressed by leaf and element range (never by the saving layout)."""

    schema: Schema

    def param(self, leaf: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of parameter `leaf`, flattened."""
        ...

    def elem(self, entry: int, leaf: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of elementwise entry `entry` of parameter `leaf`."""
        ...

    def piece(self, entry: int, leaf: int) -> torch.Tensor | None:
        """The per-piece value of `entry` stored for leaf `leaf` as a whole, if any."""
        ...

    def uniform(self, entry: int) -> torch.Tensor:
        """The value every piece holds, for a uniform per-piece entry."""
        ...

    def global_(self, path: str) -> torch.Tensor:
        """The global tensor at `path` of the optimizer state (a step count)."""
        ...


def assemble(
    read: Callable[[int, int, int], torch.Tensor],
    bucket: Bucket,
    lo: int,
    hi: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Elements [lo, hi) of `bucket`'s padded flat buffer, read leaf by leaf (zero padding),
    on `device` (None: the CPU): each read range is copied there as it arrives, so the
    host never holds the whole buffer."""
    out = torch.zeros(hi - lo, dtype=dtype, device=device)
    for s in bucket.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            out[a - lo : b - lo] = read(s.index, a - s.offset, b - s.offset)
    return out


def build_state(
    src: Source,
    layout: ShardLayout,
    optimizer: Optimizer | None,
    stage: Stage,
    rank: int,
    step: int,
    device: torch.device | None = None,
) -> ShardedState:
    """This rank's ShardedState under `layout` and `stage`, filled from `src`, on `device`.

    A stage that shards parameters reads only this rank's slice of every bucket; the
    others hold full parameters anyway. Optimizer state is built by `optimizer.init` for
    this rank's pieces, then every tensor is replaced by the saved value, cut to the new
    piece; without `optimizer`, the state's `opt_state` is None (see `fill_state`).
    """
    if stage.shards_params:
        buffers = tuple(
            assemble(
                src.param, b, rank * b.shard_numel, (rank + 1) * b.shard_numel, b.dtype, device
            )
            for b in layout.buckets
        )
        params: Any = Shards(buffers, layout, rank)
        pieces_in: Any = params.pieces()
    else:
        flats = tuple(
            assemble(src.param, b, 0, b.full_numel, b.dtype, device) for b in layout.buckets
        )
        params = layout.unflatten(flats)
        trainable = layout.trainable(params)
        if not stage.shards_optimizer:
            pieces_in = trainable
        else:
            pieces_in = Shards(layout.shard(trainable, rank), layout, rank).pieces()
    if optimizer is None:  # the caller makes the state where it goes, then `fill_state`
        return ShardedState(params, None, step, layout, stage.number)
    target = optimizer.init(pieces_in)  # on the parameters' device
    opt_state = fill_state(src, layout, stage, rank, target, device)
    return ShardedState(params, opt_state, step, layout, stage.number)


def resume(
    src: Source,
    layout: ShardLayout,
    optimizer: Optimizer,
    stage: Stage,
    mesh: Mesh,
    step: int,
    device: torch.device,
    what: str,
    *,
    precision: Precision | None = None,
    offload: Offload | None = None,
    extras: Callable[[ShardedState], ShardedState] | None = None,
    compute: Sequence[torch.dtype] | None = None,
) -> ShardedState:
    """This rank's state filled from `src`, as `shard_state` holds it with `precision` and
    `offload`: what `checkpoint.load` and the imports build (not collective).

    `extras` adds the buffers and the scaler to the full-precision state before the
    masters are split off; `compute`, per leaf, the dtypes the parameters compute in
    where `precision` names none (a bfloat16 model with float32 masters). Offloaded,
    the optimizer state is made where it goes (a file on disk) and filled there a piece
    at a time, so the disk tier never holds it whole.
    """
    check_torch_keys(src.schema, optimizer)
    if precision is not None:  # the buckets `to_mixed` makes, in their masters' dtypes
        # The loaded dtypes are the compute dtypes where none are given: said before the
        # layout takes the masters' (to_mixed would read those).
        compute = list(layout.dtypes) if compute is None else compute
        layout = full_precision_layout(layout, stage, precision, compute)
    making = optimizer if offload is None else None
    state = build_state(src, layout, making, stage, mesh.shard_rank, step, device)
    if stage.shards_optimizer:  # after the state, whose misfit names the leaf
        check_slices(optimizer, layout.kind, what)
    if extras is not None:
        state = extras(state)
    if precision is not None:
        state = to_mixed(state, precision, mesh, compute)
    if offload is not None:
        state = place(state, offload, mesh, optimizer)
        placement = state.offload
        where = [x.device for x in state.master.pieces()]
        opt_state = fill_state(
            src, layout, stage, mesh.shard_rank, state.opt_state, device, placement.release, where
        )
        state = dataclasses.replace(state, opt_state=opt_state)
        placement.release_all()
    return state


def check_offloaded(offloaded: list[bool], what: str) -> None:
    """Refuses ranks that differ in passing `offload=` (every rank's flag, agreed): an
    offloaded state's masters are gathered to save or export it, and its peers' are not."""
    if len(set(offloaded)) > 1:
        said = ", ".join(f"rank {r}: {'yes' if o else 'no'}" for r, o in enumerate(offloaded))
        # Every rank holds every flag (an agreement's): they raise alike, nothing pending.
        raise _comm.agreed(
            CheckpointError(f"{what}: the ranks differ in passing offload= ({said})")
        )


def check_torch_keys(schema: Schema, optimizer: Optimizer) -> None:
    """Refuses a torch optimizer's saved state (`from_torch`: a dict per tensor) that does
    not fit `optimizer`'s: torch reads a tensor's state without its keys as fresh (SGD's
    momentum restarting without a word), or fails in its step (a KeyError for Adam's
    amsgrad). What `optimizer` keeps is found by stepping it on a tiny vector and matrix
    (Adafactor keeps other keys for each): the saved keys must be among those, and hold
    the ones it keeps for both. A state of another shape (fzero's own optimizers) is
    checked as it is filled."""
    if schema.nodes != ("",) or schema.kind not in ("tuple", "dict", "list"):
        return
    saved = {e.sub for e in schema.entries if e.node == ""}
    kept = [k for k in (_torch_keys(optimizer, shape) for shape in ((2,), (2, 2))) if k is not None]
    if not saved or len(kept) < 2:
        return
    every, some = set.intersection(*kept), set.union(*kept)
    if not every <= saved <= some:
        raise CheckpointError(
            f"the saved optimizer state keeps {sorted(saved)} per tensor, this optimizer "
            f"keeps {sorted(some)}: was it saved with another torch optimizer class or "
            "options (momentum, amsgrad)?"
        )


def _torch_keys(optimizer: Optimizer, shape: tuple[int, ...]) -> set[str] | None:
    """The tensors a `from_torch` optimizer keeps for a tensor of `shape` after a step
    (None: its state is not a dict per tensor, or it cannot step one on its own)."""
    p = {"probe": torch.ones(shape)}
    try:
        _, state = optimizer.update({"probe": torch.ones(shape)}, optimizer.init(p), p)
    except Exception:
        return None
    leaf = state.get("probe") if isinstance(state, dict) else None
    if not isinstance(leaf, dict):
        return None
    return {k for k, v in leaf.items() if isinstance(v, torch.Tensor)}


def fill_state(
    src: Source,
    layout: ShardLayout,
    stage: Stage,
    rank: int,
    target: Any,
    device: torch.device | None,
    filled: Callable[[int], None] | None = None,
    devices: list[torch.device] | None = None,
) -> Any:
    """`target` (`optimizer.init` of this rank's pieces) with every tensor replaced by the
    saved value, written into it where it is a tensor; `filled(bucket)` after each piece's
    entry is written (an offloaded state drops the pages it wrote). A state made on the
    first update (from_torch's dicts) is made on `devices[i]` for piece i if given (an
    offloaded piece's is the host), else on `device`."""
    pieces = pieces_of(layout, stage, rank)
    filler = _Filler(src, layout, pieces, device, filled, devices)
    return filler.fill(target, piece_spec(layout, stage, len(pieces)))


class _Filler:
    """Replaces every tensor of a freshly initialised optimizer state with saved values."""

    def __init__(
        self,
        src: Source,
        layout: ShardLayout,
        pieces: list[Piece],
        device: torch.device | None,
        filled: Callable[[int], None] | None = None,
        devices: list[torch.device] | None = None,
    ) -> None:
        self.src, self.layout, self.pieces, self.device = src, layout, pieces, device
        self.filled, self.devices = filled, devices
        self.schema = src.schema

    def fill(self, target: Any, spec: Any) -> Any:
        nodes: list[str] = []
        globals_: list[str] = []
        walk(target, spec, lambda p, t: nodes.append(p), lambda p, t: globals_.append(p))
        self._check_fits(target, nodes, globals_)

        def on_node(path: str, tree: Any) -> Any:
            states = spec.flatten_up_to(tree)
            new = [
                self._piece_state(path, t, p, i)
                for i, (t, p) in enumerate(zip(states, self.pieces, strict=True))
            ]
            return spec.unflatten(new)

        return walk(target, spec, on_node, self._global)

    def _check_fits(self, target: Any, nodes: list[str], globals_: list[str]) -> None:
        s = self.schema
        if sorted(nodes) != sorted(s.nodes) or sorted(globals_) != sorted(s.globals):
            raise CheckpointError(
                f"the saved optimizer state ({s.kind}: per-parameter {sorted(s.nodes)}, "
                f"global {sorted(s.globals)}) does not fit this optimizer's "
                f"({type(target).__name__}: per-parameter {sorted(nodes)}, global "
                f"{sorted(globals_)}): was it saved with another optimizer or options?"
            )

    def _global(self, path: str, like: torch.Tensor) -> torch.Tensor:
        value = self.src.global_(path)
        if value.shape != like.shape or value.dtype != like.dtype:
            raise CheckpointError(
                f"optimizer state {path!r} is saved as {tuple(value.shape)} {value.dtype}, "
                f"this optimizer keeps {tuple(like.shape)} {like.dtype}"
            )
        return value.to(like.device, copy=True)

    def _piece_state(self, node: str, like: Any, piece: Piece, i: int) -> Any:
        if isinstance(like, torch.Tensor):
            j = self.schema.index((node, ""))
            if j < 0:
                raise CheckpointError(f"the checkpoint has no optimizer state {node!r}")
            value = self._value(j, piece, required=True)
            if value.shape != like.shape or value.dtype != like.dtype:
                raise CheckpointError(
                    f"optimizer state {node!r} of {self._name(piece)} is saved as "
                    f"{tuple(value.shape)} {value.dtype}, expected {tuple(like.shape)} {like.dtype}"
                )
            # Into the freshly initialised tensor, not beside it: a load then never holds
            # the optimizer state twice (zeros and saved values), only one piece extra.
            like.copy_(value)
            del value
            if self.filled is not None:
                self.filled(piece.bucket)
            return like
        if isinstance(like, dict):
            out = dict(like)
            for j, e in enumerate(self.schema.entries):
                if e.node == node and self._present(e, piece):
                    where = self.device if self.devices is None else self.devices[i]
                    out[e.sub] = self._value(j, piece, required=False).to(where)
            return out
        raise CheckpointError(f"cannot fill optimizer state of type {type(like).__name__}")

    def _present(self, e: Entry, piece: Piece) -> bool:
        """Whether the piece's state has entry `e` (torch creates state lazily, per tensor)."""
        if piece.hi == piece.lo:
            return False  # torch skips empty tensors: they never get state
        bucket = self.layout.buckets[piece.bucket]
        # A slice that is all padding holds what the other slices of its bucket hold.
        leaves = covered(bucket, piece.lo, piece.hi) or covered(bucket, 0, bucket.full_numel)
        flags = {i in e.present for i in leaves}
        if len(flags) > 1:
            raise CheckpointError(
                f"optimizer state {e.name!r} exists for some parameters of "
                f"{self._name(piece)} and not for others; it cannot share a flat shard "
                "(load with layout='tensor')"
            )
        return flags == {True}

    def _value(self, j: int, piece: Piece, required: bool) -> torch.Tensor:
        e = self.schema.entries[j]
        leaf = piece.leaf
        if e.kind == "elem":
            bucket = self.layout.buckets[piece.bucket]
            missing = [i for i in covered(bucket, piece.lo, piece.hi) if i not in e.present]
            if missing and required:
                raise CheckpointError(
                    f"parameter {self.layout.paths[missing[0]]!r} has no saved optimizer state "
                    f"{e.name!r} (was it frozen when the checkpoint was written?)"
                )
            dtype = piece.dtype if e.dtype == "param" else dtype_of(e.dtype)
            if leaf >= 0:
                return self.src.elem(j, leaf, 0, piece.hi - piece.lo).to(dtype).reshape(piece.shape)
            read = lambda i, a, b: self.src.elem(j, i, a, b)  # noqa: E731
            return assemble(read, bucket, piece.lo, piece.hi, dtype, self.device)
        value = self.src.piece(j, leaf) if leaf >= 0 else None
        if value is not None:
            return value.clone()
        if e.uniform:
            return self.src.uniform(j).clone()
        raise CheckpointError(
            f"optimizer state {e.name!r} is kept per tensor (not per element, and not the same "
            f"for every tensor), so it cannot be cut into {self._name(piece)}; it moves only "
            "between whole tensors (load with layout='tensor')"
        )

    def _name(self, piece: Piece) -> str:
        if piece.leaf >= 0:
            return f"parameter {self.layout.paths[piece.leaf]!r}"
        b = self.layout.buckets[piece.bucket]
        return f"flat bucket {piece.bucket} ({b.unit or 'root'} unit, {b.dtype})"
