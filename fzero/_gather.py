"""gather_params: all-gather of shards into the full tree; its backward is a reduce-scatter."""

from __future__ import annotations

from typing import Any

import torch

from . import _comm
from ._flat import cut
from ._mesh import Mesh
from ._shards import Shards
from ._tree import PyTree, tree_unflatten


class _AllGather(torch.autograd.Function):
    """All-gather of every bucket in one node, so backward runs for all buckets or none.

    One node per call (not per bucket) keeps the collectives in the same order on every
    rank: a rank whose loss ignores a bucket still reduce-scatters zeros for it, in turn,
    instead of skipping a collective its peers are waiting in. Written in setup_context
    style so it also works under `torch.func.grad`.
    """

    @staticmethod
    def forward(mesh: Mesh, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(_comm.all_gather(s, mesh) for s in shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.mesh = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        # Transpose of an all-gather is a reduce-scatter; fzero's is the mean over ranks,
        # so a per-rank loss on a per-rank micro-batch trains like DDP.
        return (None, *(_comm.reduce_scatter_mean(g, ctx.mesh) for g in grads))


def gather_params_into(
    shards: Shards,
    mesh: Mesh,
    out: tuple[torch.Tensor, ...],
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> None:
    """All-gathers `shards` into the existing full flat buffers `out`, in place (no autograd).

    The donating stages 1-2 refill the replicated parameters where they live instead of
    allocating a second full copy next to the old one. `dtypes`: what each buffer travels
    in (mixed precision: master shards cast down to the gather dtype); default `out`'s.
    """
    dtypes = dtypes or tuple(o.dtype for o in out)
    works = [
        _comm.all_gather_async(s.to(d), mesh, out=o, dtype=d)[1]
        for s, o, d in zip(shards.buffers, out, dtypes)
    ]
    for work in works:
        if work is not None:
            work.wait()


def gather_params(params: PyTree, mesh: Mesh) -> PyTree:
    """The full parameter tree, on every rank.

    Differentiable: the gradient with respect to the shards is the reduce-scatter (mean over
    ranks) of the gradient with respect to the full tree, so `loss_fn(gather_params(s, mesh),
    batch)` differentiated by `s` is a stage-3 gradient.

    Args:
      params: `state.params` at any stage: `Shards` (stage 3, or gradients from
        `reduce_scatter_grads`), or an already replicated full tree (stages 0-2), which is
        returned as it is.
      mesh: the mesh the shards live on.

    Returns:
      A tree with the structure, shapes and dtypes of the original parameters; its leaves
      are views into one freshly gathered flat buffer per bucket.
    """
    if not isinstance(params, Shards):
        return params
    layout = params.layout
    if layout.world_size != mesh.size or params.rank != mesh.rank:
        raise ValueError(
            f"shards of rank {params.rank} of {layout.world_size} cannot be gathered on "
            f"rank {mesh.rank} of {mesh.size}"
        )
    return layout.unflatten(_AllGather.apply(mesh, *params.buffers))


def master_params(state: Any, mesh: Mesh) -> PyTree:
    """The full tree of what the optimizer trains, on every rank: the master copies under
    mixed precision (frozen leaves: the parameters as held), else the parameters.

    Use it to export or evaluate at full precision; `gather_params(state.params, mesh)`
    gives the compute-dtype parameters the loss sees.

    Args:
      state: a ShardedState.
      mesh: the mesh.

    Returns:
      A tree with the parameters' structure and shapes; trainable leaves in the master dtype.
    """
    params = gather_params(state.params, mesh)
    if state.master is None:
        return params
    lay = state.layout
    if isinstance(state.master, Shards):
        mlay = state.master.layout
        live = [i for i, b in enumerate(mlay.buckets) if not b.frozen]
        flats = [_comm.all_gather(state.master.buffers[i], mesh) for i in live]
        trainable: dict[int, Any] = {}
        for i, flat in zip(live, flats):
            for slot, view in cut(mlay.buckets[i], flat):
                trainable[slot.index] = view
        leaves = lay.leaves(params)
        merged = [trainable.get(j, leaf) for j, leaf in enumerate(leaves)]
        return tree_unflatten(lay.treedef, merged)
    return lay.merge(params, state.master)
