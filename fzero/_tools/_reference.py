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
    for micro_batches in batches:
        opt.zero_grad()
        tree = tree_unflatten(treedef, tensors)
        with _bound(module, dict(zip(leaf_paths(params), tensors))):
            loss = _backward(loss_fn, tree, micro_batches, trained, order)
        for x in trained:
            if x.grad is None:
                x.grad = torch.zeros_like(x)
        opt.step()
        losses.append(loss.item())
    return tree_unflatten(treedef, [x.detach() for x in tensors]), losses


def _backward(
    loss_fn: Callable[[PyTree, Any], torch.Tensor],
    tree: PyTree,
    micro_batches: Sequence[Any],
    trained: list[torch.Tensor],
    order: str,
) -> torch.Tensor:
    """One step's backward (`train_reference`'s `order`); its mean loss."""
    if order == "loss":
        loss = torch.stack([loss_fn(tree, b) for b in micro_batches]).mean()
        loss.backward()
    else:
        each = []
        for b in micro_batches:
            one = loss_fn(tree, b)
            one.backward()
            each.append(one.detach())
        loss = torch.stack(each).mean()
        for x in trained:
            if x.grad is not None:
                x.grad /= len(micro_batches)
    return loss


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
