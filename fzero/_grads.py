"""Gradient reduction by hand: reduce_scatter_grads, all_reduce_grads, local_shard."""

from __future__ import annotations

import torch

from . import _comm
from ._entry import Call
from ._gather import Now
from ._layout import ShardLayout, build_layout
from ._mesh import Mesh
from ._shards import Shards
from ._tree import PyTree


def reduce_scatter_grads(
    grads: PyTree, layout: ShardLayout, mesh: Mesh, *, dtype: torch.dtype | None = None
) -> Shards:
    """This rank's shard of the mean over ranks of `grads`.

    The transpose of `gather_params` (literally its backward, `_gather.Now.close`): packs
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
    call = Call("", tuple(range(len(layout.buckets))))
    return Shards(Now(layout, mesh, dtype).close(call, flats), layout, mesh.shard_rank)


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
