"""The reference: plain torch.optim on one process over each step's micro-batches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._core import PyTree, leaf_paths, tree_flatten, tree_unflatten
from ..optim._groups import claim, group_of


def train_reference(
    loss_fn: Callable[[PyTree, Any], torch.Tensor],
    params: PyTree,
    batches: Sequence[Sequence[Any]],
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    groups: Sequence[Mapping[str, Any]] | None = None,
    order: str = "loss",
    module: nn.Module | None = None,
) -> tuple[PyTree, list[float]]:
    """Plain torch.optim on one process, the mean of the micro-batch losses per step.

    `order` "loss" differentiates the mean loss (autograd sums the micro-batches' terms
    inside the graph); "ranks" runs one backward per micro-batch, which sums their
    gradients into `.grad` in rank order, then divides by their number, as ranks reduce.
    With `module`, its parameters and buffers at the tree's paths are the reference's
    tensors through each step's forward and backward (`_bound`), and its parameters'
    gradient hooks run on them, as on the parameters of a module trained itself.
    """
    leaves, treedef = tree_flatten(params)
    some_frozen = any(x.requires_grad for x in leaves) and not all(x.requires_grad for x in leaves)
    trainable = [x.requires_grad or not some_frozen for x in leaves]
    tensors = [x.detach().clone().requires_grad_(t) for x, t in zip(leaves, trainable)]
    trained = [x for x, t in zip(tensors, trainable) if t]
    own = {} if module is None else dict(module.named_parameters(remove_duplicate=False))
    for path, x in zip(leaf_paths(params), tensors):
        for hook in (own[path]._backward_hooks or {}).values() if path in own else ():
            if x.requires_grad:
                x.register_hook(hook)
    if groups is None:
        opt = cls(trained, **kwargs)
    else:
        paths = [p for p, t in zip(leaf_paths(params), trainable) if t]
        opt = cls(_torch_groups(paths, trained, groups), **kwargs)
    losses = []
    # The model is the user's: the reference's forwards must leave its buffers (BatchNorm's
    # running statistics) as they were; the ranks' run in their own processes.
    kept = [] if module is None else [(b, b.detach().clone()) for b in module.buffers()]
    try:
        for micro_batches in batches:
            opt.zero_grad()
            tree = tree_unflatten(treedef, tensors)
            with _bound(module, dict(zip(leaf_paths(params), tensors))):
                loss = _backward(loss_fn, tree, micro_batches, trained, order, module)
            for x in trained:
                if x.grad is None:
                    x.grad = torch.zeros_like(x)
            opt.step()
            losses.append(loss.item())
    finally:
        with torch.no_grad():
            for b, was in kept:
                b.copy_(was)
    return tree_unflatten(treedef, [x.detach() for x in tensors]), losses


def _backward(
    loss_fn: Callable[[PyTree, Any], Any],
    tree: PyTree,
    micro_batches: Sequence[Any],
    trained: list[torch.Tensor],
    order: str,
    module: nn.Module | None = None,
) -> torch.Tensor:
    """One step's backward (`train_reference`'s `order`); its loss: the mean of the
    micro-batches' losses, or of `(total, weight)` pairs Σ total / Σ weight (the weights
    counts, not differentiated), as `sharded_step` reduces them."""
    outs = [loss_fn(tree, b) for b in micro_batches] if order == "loss" else []
    if order == "loss":
        for out in outs:
            _no_strays(out, trained, module)
        totals, weights = _terms(outs)
        summed = torch.stack(totals)
        loss = summed.mean() if weights is None else summed.sum() / weights
        loss.backward()
        return loss.detach()
    each = []
    for b in micro_batches:  # "ranks": one backward a micro-batch, summed in rank order
        out = loss_fn(tree, b)
        _no_strays(out, trained, module)
        (total,), weight = _terms([out])
        total.backward()
        each.append((total.detach(), weight))
    paired = each[0][1] is not None
    weights = sum(w for _, w in each) if paired else len(each)
    for x in trained:
        if x.grad is not None:
            x.grad /= weights
    totals = torch.stack([t for t, _ in each])
    return totals.sum() / weights if paired else totals.mean()


def _terms(outs: list[Any]) -> tuple[list[torch.Tensor], float | None]:
    """The micro-batches' loss terms and the weight they are divided by: None for scalars
    (their mean); the weights' sum for `(total, weight)` pairs."""
    pairs = [isinstance(o, (tuple, list)) and len(o) == 2 for o in outs]
    if any(pairs) and not all(pairs):
        raise ValueError(
            "fzero.testing: loss_fn returned a scalar for some micro-batches and a "
            "(total, weight) pair for others"
        )
    if not any(pairs):
        return list(outs), None
    weights = [float(w.detach() if isinstance(w, torch.Tensor) else w) for _, w in outs]
    return [t for t, _ in outs], sum(weights)


def _no_strays(out: Any, trained: list[torch.Tensor], module: nn.Module | None) -> None:
    """Raises naming an `nn.Parameter` that requires grad which the loss read but was not
    given in its tree (read off the model itself): the ranks would drop its gradient
    alike, and the check would pass where training the model itself differs."""
    roots = list(out) if isinstance(out, (tuple, list)) else [out]
    ours = {id(x) for x in trained}
    names = {} if module is None else {id(p): n for n, p in module.named_parameters()}
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor)]
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        # A parameter (an input made to require grad, a gradient penalty's, is the loss's)
        if isinstance(leaf, nn.Parameter) and id(leaf) not in ours:
            what = names.get(id(leaf), f"a {tuple(leaf.shape)} {leaf.dtype} parameter")
            raise ValueError(
                f"fzero.testing: the loss reads {what!s} (it requires grad) from outside the "
                "params tree it is given: fzero trains only the tree's leaves, and its "
                "gradient would be dropped on every stage alike. Read every parameter from "
                "the tree (torch.func.functional_call(model, params, ...))"
            )
        stack.extend(f for f, _ in fn.next_functions)


@contextlib.contextmanager
def _bound(module: nn.Module | None, by_path: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, `module`'s parameters and buffers named in `by_path` (and every
    name tied to one of them) are bound to its tensors, as `functional_call` binds them.

    A loss that calls `functional_call(module, tree, ...)` binds the same tensors and puts
    them back, so what reads the module after it (non-reentrant `torch.utils.checkpoint`
    recomputing inside the backward) reads the reference's own parameters, as a plain
    torch loop training the module itself would.
    """
    if module is None:
        yield
        return
    own = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    new = {id(own[p]): t for p, t in by_path.items() if p in own}
    old = []
    for sub in module.modules():
        for slot in (sub._parameters, sub._buffers):
            for k, v in slot.items():
                if v is not None and id(v) in new:
                    old.append((slot, k, v))
                    slot[k] = new[id(v)]
    try:
        yield
    finally:
        for slot, k, v in old:
            slot[k] = v


def _torch_groups(
    paths: list[str], tensors: list[torch.Tensor], groups: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """torch's param groups over `tensors` (at `paths`): each to the first group that
    claims its path, as `fzero.optim.param_groups` assigns them."""
    claims = [claim(g.get("params"), k) for k, g in enumerate(groups)]
    members: list[list[torch.Tensor]] = [[] for _ in groups]
    for path, t in zip(paths, tensors):
        members[group_of(path, claims, "groups")].append(t)
    return [
        {**{n: v for n, v in g.items() if n != "params"}, "params": m}
        for g, m in zip(groups, members)
        if m
    ]
