"""Mixed states: full-precision values made a mixed state's parameters and masters, as
`shard_state(init=)`, a load and the imports build them, and the layouts they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .._core import (
    PyTree,
    ShardLayout,
    Shards,
    Stage,
    build_layout,
    tree_flatten,
    tree_unflatten,
)
from ._precision import Precision, compute_params, needs_master


def master_layout(
    layout: ShardLayout, original: PyTree, master_dtype: torch.dtype | None
) -> tuple[ShardLayout, PyTree]:
    """The layout of the master copies and the original leaves in their dtypes.

    Same buckets, slots and padding as `layout` (built on the compute dtype), with each
    bucket's dtype the master dtype, so a master shard and a parameter shard line up
    element for element.
    """
    leaves = tree_flatten(original)[0]
    per_leaf: list[Any] = list(layout.dtypes)
    for b in layout.buckets:
        dtype = master_dtype
        if dtype is None:
            dtype = b.dtype
            for s in b.slots:
                dtype = torch.promote_types(dtype, leaves[s.index].dtype)
        for s in b.slots:
            per_leaf[s.index] = dtype
    cast = tree_unflatten(layout.treedef, [x.detach().to(d) for x, d in zip(leaves, per_leaf)])
    return retyped(layout, per_leaf), cast


def retyped(layout: ShardLayout, dtypes: Sequence[torch.dtype]) -> ShardLayout:
    """`layout`'s buckets, slots and padding with each leaf in `dtypes` (per leaf, alike
    within a bucket): what copies of its leaves in other dtypes line up with, element for
    element. A mixed state's masters, and its checkpoints, keep the buckets its compute
    dtypes made: a unit whose bf16 and fp32 leaves share one master dtype still holds
    two."""
    assert len(dtypes) == len(layout.dtypes), (len(dtypes), len(layout.dtypes))
    for b in layout.buckets:
        assert len({dtypes[s.index] for s in b.slots}) == 1, [s.path for s in b.slots]
    buckets = tuple(replace(b, dtype=dtypes[b.slots[0].index]) for b in layout.buckets)
    return replace(layout, buckets=buckets, dtypes=tuple(dtypes))


def held_shards(buffers: tuple[torch.Tensor, ...], master: Shards, layout: ShardLayout) -> Shards:
    """Stage 3's parameters under mixed precision: each trainable bucket's shard is its
    master itself, held once at full precision and cast to the layout's (compute) dtype
    as it is gathered (FSDP2's cast at the all-gather): no second, compute-dtype copy.
    Frozen buckets have no master: theirs from `buffers`, in the compute dtype."""
    bufs = tuple(x if b.frozen else m for x, m, b in zip(buffers, master.buffers, layout.buckets))
    return Shards(bufs, layout, master.rank)


def meta_like(layout: ShardLayout) -> PyTree:
    """Meta tensors of the layout's leaves: their shapes and dtypes, no values."""
    leaves = [torch.empty(s, dtype=d, device="meta") for s, d in zip(layout.shapes, layout.dtypes)]
    return tree_unflatten(layout.treedef, leaves)


def to_mixed(
    params: PyTree,
    layout: ShardLayout,
    stage: Stage,
    precision: Precision,
    rank: int,
    compute: Sequence[torch.dtype] | None = None,
) -> tuple[PyTree, ShardLayout, PyTree]:
    """Full-precision parameters as `shard_state(..., precision=)` holds them.

    Args:
      params: what a rank holds at full precision under `layout`: the tree (stages 0-2)
        or its `Shards` (stage 3), e.g. loaded from a checkpoint or materialized by an init.
      layout, stage, precision, rank: theirs.
      compute: per leaf, the dtype the parameters compute in where `precision` names
        no `param_dtype` (a bfloat16 model saved with float32 masters: `params_like`'s
        dtypes); None: the loaded ones.

    Returns:
      `(params, layout, master)`: the parameters cast to the compute dtype and their
      layout, and the full-precision values kept as masters (None if none are needed).
    """
    full_like = meta_like(layout) if stage.shards_params else params
    cast, lay = _computed(full_like, layout, stage, precision, compute)
    if not needs_master(precision, lay, stage):
        return params, layout, None
    mlay, full32 = master_layout(lay, full_like, precision.master_dtype)
    if stage.shards_params:
        master: PyTree = Shards(
            tuple(
                x.new_empty(0) if b.frozen else x.to(m.dtype)
                for x, b, m in zip(params.buffers, lay.buckets, mlay.buckets, strict=True)
            ),
            mlay,
            rank,
        )
        frozen = tuple(
            x.to(b.dtype) if b.frozen else x.new_empty(0)  # the others: their masters
            for x, b in zip(params.buffers, lay.buckets, strict=True)
        )
        return held_shards(frozen, master, lay), lay, master
    trainable = mlay.trainable(mlay.unflatten(mlay.flatten(full32)))
    if stage.shards_optimizer:
        trainable = Shards(mlay.shard(trainable, rank), mlay, rank)
    return lay.unflatten(lay.flatten(cast)), lay, trainable


def full_precision_layout(
    layout: ShardLayout,
    stage: Stage,
    precision: Precision,
    compute: Sequence[torch.dtype] | None = None,
) -> ShardLayout:
    """The full-precision layout a load fills for `to_mixed` (same arguments): the
    buckets the mixed state holds, each in its masters' dtype, so that the loaded
    optimizer state and the masters line up with the parameters' buckets; without
    masters, the parameters' own layout (the values cast as torch's `load_state_dict`
    casts them to the model's dtypes)."""
    _, lay = _computed(meta_like(layout), layout, stage, precision, compute)
    if not needs_master(precision, lay, stage):
        return lay
    return master_layout(lay, meta_like(layout), precision.master_dtype)[0]


def _computed(
    full: PyTree,
    layout: ShardLayout,
    stage: Stage,
    precision: Precision,
    compute: Sequence[torch.dtype] | None,
) -> tuple[PyTree, ShardLayout]:
    """`to_mixed`'s parameters as the loss sees them, and their layout."""
    # From the full values: a gather dtype rounds the masters straight, as every later
    # gather does (through the compute dtype first would round twice).
    cast = compute_params(full, precision, stage, layout.frozen)
    if compute is not None and precision.param_dtype is None:
        leaves, treedef = tree_flatten(cast)
        cast = tree_unflatten(
            treedef, [x.to(d) if x.is_floating_point() else x for x, d in zip(leaves, compute)]
        )
    lay = build_layout(cast, layout.world_size, layout.kind, layout.specs, list(layout.frozen))
    return cast, lay
