"""The mean gradient of a step's loss over its micro-batches, reduced as the stage reduces it."""

from __future__ import annotations

from typing import Any

import torch

from .._core import LossFn, Shards, sparse_gradient, tree_flatten, tree_map, value_and_grad
from .._engine import Context, Engine, LocalSums, Trained, Watch, hooks_for
from .._state import ShardedState, params_apart, update_dtypes
from ._sync import StepSync


def mean_grad(
    loss_fn: LossFn,
    micro: list[Any],
    ctx: Context,
    state: ShardedState,
    target: Any,
    local: tuple[torch.Tensor, ...] | None,
    sync: StepSync,
    accumulate: str | None,
    order: list[str] | None,
    watch: Watch | None = None,
    used: set[int] | None = None,
) -> tuple[Any, list[str] | None]:
    """This rank's part of the mean gradient over every micro-batch and rank, shaped as
    what its optimizer updates.

    Args:
      loss_fn: the step's loss, `(params, batch) -> scalar`.
      micro: the micro-batches (None: this rank has none for that one).
      ctx: the engine's context (its schedule decides everything else).
      state: the state stepped.
      target: what this rank's optimizer updates (its shards, or the trainable tree).
      local: the replicated full buffers (stages 0-2).
      sync: the step's agreement among ranks (a call check per micro-batch).
      accumulate: the step's `accumulate=` option.
      order: the just-in-time units last step called (None: no step yet).
      watch: told `(bucket, its part of the mean gradient)` as soon as that is final,
        during the last micro-batch's backward (stages 1-3); the values returned for the
        bucket are the tensor it was told.
      used: if given, the leaves a gradient reached on this rank are added to it.

    Returns:
      `(grads, order)`: the trainable tree where the stage all-reduces, else this rank's
      `Shards`; and the just-in-time units this step called, in order.
    """
    s, lay = ctx.schedule, ctx.layout
    if s.by_leaf:
        hooks = None
        if ctx.grad_hooks:  # what each leaf's hooks run as, in the leaf's dtype
            leaves = tree_flatten(state.params)[0]
            hooks = [hooks_for(ctx.grad_hooks.get(p), x.dtype) for p, x in zip(lay.paths, leaves)]
        grads = _by_leaf(loss_fn, micro, state, s.reduce_dtype, accumulate, used, hooks, ctx.own)
        sync.check(len(micro) - 1).after_forward(None)  # the losses' weights travel alone
        return grads, order
    if s.all_reduce:  # every rank keeps the full mean gradient
        assert local is not None
        like = local
    else:  # a rank keeps its shard of it, shaped as what it updates
        like = state.params.buffers if s.gathers else target.buffers
    # Local accumulation's earlier micro-batches leave zeros shaped as `like`, to which
    # the last one's reduced gradient is added: a stage-3 shard is its master (float32),
    # so the mean is taken there, but an offloaded shard's device copy is in the compute
    # dtype, as are stage 0's full buckets. Where `like` is narrower than what the
    # optimizer updates, the mean is taken in the latter, alike at every stage.
    wide = None
    if accumulate == "local" and not s.all_reduce:
        wide = [t.dtype if t.dtype != x.dtype else None for t, x in zip(target.buffers, like)]
    elif accumulate == "local":  # stage 0: the full buckets, and a tree of masters
        wide = [d if d != x.dtype else None for d, x in zip(update_dtypes(state), like)]
    # Local accumulation (DDP's no_sync) sums full gradients here across micro-batches.
    sums: LocalSums | None = {} if accumulate == "local" else None
    total: tuple[torch.Tensor, ...] | None = None
    n = len(micro)
    told: dict[int, torch.Tensor] = {}  # bucket -> its final mean, told to `watch`

    def mean(i: int, g: torch.Tensor) -> torch.Tensor:
        """Bucket i's mean over the micro-batches, `g` the last one's gradient."""
        g = g if total is None else total[i] + g
        if n > 1 and wide is not None and wide[i] is not None:
            g = g.to(wide[i])
        return g / n if n > 1 else g

    def tell(i: int, g: torch.Tensor) -> None:
        assert watch is not None
        told[i] = mean(i, g)
        watch(i, told[i])

    for j, mb in enumerate(micro):
        last = j == n - 1
        check = sync.check(j)
        engine = Engine(
            ctx,
            like,
            check,
            local=local,
            order=order,
            sums=sums,
            final=last,
            watch=tell if watch is not None and not s.all_reduce else None,
            device=params_apart(state),
        )
        if used is not None:
            engine.used = used  # the leaves a gradient reaches, added as it does
        _, grads, order = engine.value_and_grad(loss_fn, mb)
        # Every exchange a micro-batch started ends in it: a disagreement raises on every
        # rank together, before any rank goes on to the next micro-batch.
        check.finish()
        if last:
            total = tuple(told[i] if i in told else mean(i, g) for i, g in enumerate(grads))
        else:
            total = grads if total is None else tuple(t + g for t, g in zip(total, grads))
    assert total is not None
    if s.all_reduce:
        assert local is not None
        full = [f if b.frozen else g for f, g, b in zip(local, total, lay.buckets)]
        return lay.trainable(lay.unflatten(full)), order
    return Shards(total, lay, ctx.mesh.shard_rank), order


def _by_leaf(
    loss_fn: LossFn,
    micro: list[Any],
    state: ShardedState,
    reduce_dtype: torch.dtype | None,
    accumulate: str | None,
    used: set[int] | None = None,
    hooks: list[tuple[Any, ...]] | None = None,
    own: Trained = (),
) -> Any:
    """Stage 0 on one rank (`Schedule.by_leaf`): gradients by leaf, the mean over every
    micro-batch; `hooks`, per leaf, gradient hooks run on it; `own`, `module=`'s
    parameters, which no gradient may reach (`grads_of`).

    With nothing to communicate there is nothing to gather or reduce unit by unit, so the
    gradient is taken with respect to the leaves themselves, as an eager loop's `.grad`:
    no per-unit nodes and no flat gradient buffers (assembling them copies every gradient
    once more). The values are those of the unit path on one rank, bitwise: gradients
    pass through the reduce dtype as they would through a reduction ("local"
    accumulation sums them first, in the reduce dtype where it is wider, and takes the
    mean in the masters' dtype; "sharded" after), and a mean over micro-batches.
    """
    lay = state.layout
    trainable = lay.trainable(state.params)

    def rounded(g: Any) -> Any:
        return tree_map(lambda x: x.to(reduce_dtype or x.dtype), g)

    def widened(g: Any) -> Any:  # "local" sums in the reduce dtype where it is wider
        wide = reduce_dtype
        return tree_map(lambda x: x.to(wide) if wide and wide.itemsize > x.itemsize else x, g)

    total = None
    for mb in micro:
        grads = None
        if mb is not None:
            _, grads = value_and_grad(
                loss_fn, state.params, mb, rank=0, frozen=lay.frozen, used=used, hooks=hooks,
                own=own,
            )  # fmt: skip
            # Refused here too, though one rank could apply them: as on any other mesh.
            for path, g in zip(lay.paths, tree_flatten(grads)[0] if grads is not None else []):
                if g is not None and g.layout != torch.strided:
                    raise sparse_gradient(0, path)
        grads = tree_map(torch.zeros_like, trainable) if grads is None else lay.trainable(grads)
        grads = rounded(grads) if accumulate != "local" else widened(grads)
        total = grads if total is None else tree_map(torch.add, total, grads)
    if accumulate == "local":
        total = rounded(total)
        if state.master is not None and len(micro) > 1:  # the mean in the masters' dtype
            total = tree_map(lambda t, m: t.to(m.dtype), total, state.master)
    if len(micro) > 1:
        total = tree_map(lambda t: t / len(micro), total)
    return _distinct(total)


def _distinct(grads: Any) -> Any:
    """`grads` with no two leaves sharing memory and none overlapping itself.

    Autograd may hand one tensor to several leaves (`(a + b).pow(2).sum()`) or an expanded
    one (`a.sum()`'s gradient has stride 0), and where no cast, sum or mean copied them,
    the update's in-place scaling (loss weights, unscaling, clipping) would scale a
    shared gradient once per leaf, or refuse an overlapping one. Such leaves are copied."""
    seen: set[int] = set()

    def own(g: torch.Tensor) -> torch.Tensor:
        ptr = g.untyped_storage().data_ptr()
        if g.numel() and (ptr in seen or torch._debug_has_internal_overlap(g) != 0):
            g = g.clone(memory_format=torch.contiguous_format)
            ptr = g.untyped_storage().data_ptr()
        seen.add(ptr)
        return g

    return tree_map(own, grads)
