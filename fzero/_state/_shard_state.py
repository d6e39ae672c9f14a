"""ShardedState and shard_state: the `init` of every ZeRO stage."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    NAMESPACE,
    Bucket,
    PyTree,
    ShardLayout,
    Shards,
    Stage,
    UnitSpec,
    build_layout,
    check_distinct,
    device_of,
    leaf_paths,
    pack,
    stage_of,
    tree_flatten,
    tree_map,
)
from ..optim import Optimizer
from ..optim._base import check_optimizer, check_slices
from ._agree_layout import agree_layout
from ._deferred import check_init, materialize
from ._frozen import frozen_leaves
from ._initializers import Init
from ._loss_scale import DynamicLossScale, LossScaleState
from ._mixed import full_precision_layout, held_shards, master_layout, to_mixed
from ._offload import Offload, Placement, check_offload, place
from ._precision import (
    Precision,
    cast_params,
    check_castable,
    compute_params,
    gathered_leaves,
    needs_master,
)


@dataclass(frozen=True)
class ShardedState:
    """Everything one rank keeps between steps.

    Attributes:
      params: stages 0-2: the full parameter tree (replicated; leaves are views into one
        flat buffer per dtype). Stage 3: this rank's `Shards` (under mixed precision,
        a trainable bucket's shard is its master: gathering casts it to the layout's
        compute dtype).
      opt_state: optimizer state of what this rank updates: the full tree at stage 0,
        its shard's pieces at stages 1-3.
      step: number of updates applied.
      layout: how parameters are split over ranks (static).
      stage: the ZeRO stage, 0-3 (static).
      buffers: module buffers (BatchNorm running statistics, counters), replicated on
        every rank, or None. With buffers, `loss_fn(params, buffers, batch)` returns
        `(loss, new_buffers)`; see `sharded_step(buffer_sync=...)`.
      master: under mixed precision, the master copies the optimizer updates, in the
        master dtype: the full trainable tree at stage 0, this rank's `Shards` (frozen
        buckets empty) at stages 1-3; `params` are these cast to the compute dtype
        (stage 3: these themselves, cast as they are gathered).
        None without masters.
      scaler: the dynamic loss scaler's state, or None.
      precision: the `Precision` (static), or None.
      offload: where the masters and optimizer state of each bucket live (static): a
        `Placement` from `shard_state(offload=)`, or None (all on the device).
    """

    params: PyTree
    opt_state: Any
    step: int
    layout: ShardLayout
    stage: int
    buffers: PyTree = None
    master: PyTree = None
    scaler: LossScaleState | None = None
    precision: Precision | None = None
    offload: Placement | None = None


optree.register_pytree_node(
    ShardedState,
    lambda s: (
        (s.params, s.opt_state, s.step, s.buffers, s.master, s.scaler),
        (s.layout, s.stage, s.precision, s.offload),
        ("params", "opt_state", "step", "buffers", "master", "scaler"),
    ),
    lambda meta, c: ShardedState(*c[:3], *meta[:2], *c[3:], *meta[2:]),
    namespace=NAMESPACE,
)


@_comm.collective("shard_state")
def shard_state(
    params: PyTree,
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    layout: str = "flat",
    units: Sequence[UnitSpec] | None = None,
    bucket_bytes: int | None = None,
    frozen: Any = None,
    buffers: PyTree = None,
    precision: Precision | None = None,
    loss_scale: DynamicLossScale | None = None,
    init: Init | None = None,
    offload: Offload | None = None,
) -> ShardedState:
    """Builds this rank's training state for ZeRO `stage`: the `init` of a sharded step.

    Like DDP's constructor, rank 0's values win (they are broadcast). Every rank passes
    parameters of the same structure, shapes and dtypes; a mismatch raises on every rank,
    naming the first differing leaf. Options: docs/training.md, docs/checkpoints.md.

    Args:
      params: a pytree of floating-point tensors (`dict(model.named_parameters())`); not
        modified, and not aliased by the state.
      optimizer: an `fzero.optim.Optimizer`; its state is built for what this rank updates.
      mesh: the data-parallel mesh (`ProcessGroupMesh` or a rank of `simulate`).
      stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
      layout: "flat" (flat buffers split evenly) or "tensor" (whole tensors per rank, for
        per-tensor optimizers such as Adafactor: see `Optimizer.whole_tensors`).
      units: path prefixes (or tuples of them), each gathered and reduced as one unit
        (`fzero.units`); the parameters in none form the root unit.
      bucket_bytes: instead of `units`, units of at least this many bytes (`by_size`).
      frozen: a bool tree like `params` or a list of path prefixes; by default the leaves
        that do not require grad, if some do. Frozen leaves keep their values bitwise.
      buffers: module buffers carried through steps, rank 0's; the loss is then
        `loss_fn(params, buffers, batch) -> (loss, new_buffers)`.
      precision: a `fzero.Precision`: masters of this rank's shard, compute dtypes.
      loss_scale: a `fzero.DynamicLossScale`; its state is `state.scaler`.
      init: an initializer from `fzero.init`: each rank makes or reads only what it
        holds, `params` may be meta tensors, and ranks check they made the same values.
      offload: a `fzero.Offload`: the masters and optimizer state of all or part of the
        units on the host or on local disk, updated there (stages 1-3).

    Returns:
      A ShardedState.
    """
    spec = stage_of(stage)
    check_optimizer(optimizer, "shard_state", mesh)
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(f"precision must be a fzero.Precision, got {type(precision).__name__}")
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(
            f"loss_scale must be a fzero.DynamicLossScale, got {type(loss_scale).__name__}"
        )
    if bucket_bytes is not None:
        units = _units_of_bytes(params, units, bucket_bytes)
    convert = None  # what each leaf goes through before it is packed (`compute_params`)
    try:
        frozen_flags = frozen_leaves(params, frozen)
        lay = build_layout(params, mesh.shard_size, layout, units, frozen_flags)  # validates
        check_distinct(lay.paths, tree_flatten(params)[0], frozen_flags)
        if spec.shards_optimizer:
            check_slices(optimizer, lay.kind)  # `agree_layout` names shard_state and the rank
        check_init(params, init)
        check_offload(offload, spec.number)
        if precision is not None and init is None:
            check_castable(params, precision.param_dtype, mesh.rank, "param_dtype")
            gathered = gathered_leaves(spec, frozen_flags)
            check_castable(params, precision.gather_dtype, mesh.rank, "gather_dtype", gathered)
            # The layout from the compute dtypes alone; the values are cast a bucket at a
            # time as they are packed, never as a second whole tree.
            meta = tree_map(lambda x: x.detach().to("meta"), params)
            cast_meta = compute_params(meta, precision, spec, frozen_flags)
            lay = build_layout(cast_meta, mesh.shard_size, layout, units, frozen_flags)
            convert = partial(_converted, precision=precision, stage=spec)
        problem = None
    except (TypeError, ValueError) as exc:
        lay, problem = None, f"{type(exc).__name__}: {exc}"
    agree_layout(lay, problem, (spec.number, init is not None, offload is not None), mesh)
    if init is not None:
        state = _from_init(
            init, lay, optimizer, mesh, spec, buffers, precision, loss_scale, offload is None
        )
        return placed(state, offload, mesh, optimizer)
    state_buffers = replicate_buffers(buffers, mesh, "shard_state")
    if state_buffers is not None and precision is not None:
        state_buffers = cast_params(state_buffers, precision.buffer_dtype)
    scaler = None if loss_scale is None else loss_scale.init(device_of(params))
    master = None
    if needs_master(precision, lay, spec):
        assert precision is not None
        mlay, cast = master_layout(lay, params, precision.master_dtype)
        if spec.shards_optimizer:  # no masters of frozen buckets: nothing updates them
            own = _rank0_slices(mlay, mlay.leaves(cast), mesh, lambda b: not b.frozen)
            master = Shards(own, mlay, mesh.shard_rank)
        else:
            mflats = tuple(_comm.broadcast_(f, mesh) for f in mlay.flatten(cast))
            master = mlay.trainable(mlay.unflatten(mflats))
        del cast
    held, opt_state = _shard_params(
        params, optimizer, mesh, spec, lay, master, convert, offload is None
    )
    state = ShardedState(
        held, opt_state, 0, lay, spec.number, state_buffers, master, scaler, precision
    )
    return placed(state, offload, mesh, optimizer)


def placed(
    state: ShardedState, offload: Offload | None, mesh: Mesh, optimizer: Optimizer
) -> ShardedState:
    """`state` placed as `offload` says (`place`, which makes the optimizer state where it
    goes), or as it is; a rank that cannot (a directory it cannot write, a disk without
    room) fails every rank, with its OS error (agreed: what the exchange says)."""
    if offload is None:
        return state
    problem: Any = None
    out = state
    try:
        out = place(state, offload, mesh, optimizer)
    except OSError as exc:
        problem = (exc.errno, exc.strerror or str(exc), exc.filename)
    except Exception as exc:  # travels to every rank, raised there
        problem = f"{type(exc).__name__}: {exc}"
    for rank, prob in enumerate(_comm.all_gather_object(problem, mesh)):
        if isinstance(prob, tuple):
            number, text, filename = prob
            said = f"{text} (shard_state's offload on rank {rank})"
            raise _comm.agreed(OSError(number, said, filename))
        if prob is not None:
            raise _comm.agreed(ValueError(f"shard_state: offload on rank {rank}: {prob}"))
    return out


# What a leaf (and whether its bucket is frozen) goes through before it is packed
# (casting to the compute dtype), or nothing.
Convert = Callable[[torch.Tensor, bool], torch.Tensor] | None


def _converted(leaf: torch.Tensor, frozen: bool, precision: Precision, stage: Stage) -> Any:
    """`leaf` as `compute_params` makes it, frozen or not."""
    return compute_params(leaf, precision, stage, [frozen])


def _shard_params(
    params: PyTree,
    optimizer: Optimizer,
    mesh: Mesh,
    stage: Stage,
    lay: ShardLayout,
    master: Any,
    convert: Convert = None,
    with_optimizer: bool = True,
) -> tuple[PyTree, Any]:
    """What this rank holds of the parameters (rank 0's values, each leaf through `convert`)
    and the optimizer state of what it updates: the masters if there are any, else the
    parameters; all of the trainable tree, or this rank's pieces of it. At stage 3, one
    bucket's full buffer at a time; with masters a trainable shard is its master, so only
    frozen buckets are packed and broadcast."""
    rank, leaves = mesh.shard_rank, lay.leaves(params)
    if stage.shards_params:
        if isinstance(master, Shards):  # the trainable shards are the masters
            own = _rank0_slices(lay, leaves, mesh, lambda b: b.frozen, convert)
            held: PyTree = held_shards(own, master, lay)
        else:
            held = Shards(_rank0_slices(lay, leaves, mesh, lambda b: True, convert), lay, rank)
    else:
        flats = (_comm.broadcast_(_packed(b, leaves, convert), mesh) for b in lay.buckets)
        held = lay.unflatten(tuple(flats))
    if not with_optimizer:  # offload makes it, where it goes
        return held, None
    return held, init_optimizer(held, optimizer, stage, lay, rank, master)


def _packed(b: Bucket, leaves: list[Any], convert: Convert) -> torch.Tensor:
    """Bucket `b`'s full flat buffer of `leaves`, its own leaves through `convert` first."""
    if convert is not None:
        leaves = list(leaves)
        for s in b.slots:
            leaves[s.index] = convert(leaves[s.index], b.frozen)
    return pack(b, leaves, 0, b.full_numel)


def _rank0_slices(
    lay: ShardLayout,
    leaves: list[Any],
    mesh: Mesh,
    wanted: Callable[[Bucket], bool],
    convert: Convert = None,
) -> tuple[torch.Tensor, ...]:
    """This rank's slice of each `wanted` bucket of `leaves` as rank 0 holds them (empty for
    the others): packed and broadcast one full bucket at a time, so setup never holds a
    whole-model copy beside the caller's."""
    rank, own = mesh.shard_rank, []
    device = next((x.device for x in leaves if x is not None), None)
    for b in lay.buckets:
        if not wanted(b):
            own.append(torch.empty(0, dtype=b.dtype, device=device))
            continue
        f = _comm.broadcast_(_packed(b, leaves, convert), mesh)
        own.append(f[rank * b.shard_numel : (rank + 1) * b.shard_numel].clone())
        del f
    return tuple(own)


def init_optimizer(
    held: PyTree, optimizer: Optimizer, stage: Stage, lay: ShardLayout, rank: int, master: Any
) -> Any:
    """The optimizer state of what this rank updates: its masters if any, else `held`'s
    trainable leaves, whole or this rank's pieces."""
    if master is not None:
        target = master.pieces() if stage.shards_optimizer else master
    elif not stage.shards_optimizer:
        target = lay.trainable(held)
    elif stage.shards_params:
        target = held.pieces()
    else:
        target = Shards(lay.shard(lay.trainable(held), rank), lay, rank).pieces()
    return optimizer.init(target)


def _from_init(
    init: Init,
    lay: ShardLayout,
    optimizer: Optimizer,
    mesh: Mesh,
    stage: Stage,
    buffers: PyTree,
    precision: Precision | None,
    loss_scale: DynamicLossScale | None,
    with_optimizer: bool = True,
) -> ShardedState:
    """shard_state's body when values come from `init` (made in place, never broadcast);
    without its optimizer state if not `with_optimizer` (offload makes it)."""
    rank = mesh.shard_rank
    model = list(lay.dtypes)  # the values are made in them; without param_dtype, computed in
    if precision is not None:  # packed in the buckets `to_mixed` makes, in the masters' dtypes
        lay = full_precision_layout(lay, stage, precision, model)
    flats, buffers = materialize(init, lay, mesh, stage, buffers, precision, model)
    held: PyTree = Shards(flats, lay, rank) if stage.shards_params else lay.unflatten(flats)
    opt_state = init_optimizer(held, optimizer, stage, lay, rank, None) if with_optimizer else None
    master = None
    if precision is not None:  # the made values become the masters, as a loaded checkpoint's
        held, lay, master = to_mixed(held, lay, stage, precision, rank, model)
    state_buffers = replicate_buffers(buffers, mesh, "shard_state")
    if state_buffers is not None and precision is not None:
        state_buffers = cast_params(state_buffers, precision.buffer_dtype)
    scaler = None if loss_scale is None else loss_scale.init(device_of(flats))
    return ShardedState(
        held, opt_state, 0, lay, stage.number, state_buffers, master, scaler, precision
    )


def replicate_buffers(buffers: PyTree, mesh: Mesh, what: str) -> PyTree:
    """Copies of `buffers` holding rank 0's values, after checking every rank has the same
    paths, shapes and dtypes (collective; `what` names the caller in the error)."""
    if buffers is None:
        return None
    from .._core import tree_map

    leaves = tree_flatten(buffers)[0]
    for path, x in zip(leaf_paths(buffers), leaves):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"buffers leaf {path!r} is a {type(x).__name__}, expected a tensor")
    spec = [(p, tuple(x.shape), str(x.dtype)) for p, x in zip(leaf_paths(buffers), leaves)]
    everyone = _comm.all_gather_object(spec, mesh)
    for rank, other in enumerate(everyone):
        if other != everyone[0]:
            raise ValueError(f"{what}: rank {rank}'s buffers differ from rank 0's")
    return tree_map(lambda x: _comm.broadcast_(x.detach().clone(), mesh), buffers)


def _units_of_bytes(
    params: PyTree, units: Sequence[Any] | None, bucket_bytes: int
) -> list[str | tuple[str, ...]]:
    from .._core import by_size

    if units is not None:
        raise ValueError("pass either units= or bucket_bytes=, not both")
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    leaves = tree_flatten(params)[0]
    itemsize = max(x.element_size() for x in leaves if isinstance(x, torch.Tensor))
    return by_size(params, max(1, bucket_bytes // itemsize))
