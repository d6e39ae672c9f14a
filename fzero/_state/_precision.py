"""Precision: the dtypes parameters are computed, gathered and reduced in, over fp32 masters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    PyTree,
    ShardLayout,
    Shards,
    Stage,
    cut,
    device_of,
    gathers_to_compute,
    leaf_paths,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from .._engine import gather_params


@dataclass(frozen=True)
class Precision:
    """Mixed precision (FSDP2's MixedPrecisionPolicy, FairScale's mixed_precision).

    Attributes:
      param_dtype: dtype the parameters are computed in and given to `loss_fn` (stages
        0-2: the replicated parameters; stage 3: the gathered units). None keeps the
        parameters' own dtype. When set, the optimizer updates master copies of this
        rank's shard (`master_dtype`). At stages 0-2 the parameters are held as the
        masters cast down, as in DeepSpeed and ZeRO's 16Ψ arithmetic; at stage 3 a
        trainable shard is its master, cast as it is gathered (FSDP2's layout: no
        second shard in this dtype). Frozen parameters are held in this dtype only (no
        masters: nothing updates them).
      reduce_dtype: dtype gradients are reduced (summed over ranks) in; the optimizer then
        sees them in the master dtype. None: the parameters' compute dtype.
      gather_dtype: dtype parameters travel in when they are all-gathered (after the
        update at stages 1-2, per unit at stage 3; FairScale's `broadcast_fp16`). None:
        the compute dtype. Lower than the compute dtype at stages 1-2, it also makes
        master copies necessary, since the gathered values are rounded.
      buffer_dtype: dtype the state's buffers (BatchNorm statistics) are kept in. None
        keeps theirs: statistics stay in fp32. torch's batch_norm then refuses a weight
        `param_dtype` casts to bfloat16 (it takes weight and statistics in one dtype):
        set this to `param_dtype`, or keep the norms' parameters in float32 (a bfloat16
        model with float32 norms and `master_dtype` alone); a step with `module=` names
        the norm and both remedies.
      master_dtype: dtype of the master copies. None: the promotion of the original
        parameter dtypes of each buffer (fp32 for fp32 models). Set alone (no
        `param_dtype`) over parameters of another dtype, a bfloat16 model say, the
        parameters stay in their dtype for compute and the optimizer updates masters
        in this one (DeepSpeed's bf16 with fp32 masters).
      output_dtype: given `sharded_step(module=)` (or `sharded_forward`'s, `bind`'s
        model), the module's floating-point outputs are cast to it: float32 logits for
        the loss, say. FSDP2's `output_dtype` is per `fully_shard` call, so that modules
        may differ; one state has one Precision, so it is the root's alone (cast at
        every unit, a unit's output would only be cast back by the next). None: left as
        computed.
      cast_forward_inputs: given `module=`, the floating-point tensors among the
        forward inputs of the module and of the submodules whose hooks enter units are
        cast to `param_dtype` (FSDP2's `cast_forward_inputs`, its default): a float32
        batch runs through a bfloat16 model. False: inputs reach the forward as they
        are. Without `module=` nothing is cast: the loss casts its inputs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    gather_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.cast_forward_inputs, bool):
            raise TypeError(
                f"Precision.cast_forward_inputs must be a bool, got {self.cast_forward_inputs!r}"
            )
        dtypes = ("param_dtype", "reduce_dtype", "gather_dtype", "buffer_dtype", "master_dtype")
        for name in (*dtypes, "output_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(
                    f"Precision.{name} must be a floating-point torch.dtype (e.g. "
                    f"torch.bfloat16), got {dtype!r}"
                )
            if dtype.itemsize < 2:
                raise TypeError(f"Precision.{name}: {dtype} is not supported (8-bit floats)")


def check_castable(
    params: PyTree,
    dtype: torch.dtype | None,
    rank: int,
    what: str,
    only: Sequence[bool] | None = None,
) -> None:
    """Raises ValueError naming the first leaf whose values overflow when cast to `dtype`;
    given `only` (per leaf, in flatten order), the leaves it marks alone."""
    if dtype is None:
        return
    top = torch.finfo(dtype).max
    leaves = tree_flatten(params)[0]
    for path, leaf, wanted in zip(leaf_paths(params), leaves, only or [True] * len(leaves)):
        if not wanted or leaf.dtype == dtype or leaf.numel() == 0:
            continue
        if leaf.dtype.itemsize < dtype.itemsize:
            continue
        finite = leaf.detach()[torch.isfinite(leaf.detach())]
        big = finite.abs().max().item() if finite.numel() else 0.0
        if big > top:
            raise ValueError(
                f"rank {rank}: params leaf {path!r} holds |x| = {big:.4g}, which overflows "
                f"{what} {dtype} (largest finite value {top:.4g}); rescale it, keep it out "
                f"of the low-precision dtype, or use torch.bfloat16"
            )


def cast_params(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """`tree` with every floating-point leaf in `dtype` (None: unchanged), detached;
    integer leaves (BatchNorm's batch counter) stay as they are."""
    leaves, treedef = tree_flatten(tree)
    if dtype is None:
        return tree
    return tree_unflatten(
        treedef, [x.detach().to(dtype) if x.is_floating_point() else x for x in leaves]
    )


def gathered_leaves(stage: Stage, frozen: Sequence[bool]) -> list[bool]:
    """Per leaf: does it travel in `gather_dtype`? Every leaf at stage 3 (gathered for each
    forward), the trainable ones at stages 1-2 (gathered after each update: nothing
    updates a frozen one), none at stage 0."""
    if stage.shards_params:
        return [True] * len(frozen)
    return [stage.regathers and not f for f in frozen]


def compute_params(
    params: PyTree, precision: Precision, stage: Stage, frozen: Sequence[bool] | None = None
) -> PyTree:
    """The parameters the loss sees at step 0: cast to `param_dtype`, and the trainable
    ones (`frozen`: per leaf, none if None) rounded through `gather_dtype` where a stage
    all-gathers them after every update (1-2), exactly as every later all-gather delivers
    them. Frozen leaves are never gathered there and keep their cast values bitwise."""
    cast = cast_params(params, precision.param_dtype)
    gather = precision.gather_dtype
    if gather is None or not stage.regathers:
        return cast
    leaves, treedef = tree_flatten(cast)
    frozen = frozen or [False] * len(leaves)
    # Rounded from the masters' values straight to `gather_dtype`, as a gather of the
    # masters rounds them (through `param_dtype` first would round twice). Integer leaves
    # (a batch counter) are never gathered in `gather_dtype`: left exact.
    return tree_unflatten(
        treedef,
        [
            gather_rounded(m.detach(), x.dtype, precision).to(x.dtype)
            if x.is_floating_point() and not f
            else x
            for m, x, f in zip(tree_flatten(params)[0], leaves, frozen)
        ],
    )


def needs_master(precision: Precision | None, layout: ShardLayout, stage: Stage) -> bool:
    """Whether the parameters the loss sees are rounded copies of what the optimizer keeps."""
    if precision is None:
        return False
    # master_dtype alone (bf16 parameters, fp32 masters): masters wherever it is not the
    # dtype a trainable bucket computes in, else it would be ignored without a word.
    other = precision.master_dtype is not None and any(
        b.dtype != precision.master_dtype for b in layout.buckets if not b.frozen
    )
    return (
        precision.param_dtype is not None
        or (precision.gather_dtype is not None and stage.regathers)
        or other
    )


def update_dtypes(state: Any) -> list[torch.dtype | None]:
    """Per bucket of `state.layout`, the dtype its optimizer updates it in: its masters'
    (a stage-0 tree of them, or shards); None without masters, and for frozen buckets.
    A mean over micro-batches is taken in it (`accumulate="local"`)."""
    lay, master = state.layout, state.master
    if master is None:
        return [None] * len(lay.buckets)
    if isinstance(master, Shards):
        return [None if b.frozen else t.dtype for b, t in zip(lay.buckets, master.buffers)]
    dtypes = dict(zip(leaf_paths(master), (m.dtype for m in tree_flatten(master)[0])))
    return [None if b.frozen else dtypes[b.ordered[0].path] for b in lay.buckets]


def gather_rounded(
    master: torch.Tensor, dtype: torch.dtype, precision: Precision | None
) -> torch.Tensor:
    """What a copy of `master` in `dtype` is taken from so that it holds what a gather
    of the master delivers: the master rounded to `gather_dtype` where the precision
    names one other than `dtype` (then cast to `dtype`, not rounded twice through it),
    else the master itself (no copy is made here)."""
    gather = None if precision is None else precision.gather_dtype
    if gather is not None and gather != dtype and master.dtype != gather:
        return master.to(gather)
    return master


def _sends(state: Any, mesh: Any = None) -> bool:
    """Whether `master_params` gathers: stage 3's parameters, or sharded masters."""
    stage = getattr(state, "stage", None)
    return gathers_to_compute(stage) or isinstance(getattr(state, "master", None), Shards)


@_comm.collective("master_params", sends=_sends)
def master_params(state: Any, mesh: Mesh) -> PyTree:
    """The full tree of what the optimizer trains, on every rank: the master copies under
    mixed precision (frozen leaves: the parameters as held), else the parameters.

    Use it to export or evaluate at full precision; `gather_params(state.params, mesh)`
    gives the parameters in the compute dtype: at stages 0-2 those the loss sees; at stage
    3 the masters cast to `param_dtype`, which the loss sees rounded through
    `gather_dtype` where one is set.

    Args:
      state: a ShardedState.
      mesh: the mesh.

    Returns:
      A tree with the parameters' structure and shapes; trainable leaves in the master
      dtype. Its own tensors, at every stage: a later step does not change them (where
      they would be the state's own, they are copies).
    """
    out = gathered_masters(state, mesh)
    own = {
        x.untyped_storage().data_ptr()
        for x in tree_flatten((state.params, state.master))[0]
        if isinstance(x, torch.Tensor)
    }
    return tree_map(lambda x: x.clone() if x.untyped_storage().data_ptr() in own else x, out)


def gathered_masters(state: Any, mesh: Mesh) -> PyTree:
    """`master_params`, where the state's own tensors are returned as they are (stages 0-2
    without masters; stage 0's masters): for a caller that copies them anyway."""
    params = gather_params(state.params, mesh)
    if state.master is None:
        return params
    lay = state.layout
    if isinstance(state.master, Shards):
        mlay = state.master.layout
        live = [i for i, b in enumerate(mlay.buckets) if not b.frozen]
        device = device_of(params)
        flats = []
        for i in live:  # offloaded masters are gathered from the device, like the rest
            flats.append(_comm.all_gather(state.master.buffers[i].to(device), mesh))
            if getattr(state, "offload", None) is not None:
                state.offload.release(i)  # a disk bucket's pages, read: dropped
        trainable: dict[int, Any] = {}
        for i, flat in zip(live, flats):
            for slot, view in cut(mlay.buckets[i], flat):
                trainable[slot.index] = view
        leaves = lay.leaves(params)
        merged = [trainable.get(j, leaf) for j, leaf in enumerate(leaves)]
        return tree_unflatten(lay.treedef, merged)
    return lay.merge(params, state.master)
