"""sharded_update: an optimizer step applied to the shard a rank owns; and a step's
update around it (unscaling, skipping) and the parameters rebuilt from it."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh, all_reduce_sum
from .._core import (
    PyTree,
    ShardLayout,
    Shards,
    Stage,
    device_of,
    leaf_paths,
    stage_of,
    tree_flatten,
    tree_map,
)
from .._engine import gather_params_into
from .._state import gather_rounded, held_shards, params_apart, unscale_
from ..optim import Optimizer
from ..optim._base import check_optimizer, check_slices
from ..optim._context import ShardContext, grads_owned, shard_context
from ._streamed import Streamer


def _looks_across(params: PyTree = None, mesh: Any = None, **_: Any) -> bool:
    """Whether `sharded_update` may communicate: shards with a mesh (a global norm)."""
    return isinstance(params, Shards) and mesh is not None


@_comm.collective("sharded_update", sends=_looks_across)
def sharded_update(
    optimizer: Optimizer,
    params: PyTree,
    grads: PyTree,
    opt_state: Any,
    *,
    donate: bool = False,
    mesh: Mesh | None = None,
) -> tuple[PyTree, Any]:
    """Applies `optimizer` to this rank's parameter shard with its gradient shard.

    With Shards the optimizer sees `Shards.pieces()`: whole flat buffers ("flat" layout;
    right for pointwise optimizers) or whole owned tensors in their shapes ("tensor"
    layout; right for any optimizer). With replicated full trees (stage 0) it is simply
    `optimizer.update`. Out of place by default: nothing passed in is modified.

    With `donate=True` (and an optimizer that has `update_`) the new values are written
    into `params` and `opt_state`, which are returned: no second copy of the shard and its
    optimizer state ever exists. The caller must not use the donated values afterwards.

    Args:
      optimizer: an `fzero.optim.Optimizer`.
      params: this rank's parameter Shards (or a full tree).
      grads: the matching gradient Shards (or a full tree), already averaged over ranks.
      opt_state: the optimizer state of this rank's pieces, from `shard_state`.
      donate: update `params` and `opt_state` in place (consuming them).
      mesh: the mesh; needed by transformations that look across ranks, such as
        `fzero.optim.clip_by_global_norm` on shards (the norm of the whole model).

    Returns:
      `(new_params, new_opt_state)`, params of the same kind as given.
    """
    check_optimizer(optimizer, "sharded_update")
    inplace = donate and optimizer.update_ is not None
    update = optimizer.update_ if inplace else optimizer.update
    if not isinstance(params, Shards):
        _check_like(grads, params)
        with shard_context(ShardContext(mesh, sharded=False, segments=None)):
            return update(grads, opt_state, params)
    if not isinstance(grads, Shards) or grads.layout != params.layout or grads.rank != params.rank:
        raise ValueError(
            "sharded_update: grads must be Shards with the parameters' layout and "
            "rank (use reduce_scatter_grads or local_shard)"
        )
    lay = params.layout
    who = "sharded_update" if mesh is None else f"rank {mesh.rank}: sharded_update"
    check_slices(optimizer, lay.kind, who)
    ctx = ShardContext(mesh, True, lay.piece_segments(params.rank), lay.world_size)
    with shard_context(ctx):
        new_pieces, new_state = update(grads.pieces(), opt_state, params.pieces())
    if inplace:  # the pieces are views into params.buffers, updated where they are
        return params, new_state
    return params.replace_pieces(tuple(new_pieces)), new_state


# A step's own update: already inside the step's call, so not a call of its own (no
# signature binding or nested call on the step's path).
_step_update = sharded_update.__wrapped__  # type: ignore[attr-defined]


def _check_like(grads: PyTree, params: PyTree) -> None:
    """Raises ValueError naming the first leaf where `grads` does not match `params`."""
    g_leaves, g_def = tree_flatten(grads)
    p_leaves, p_def = tree_flatten(params)
    if g_def != p_def:
        extra = sorted(set(leaf_paths(grads)) ^ set(leaf_paths(params)))
        raise ValueError(
            f"sharded_update: grads and params differ in structure (leaves only "
            f"in one of them: {extra[:5]})"
        )
    for k, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype:
            # Paths only for the message: naming every leaf costs a walk of the tree.
            path = leaf_paths(params)[k]
            got = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(
                f"sharded_update: grads leaf {path!r} is {got}, params have "
                f"{tuple(p.shape)} {p.dtype}"
            )


# -- a step's update --------------------------------------------------------------------


def after_update(
    stage: Stage,
    new: Any,
    local: Any,
    state: Any,
    mesh: Mesh,
    donate: bool,
    burst_bytes: int = 0,
) -> PyTree:
    """The parameters after a step's update: the updated shards all-gathered (where the
    stage replicates parameters and shards the optimizer; buckets together in bursts of
    up to `burst_bytes`), the masters cast down (stage 0), the update itself, or (stage
    3 with masters) the masters beside the frozen shards. `local`: the replicated full
    buffers the step ran on."""
    lay = state.layout
    if stage.regathers:
        return _regather(new, local, state, mesh, donate, burst_bytes)
    if state.master is None:
        return new if stage.shards_params else lay.merge(state.params, new)
    if not stage.shards_params:
        return _cast_tree(new, state, donate)
    return held_shards(state.params.buffers, new, lay)  # the shards are the masters


def on_device(k: int, master: torch.Tensor, state: Any, donate: bool) -> torch.Tensor:
    """Offloaded bucket k's updated master as the device needs it: cast on the host to
    what the device holds (stage 3: the parameter shard, written in place when donating;
    stages 1-2: what the all-gather sends), then copied over (asynchronously, from pinned
    memory to a GPU)."""
    if stage_of(state.stage).shards_params:
        held = state.params.buffers[k]
        apart = params_apart(state)
        if apart is not None:  # `Offload(params=True)`: a host shard
            if state.offload.spill is None and held.dtype == master.dtype:
                return master  # the host tier without Precision: the shard is the master
            if donate:
                return held.copy_(gather_rounded(master, held.dtype, state.precision))
            return _cast_for(master, held.dtype, apart, state.precision)  # pinned for a GPU
        value = _cast_for(master, held.dtype, held.device, state.precision)
        if donate:
            return held.copy_(value, non_blocking=value.is_pinned())
        return value.to(held.device, non_blocking=value.is_pinned())  # a fresh copy already
    gather = None if state.precision is None else state.precision.gather_dtype
    device, dtype = device_of(state.params), gather or state.layout.buckets[k].dtype
    value = _cast_for(master, dtype, device)
    return value.to(device, non_blocking=value.is_pinned())


def _cast_for(
    master: torch.Tensor, dtype: torch.dtype, device: Any, precision: Any = None
) -> torch.Tensor:
    """`master` cast to `dtype` on the host, into pinned memory when it goes to a GPU (the
    copy then runs on the device's stream while the host steps the next unit; torch's
    pinned allocator keeps the buffer until that copy is done). With `precision`, a
    stage-3 shard's copy: what a gather of the master delivers (`gather_rounded`)."""
    pinned = device is not None and torch.device(device).type == "cuda"
    out = torch.empty(master.shape, dtype=dtype, device=master.device, pin_memory=pinned)
    return out.copy_(gather_rounded(master, dtype, precision))


def streamer(
    optimizer: Optimizer, state: Any, target: Any, mesh: Mesh, donate: bool
) -> Streamer | None:
    """The update of an offloaded state's step, unit by unit (None: nothing offloaded)."""
    if state.offload is None:
        return None
    deliver = functools.partial(on_device, state=state, donate=donate)
    return Streamer(optimizer, target, state.opt_state, mesh, donate, state.offload, deliver)


def apply_update(
    optimizer: Optimizer,
    state: Any,
    target: Any,
    grads: Any,
    mesh: Mesh,
    donate: bool,
    factor: float = 1.0,
    streamed: Streamer | None = None,
    taken: set[int] | None = None,
) -> tuple[Any, Any, bool, Any]:
    """A step's optimizer update of `target` (parameters or masters; a tree or Shards).

    Gradients arrive in the reduce dtype and are cast to the target's, then multiplied by
    `factor` (the step's weighting, `_loss_weights`) in the target's precision. With a loss scaler
    they are unscaled, and if any rank found an inf or NaN, nothing is updated on any rank
    (the third value is then False). The fourth is the new target as the device holds it:
    the target itself, or with an offloaded state, its offloaded buckets' device values.
    An offloaded state is updated by `streamed` (`streamer`); `taken` (None: the step did
    not overlap) names the buckets it stepped while the backward ran (`_overlap`), whose
    gradients are neither cast nor scaled here, nor read.
    """
    overlapped = taken is not None
    taken = taken or set()
    if isinstance(target, Shards):
        bufs = tuple(
            g if k in taken else g.to(t.dtype)
            for k, (g, t) in enumerate(zip(grads.buffers, target.buffers))
        )
        grads = Shards(bufs, target.layout, target.rank)
        leaves = [b for k, b in enumerate(bufs) if k not in taken]
    else:
        grads = tree_map(lambda g, t: g.to(t.dtype), grads, target)
        leaves = tree_flatten(grads)[0]
    if factor != 1.0:  # the step's own gradient buffers (or casts of them): scaled in place
        for g in leaves:
            g.mul_(factor)
    if state.scaler is not None and unscale_(leaves, state.scaler.scale, mesh):
        return target, state.opt_state, False, target
    if streamed is not None:
        with grads_owned():
            new, opt_state, delivered = streamed.finish(grads, overlapped)
        bufs = tuple(delivered.get(k, x) for k, x in enumerate(new.buffers))
        return new, opt_state, True, Shards(bufs, new.layout, new.rank)
    with grads_owned():  # the step's own buffers, used once: transforms scale in place
        new, opt_state = _step_update(
            optimizer, target, grads, state.opt_state, donate=donate, mesh=mesh
        )
    return new, opt_state, True, new


def _cast_tree(master: PyTree, state: Any, donate: bool) -> PyTree:
    """Stage 0 under mixed precision: the parameters as the masters cast down."""
    lay = state.layout
    trainable = lay.trainable(state.params)
    with torch.no_grad():
        if donate:  # into the flat buffers the parameters are views of
            tree_map(lambda p, m: p.copy_(m), trainable, master)
            return state.params
        cast = tree_map(lambda p, m: m.to(p.dtype), trainable, master)
        return lay.unflatten(lay.flatten(lay.merge(state.params, cast)))


def _regather(
    shard: Shards,
    local: tuple[torch.Tensor, ...],
    state: Any,
    mesh: Mesh,
    donate: bool,
    burst_bytes: int,
) -> PyTree:
    """Stages 1-2: every rank's updated shard, all-gathered into the full parameters.

    Frozen buckets are not gathered: every rank already holds them, unchanged. Donating,
    the trainable buckets are gathered into the buffers the old parameters live in (no
    second full copy); otherwise into new ones. Under mixed precision `shard` is the
    master shard, which travels cast to the gather dtype. `local`: the full buffers the
    step ran on (`full_buckets` of the parameters), whose own slice may already be `shard`.
    """
    lay = state.layout
    full = list(local)
    live = [i for i, b in enumerate(lay.buckets) if not b.frozen]
    gather_dtype = None if state.precision is None else state.precision.gather_dtype
    comm = tuple(gather_dtype or lay.buckets[i].dtype for i in live)
    targets = tuple(full[i] if donate else torch.empty_like(full[i]) for i in live)
    gather_params_into(
        Shards(tuple(shard.buffers[i] for i in live), lay, mesh.shard_rank),
        mesh,
        targets,
        comm,
        burst_bytes,
    )
    for i, t in zip(live, targets):
        full[i] = t
    if donate and _views_into(state.params, lay, full):
        # Gathered in place under the parameters' own leaves: cutting them again would
        # cost a split and a view per leaf, every step, for the same views.
        return state.params
    return lay.unflatten(full)


def _views_into(tree: PyTree, lay: ShardLayout, flats: list[torch.Tensor]) -> bool:
    """Whether `tree`'s leaves are the layout's views into `flats` (as `unflatten` cuts
    them; `full_buckets` tells them by each bucket's first leaf alike)."""
    leaves = tree_flatten(tree)[0]
    return all(leaves[b.slots[0].index]._base is f for b, f in zip(lay.buckets, flats) if b.slots)


def check_finite(grads: Any, mesh: Mesh, step: int) -> None:
    """qgZ without a loss scaler: a non-finite gradient fails every rank, not one.

    Int8 blocks carry inf or NaN as NaN to whichever rank owns them; that rank alone
    would see it, so the ranks compare (one small all-reduce and a host sync per step).
    """
    if not isinstance(grads, Shards) or not grads.buffers:
        return
    # One flag for every buffer, so one host sync (below) rather than one per buffer. Read
    # only: offload's host thread may be reading these buffers already.
    bad = sum((~torch.isfinite(g)).any().double() for g in grads.buffers if g.numel())
    flags = all_reduce_sum(
        torch.as_tensor(bad, dtype=torch.float64).clamp(max=1).view(1), mesh, control=True
    )
    if flags.item():
        raise ValueError(
            f"rank {mesh.rank}: step {step}: the gradients hold inf or NaN after the quantized "
            f"reduction (QuantizedComm(grads=True)) on {int(flags.item())} rank(s); without "
            f"a loss scaler the step cannot skip it. Find the overflow, use a "
            f"DynamicLossScale, or turn qgZ off"
        )
