"""Param groups: torch.optim's per-group hyper-parameters (a learning rate for the head,
layer-wise decay of the rate) as one optimizer over one state."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optree
import torch

from .._core import leaf_paths
from ._base import Grads, Optimizer, OptState, Params, from_inplace
from ._context import ShardContext, current, shard_context
from ._torch_groups import Part, check_dict_entries, dicts_cut, dicts_merge, keeps_dicts

Claim = Callable[[str], bool]


def param_groups(
    make: Callable[..., Optimizer], groups: Sequence[Mapping[str, Any]], **defaults: Any
) -> Optimizer:
    """torch.optim's param groups: each parameter stepped by its group's optimizer,
    `make(**{**defaults, **group})`, as `torch.optim.AdamW([{"params": head, "lr": 1e-3},
    {"params": body}], lr=1e-5)` steps each group with its own values.

    The state is `make(**defaults)`'s over every parameter (one `AdamState`: the same
    checkpoints, resharding and offload as without groups). Each update cuts the
    parameters, gradients and the state's per-parameter tensors into each group's part
    (views: on a flat shard, the runs of elements of one group's parameters) and runs
    that group's optimizer on them in place, with the same ops and scalars as torch's
    for that group, so the result is bitwise `make`'s on each part. Groups whose
    parameters alternate inside a unit (a weight, a bias, a weight, ...) cut its shard
    into many runs, an op per run: weight decay on and off belongs in `mask=`, whose small
    runs of one flag join the other pieces' in one list op (`_base.by_flag`).

    torch's own optimizers run the same way, `make=functools.partial(from_torch,
    torch.optim.RMSprop)`, with torch's state (a dict per parameter): a run gets its
    slice of each tensor shaped like its piece and a copy of the rest (the step count).
    Groups that cannot share one dict per flat piece (momentum in one group only, a
    per-parameter scalar that the groups' arguments move apart, as NAdam's `mu_product`
    under another `momentum_decay`), and whole-tensor optimizers (Adafactor), need
    `layout="tensor"` at stages 1-3, whose pieces are whole tensors; `shard_state`
    refuses the flat layout naming why. A group's own arguments reach its torch
    optimizer's constructor, so Adagrad's `initial_accumulator_value` is the group's
    (torch's own groups ignore it there and use the default's).

    Args:
      make: an optimizer factory whose update is elementwise (`fzero.optim.adam`, `adamw`,
        `sgd`, or `from_torch` of a torch class; with `layout="tensor"`, any `from_torch`).
      groups: each a dict whose `"params"` says which parameters it holds (a predicate on
        parameter paths, or a list of paths) and whose other keys are `make`'s arguments
        that differ from `defaults` (`lr` (a schedule too), `weight_decay`, `betas`,
        `eps`, `mask`, ...). A parameter belongs to the first group that claims it;
        every parameter the optimizer updates must be claimed by one.
      **defaults: `make`'s arguments shared by the groups.

    Returns:
      An Optimizer over the whole parameter tree (or a rank's shard of it).

    Raises:
      ValueError: a group without "params", an argument `make` does not take, a path
        listed by two groups (at a step function's first step: a listed path that is
        no parameter of the state, on every rank), groups
        of fzero's optimizers whose states differ in structure (AMSGrad in one group
        only, SGD momentum in one); at update time, a parameter no group claims, or
        torch's groups leaving a shared entry of one flat piece apart (ASGD's `mu` once
        a group passes its own `t0`). `shard_state` refuses the flat layout for groups
        seen to need whole tensors when made.
    """
    signature = inspect.signature(make).parameters
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    known = set(signature) if not anything else None
    claims: list[Claim] = []
    made: list[Optimizer] = []
    listed: dict[str, int] = {}  # a path a group lists by name -> that group
    for k, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ValueError(f"param_groups: group {k} must be a dict with 'params'")
        unknown = [] if known is None else sorted(set(group) - {"params"} - known)
        if unknown:
            name = getattr(make, "__name__", "make")
            raise ValueError(f"param_groups: group {k} sets {unknown}, which {name} lacks")
        claims.append(claim(group["params"], k))
        for path in () if callable(group["params"]) else group["params"]:
            if path in listed:  # torch refuses a parameter in two groups
                raise ValueError(
                    f"param_groups: {path!r} is listed in group {listed[path]} and group {k}"
                )
            listed[path] = k
        made.append(make(**{**defaults, **{n: v for n, v in group.items() if n != "params"}}))
    if not made:
        raise ValueError("param_groups: no groups")
    whole = make(**defaults)
    name = getattr(make, "__name__", "make")
    # torch's own state (`from_torch`): a dict per parameter, made on its first update.
    dicts = keeps_dicts(whole)
    per_leaf = [] if dicts else _check_structures(whole, made, name)
    whole_tensors = (check_dict_entries(made) if dicts else None) or whole.whole_tensors
    known: dict[str, int] = {}  # path -> group
    if any(opt.update_ is None for opt in made) or (
        not dicts and any(opt.whole_tensors for opt in made)
    ):
        raise ValueError(
            f"param_groups: {name} must update elementwise and in place "
            "(fzero.optim.adam, adamw, sgd, from_torch)"
        )

    @torch.no_grad()
    def update_(grads: Grads, state: OptState, params: Params) -> tuple[Params, OptState]:
        ctx = current()
        parts = _parts(params, ctx, claims, known)
        p_leaves, g_leaves = optree.tree_leaves(params), optree.tree_leaves(grads)
        paths = leaf_paths(params) if ctx is None or ctx.segments is None else None
        new_globals = None
        # A group with nothing here is skipped; with nothing at all (a unit of empty
        # pieces on this rank) the first group still runs, to move the step count.
        ran = [k for k in range(len(made)) if parts[k]] or [0]
        if dicts:  # cut before any group writes back its step count
            own = optree.tree_structure(params).flatten_up_to(state)
            cuts = {k: dicts_cut(own, p_leaves, parts[k]) for k in ran}
            shared: dict[tuple[int, str], tuple[int, Any]] = {}  # a piece's scalars, by group
        for k in ran:
            opt = made[k]

            def arranged(values: list[Any], part: list[Part] = parts[k]) -> Any:
                if paths is None:
                    return values  # pieces: their order is the segments'
                return {paths[i]: v for (i, _, _, _), v in zip(part, values)}  # masks see paths

            def cut(leaves: list[Any], part: list[Part] = parts[k]) -> Any:
                return arranged([leaves[i][lo:hi] if sl else leaves[i] for i, lo, hi, sl in part])

            sub_p, sub_g = cut(p_leaves), cut(g_leaves)
            if dicts:
                left = opt.update_(sub_g, arranged(cuts[k]), sub_p)[1]
                # Back in the parts' order: a dict by path flattens in sorted key order.
                left = list(left) if paths is None else [left[paths[i]] for i, *_ in parts[k]]
                dicts_merge(own, p_leaves, parts[k], left, k, shared)
                continue
            sub_state, globals_ = _sub_state(state, per_leaf, cut)
            nested = _nested(ctx, parts[k])
            with shard_context(nested) if nested is not None else _no_context():
                opt.update_(sub_g, sub_state, sub_p)
            new_globals = new_globals or globals_
        if new_globals is not None:  # the step count: once, as each group's moved it
            for old, new in new_globals:
                old.copy_(new)
        return params, state

    # Paths a group lists by name: `listed_paths` (checked against the state's leaves).
    update_.fzero_listed = dict(listed)  # type: ignore[attr-defined]

    # A whole-tensor optimizer (from_torch(Adafactor)), or groups whose torch state parts
    # (`check_dict_entries`), run on the tensor layout, whose pieces are whole tensors:
    # `check_slices` refuses the flat one, as without groups.
    return Optimizer(whole.init, from_inplace(update_), update_, whole_tensors, whole.fused)


def unlisted(optimizer: Optimizer, paths: Sequence[str]) -> str:
    """The first path a param group of `optimizer` lists by name that is none of `paths`,
    the state's leaves (a typo: in torch a group holds the tensors themselves), said as
    an error's text; "" if there is none."""
    listed = getattr(optimizer.update_, "fzero_listed", {})
    known = set(paths)
    wrong = [(p, k) for p, k in listed.items() if p not in known]
    if not wrong:
        return ""
    return (
        f"param_groups: group {wrong[0][1]} lists {wrong[0][0]!r}, which is no parameter of "
        f"the state ({len(wrong)} such paths; the state's paths are like {sorted(known)[:3]})"
    )


def claim(spec: Any, k: int) -> Claim:
    """Group `k`'s `"params"` as a predicate on parameter paths."""
    if callable(spec):
        return spec
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        raise ValueError(
            f"param_groups: group {k}'s 'params' must be a predicate on parameter paths or "
            f"a list of paths, got {type(spec).__name__}"
        )
    names = frozenset(spec)
    return names.__contains__


def _check_structures(whole: Optimizer, made: list[Optimizer], name: str) -> list[bool]:
    """`whole`'s state is per-parameter tensors beside global ones, and every group's has
    its structure (tried on a dict of one small tensor, so that no global can pass for a
    parameter's, as a bare tensor's step count would); per field, whether it mirrors the
    parameters."""
    probe = {"p": torch.zeros(2, device="meta")}  # structure only: no memory
    state = whole.init(probe)
    fields = state if isinstance(state, tuple) else (state,)
    per_leaf = _per_leaf_fields(state, probe)
    if not all(
        mirrors or f is None or isinstance(f, torch.Tensor) for f, mirrors in zip(fields, per_leaf)
    ):
        raise ValueError(
            f"param_groups: {name}'s state is not per-parameter tensors beside global ones "
            "(fzero.optim.adam, adamw, sgd) nor a dict per parameter (from_torch)"
        )
    want = optree.tree_structure(state, none_is_leaf=True)
    for k, opt in enumerate(made):
        if optree.tree_structure(opt.init(probe), none_is_leaf=True) != want:
            raise ValueError(
                f"param_groups: group {k}'s optimizer keeps a state of another structure than "
                f"the defaults' (AMSGrad or momentum in some groups only): set it in defaults"
            )
    return per_leaf


def group_of(path: str, claims: list[Claim], where: str = "param_groups") -> int:
    """The first group whose claim takes `path` (torch.optim lists each parameter once)."""
    for k, take in enumerate(claims):
        if take(path):
            return k
    raise ValueError(f"{where}: no group claims parameter {path!r}")


def _parts(
    params: Params, ctx: ShardContext | None, claims: list[Claim], known: dict[str, int]
) -> list[list[Part]]:
    """Per group, the parts of the leaves it updates: whole leaves of a tree, or runs of
    one group's elements within each flat piece (its `segments`). `known`: the groups of
    paths seen before (the claims run once per path, not once per step)."""
    out: list[list[Part]] = [[] for _ in claims]
    leaves = optree.tree_leaves(params)

    def which(path: str) -> int:
        if path not in known:
            known[path] = group_of(path, claims)
        return known[path]

    if ctx is None or ctx.segments is None:
        for i, path in enumerate(leaf_paths(params)):
            out[which(path)].append((i, 0, leaves[i].numel(), False))
        return out
    for i, (piece, segments) in enumerate(zip(leaves, ctx.segments, strict=True)):
        runs: list[list[int]] = []  # [group, lo, hi]
        for path, lo, hi in segments:
            k = which(path)
            if runs and runs[-1][0] == k and runs[-1][2] == lo:
                runs[-1][2] = hi
            else:
                runs.append([k, lo, hi])
        if len(runs) == 1 and runs[0][1] == 0 and runs[0][2] == piece.numel():
            out[runs[0][0]].append((i, 0, piece.numel(), False))  # the whole piece
            continue
        for k, lo, hi in runs:
            out[k].append((i, lo, hi, True))
    return out


def _per_leaf_fields(state: OptState, params: Params) -> list[bool]:
    """Per node of the state's top level: whether it mirrors the parameters (a tensor per
    leaf, as Adam's moments) rather than holding globals (the step count)."""
    fields = state if isinstance(state, tuple) else (state,)
    shape = optree.tree_structure(params)
    out = []
    for f in fields:
        try:
            mirrors = optree.tree_structure(f) == shape
        except Exception:
            mirrors = False
        out.append(mirrors)
    return out


def _sub_state(
    state: OptState, per_leaf: list[bool], cut: Callable[[list[Any]], Any]
) -> tuple[OptState, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A group's state: the per-parameter tensors cut to its parts (views, written in
    place), the globals copied (each group moves its own copy of the step count)."""
    fields = state if isinstance(state, tuple) else (state,)
    new, globals_ = [], []
    for f, mirrors in zip(fields, per_leaf):
        if mirrors:
            new.append(cut(optree.tree_leaves(f)))
        elif isinstance(f, torch.Tensor):
            copy = f.clone()
            globals_.append((f, copy))
            new.append(copy)
        else:
            new.append(f)  # None (no AMSGrad maximum, no momentum)
    if not isinstance(state, tuple):
        return new[0], globals_
    return (type(state)(*new) if hasattr(state, "_fields") else tuple(new)), globals_


def _nested(ctx: ShardContext | None, parts: list[Part]) -> ShardContext | None:
    """The context a group's update runs in: the same mesh, its parts as the pieces and
    their segments (for path masks) cut to them."""
    if ctx is None:
        return None
    if ctx.segments is None:
        return ctx
    segs = []
    for i, lo, hi, _ in parts:
        segs.append(
            tuple((path, a - lo, b - lo) for path, a, b in ctx.segments[i] if a >= lo and b <= hi)
        )
    return dataclasses.replace(ctx, segments=tuple(segs))


class _no_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
