"""The per-unit primitive by hand: `gather_params` and its transpose `reduce_scatter_grads`."""

from __future__ import annotations

from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    PyTree,
    ShardLayout,
    Shards,
    UnitSpec,
    build_layout,
    members_of,
    name_of,
    subtree,
    tree_unflatten,
)
from ._entry import Entry, enter


class Now:
    """The engine of the primitives used by hand: the node's forward all-gathers the
    shards it is given, its backward reduce-scatters (mean) their gradient and returns it,
    both at once. (A step's engine, `_engine.Engine`, schedules the same node: both are
    `_entry.Runner`s.)"""

    leaf_grads = False

    def __init__(
        self, layout: ShardLayout, mesh: Mesh, reduce_dtype: torch.dtype | None = None
    ) -> None:
        self.layout, self.mesh, self.reduce_dtype = layout, mesh, reduce_dtype

    def open(self, entry: Entry, shards: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # In the layout's (compute) dtype: a shard held at higher precision (an fp32
        # master) is gathered as its cast.
        n, dtypes = self.mesh.shard_size, [self.layout.buckets[i].dtype for i in entry.buckets]
        outs = (s.new_empty(s.numel() * n, dtype=d) for s, d in zip(shards, dtypes))
        return tuple(_comm.all_gather(s, self.mesh, out=o) for s, o in zip(shards, outs))

    def close(self, entry: Entry, grads: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
        # The transpose of an all-gather is a reduce-scatter; fzero's is the mean over
        # ranks, so a per-rank loss on a per-rank micro-batch trains like DDP. Every
        # bucket of the node is reduced (zeros where unused), so a rank whose loss ignores
        # one still joins the collective its peers are waiting in.
        return tuple(
            None if g is None else _comm.reduce_scatter_mean(g, self.mesh, self.reduce_dtype)
            for g in grads
        )


def gather_params_into(
    shards: Shards,
    mesh: Mesh,
    out: tuple[torch.Tensor, ...],
    dtypes: tuple[torch.dtype, ...] | None = None,
    burst_bytes: int = 0,
) -> None:
    """All-gathers `shards` into the existing full flat buffers `out`, in place (no autograd).

    The donating stages 1-2 refill the replicated parameters where they live instead of
    allocating a second full copy next to the old one. `dtypes`: what each buffer travels
    in (mixed precision: master shards cast down to the gather dtype); default `out`'s.
    `burst_bytes`: consecutive buffers of one dtype and device (at two ranks, each of at
    most 1 MiB: `_PACK_MAX_BYTES`) travel together as one collective of up to this many
    bytes (`_comm.all_gather_many_async`), which holds a burst's worth of staging buffers
    while it runs; larger buffers, and every buffer with 0, are gathered by themselves,
    straight into place.
    """
    dtypes = dtypes or tuple(o.dtype for o in out)
    works = []
    pack_max = _PACK_MAX_BYTES if mesh.shard_size <= 2 else burst_bytes
    for group in _bursts(shards.buffers, out, dtypes, burst_bytes, pack_max):
        s, o, d = (list(x) for x in zip(*group))
        if len(group) == 1:
            works.append(_comm.all_gather_async(s[0].to(d[0]), mesh, out=o[0], dtype=d[0])[1])
        else:  # finished before the next starts: one burst's staging buffers at a time
            _comm.all_gather_many_async(s, o, mesh, d[0]).wait()
    for work in works:
        if work is not None:
            work.wait()


# A full buffer of more than this many bytes is gathered alone, straight into place, at
# two ranks (docs/design.md, [Note: gather bursts]).
_PACK_MAX_BYTES = 1 << 20


def _bursts(
    shards: tuple[torch.Tensor, ...],
    out: tuple[torch.Tensor, ...],
    dtypes: tuple[torch.dtype, ...],
    burst_bytes: int,
    pack_max: int,
) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]]:
    """(shard, full buffer, dtype) in order, grouped into runs of one dtype and device of
    at most `burst_bytes` of full buffers; a buffer of more than `pack_max` (or
    `burst_bytes`) bytes is a group of its own."""
    groups: list[list[tuple[torch.Tensor, torch.Tensor, torch.dtype]]] = []
    size, packing = 0, False  # the open group's bytes; whether more may join it
    for s, o, d in zip(shards, out, dtypes):
        nbytes = o.numel() * d.itemsize
        small = nbytes <= pack_max
        last = groups[-1][-1] if groups else None
        joins = (
            small
            and packing
            and last is not None
            and last[2] == d
            and last[1].device == o.device
            and size + nbytes <= burst_bytes
        )
        if not joins:
            groups.append([])
            size = 0
        groups[-1].append((s, o, d))
        size += nbytes
        packing = small
    return groups


def _gathers(params: PyTree, mesh: Any = None, unit: Any = None) -> bool:
    """Whether `gather_params` gathers (shards), or returns a replicated tree as it is."""
    return isinstance(params, Shards)


# The primitives by hand are fzero calls too: a rank failing in one fails its peers at
# once, and ranks in different calls raise alike ([Note: the same call]).
@_comm.collective("gather_params", sends=_gathers)
def gather_params(params: PyTree, mesh: Mesh, *, unit: UnitSpec | None = None) -> Any:
    """The full parameter tree (or one unit's part of it), on every rank.

    Differentiable: the gradient with respect to the shards is the reduce-scatter (mean over
    ranks) of the gradient with respect to the full tree, so `loss_fn(gather_params(s, mesh),
    batch)` differentiated by `s` is a stage-3 gradient. It is one node of the per-unit
    primitive a step is built from (`fzero.gathered` enters a unit the same way inside a
    step, where the step schedules it); it also works under `torch.func.grad`.

    Args:
      params: `state.params` at any stage: `Shards` (stage 3, or gradients from
        `reduce_scatter_grads`), or an already replicated full tree (stages 0-2), which is
        returned as it is: the state's own buffers, which a donating step updates in
        place (clone what you keep across steps; no copy is made of a whole model).
      mesh: the mesh the shards live on.
      unit: gather only this unit's buckets (one of the layout's `units=` entries: a
        path prefix, or a group's tuple of them) and return its part of the tree, as
        `fzero.gathered` does (for a group, a tuple of the parts under its prefixes);
        None: everything.

    Returns:
      A tree with the structure, shapes and dtypes of the original parameters (or of the
      unit's part); its leaves are views into one freshly gathered flat buffer per bucket.
    """
    members = None if unit is None else () if unit == "" else members_of([unit])[0]
    if not isinstance(params, Shards):
        return params if members is None else _parts(params, unit, members)
    layout = params.layout
    if layout.world_size != mesh.shard_size or params.rank != mesh.shard_rank:
        raise ValueError(
            f"shards of rank {params.rank} of {layout.world_size} cannot be gathered on "
            f"rank {mesh.rank} (shard {mesh.shard_rank} of {mesh.shard_size})"
        )
    if members is None:
        entry = Entry("", tuple(range(len(layout.buckets))))
        return layout.unflatten(enter(Now(layout, mesh), entry, _carried(params.buffers, mesh)))
    if members not in layout.members:
        raise ValueError(f"{unit!r} is not a unit of the layout (units: {list(layout.specs)})")
    name = name_of(members)
    entry = Entry(name, layout.unit_buckets(name))
    bufs = _carried(tuple(params.buffers[i] for i in entry.buckets), mesh)
    fulls = enter(Now(layout, mesh), entry, bufs)
    views = layout.unflatten_unit(name, fulls)
    leaves = [views.get(p) for p in layout.paths]
    return _parts(tree_unflatten(layout.treedef, leaves), unit, members)


def _carried(bufs: tuple[torch.Tensor, ...], mesh: Mesh) -> tuple[torch.Tensor, ...]:
    """Host shards (a state's `Offload(params=True)` buckets) over to the mesh's device
    where its group cannot move host memory (NCCL alone); the others as they are."""
    device = mesh.device
    if device.type == "cpu" or not any(b.device.type == "cpu" for b in bufs):
        return bufs
    if _comm.backend_for(mesh.shard.group, torch.device("cpu")) is not None:
        return bufs  # a group with a CPU backend ("cpu:gloo,cuda:nccl") gathers them
    return tuple(b.to(device) if b.device.type == "cpu" else b for b in bufs)


def _parts(tree: PyTree, unit: UnitSpec, members: tuple[str, ...]) -> Any:
    """A unit's part of `tree`: the subtree under its prefix, or a tuple for a group's."""
    if isinstance(unit, str):
        return subtree(tree, unit)
    return tuple(subtree(tree, p) for p in members)


@_comm.collective("reduce_scatter_grads")
def reduce_scatter_grads(
    grads: PyTree, layout: ShardLayout, mesh: Mesh, *, dtype: torch.dtype | None = None
) -> Shards:
    """This rank's shard of the mean over ranks of `grads`.

    The transpose of `gather_params` (literally its backward, `Now.close`): packs
    the full gradient tree into the layout's flat buckets and reduce-scatters each, so a
    rank keeps only the gradient of what it owns.

    Args:
      grads: a full gradient tree with the structure, shapes and dtypes of the parameters.
      layout: `state.layout`.
      mesh: the mesh.
      dtype: the dtype to reduce in (e.g. torch.float32 for bfloat16 gradients, or
        bfloat16 to halve the bytes); None: the gradients' own. The shards come back in it.

    Returns:
      Shards holding this rank's slice of every bucket of the mean gradient.
    """
    _check_mesh(layout, mesh)
    flats = layout.flatten(grads, what="grads")
    entry = Entry("", tuple(range(len(layout.buckets))))
    return Shards(Now(layout, mesh, dtype).close(entry, flats), layout, mesh.shard_rank)


@_comm.collective("all_reduce_grads")
def all_reduce_grads(grads: PyTree, mesh: Mesh) -> PyTree:
    """The mean over ranks of `grads`, replicated (DDP's all-reduce), as a new tree.

    Leaves are packed into one flat buffer per dtype so each dtype costs one collective.

    Args:
      grads: a gradient tree of floating-point tensors.
      mesh: the mesh.

    Returns:
      A tree of the same structure whose leaves are views into the reduced buffers.
    """
    packing = build_layout(grads, 1)
    return packing.unflatten([_comm.all_reduce_mean(f, mesh) for f in packing.flatten(grads)])


def local_shard(tree: PyTree, layout: ShardLayout, mesh: Mesh) -> Shards:
    """This rank's slice of a replicated full tree (a copy; no communication).

    Stages 1-2 use it to cut the parameter and gradient shards a rank updates.

    Args:
      tree: a full tree with the layout's structure (parameters or reduced gradients).
      layout: `state.layout`.
      mesh: the mesh.

    Returns:
      Shards with this rank's slice of every bucket.
    """
    _check_mesh(layout, mesh)
    return Shards(layout.shard(tree, mesh.shard_rank), layout, mesh.shard_rank)


def _check_mesh(layout: ShardLayout, mesh: Mesh) -> None:
    if layout.world_size != mesh.shard_size:
        raise ValueError(
            f"layout is for {layout.world_size} ranks, the mesh shards over {mesh.shard_size}"
        )
