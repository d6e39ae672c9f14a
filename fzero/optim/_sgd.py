"""Stochastic gradient descent, bitwise-equal to ``torch.optim.SGD(foreach=False)`` (on the
CPU, where it is tested): large leaves op by op, small ones a group at a time; fused
(`_fused`), large leaves one compiled kernel each, small ones (a tree's leaves, a shard's
pieces) a group a call of torch's own fused list kernel."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._base import (
    Grads,
    Optimizer,
    Params,
    ScalarOrSchedule,
    by_flag,
    decay_flags,
    flatten_as,
    from_inplace,
    grouped,
    mul_each_,
    resolve_lr,
    validate_lr,
    validate_non_negative,
    zero_count,
    zeros_like_tree,
)
from ._fused import backend_for, bumped, listed, make_sgd, run, split


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
      count: 0-d int64 tensor, number of updates applied so far.
      momentum: momentum buffers mirroring the params pytree, or ``None`` when
        ``momentum == 0`` (torch keeps no buffer then either).
    """

    count: torch.Tensor
    momentum: Params | None


def sgd(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    mask: Any = None,
    fused: bool | None = None,
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``.

    Args:
      lr: learning rate, or a schedule ``lr(count) -> float`` called with the
        0-based index of the update being computed (0 for the first update).
      momentum: momentum factor.
      dampening: dampening applied to the gradient when accumulating momentum
        (not applied on the first update, where the buffer is the gradient itself).
      weight_decay: L2 penalty added to the gradient.
      nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
      maximize: maximize the objective instead of minimizing it.
      mask: where weight decay applies (a predicate on parameter paths or a pytree of
        bools like the parameters); None decays everything.
      fused: each large leaf's (a flat shard's) update as one compiled kernel
        (`torch.compile`), the small fp32 and fp64 leaves or pieces a group at a time
        through torch's `_fused_sgd_` (contiguous, on the CPU or a GPU; others keep the
        list ops), agreeing with the unfused ops to a few ulps
        rather than bitwise. None: fused inside a compiled step (`sharded_step(compile=...)`, with
        its backend), unfused otherwise.

    Returns:
      An :class:`Optimizer` whose state is an :class:`SgdState`.

    Raises:
      ValueError: for invalid hyper-parameters (same rules as torch).
    """
    validate_lr(lr)
    validate_non_negative("momentum value", momentum)
    validate_non_negative("weight_decay value", weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def init(params: Params) -> SgdState:
        # Buffers are allocated eagerly (torch allocates lazily) so the state has
        # a fixed structure from the start; their zeros are never read, see update.
        buffers = zeros_like_tree(params) if momentum != 0 else None
        return SgdState(count=zero_count(), momentum=buffers)

    @torch.no_grad()
    def update_(grads: Grads, state: SgdState, params: Params) -> tuple[Params, SgdState]:
        count = int(state.count)
        step_lr = resolve_lr(lr, count)
        trees = (grads,) if momentum == 0 else (grads, state.momentum)
        leaves, _, (grad_leaves, *rest) = flatten_as(params, *trees)
        buf_leaves = rest[0] if rest else [None] * len(leaves)
        decay = decay_flags(mask, params, len(leaves), weight_decay)
        backend = backend_for(fused)
        leaves, (grad_leaves, buf_leaves), decay = by_flag(
            leaves, [grad_leaves, buf_leaves], decay, backend is not None
        )
        groups, large = grouped(leaves, decay)
        if backend is not None:  # a compiled kernel per large leaf, the rest as below
            first = count == 0
            step_scalars = [step_lr, weight_decay, momentum, 0.0 if first else momentum]
            step_scalars.append(1.0 if first else 1 - dampening)
            fast, groups, large = split(leaves, groups, large, [buf_leaves])
            key = (nesterov, maximize, momentum != 0)
            columns = [grad_leaves, buf_leaves]
            run(make_sgd, key, step_scalars, backend, fast, leaves, columns, decay)
            lists, groups = listed(groups, leaves, columns)
            for idx in lists:  # small leaves or pieces: torch's fused list kernel (`listed`)
                torch._fused_sgd_(
                    [leaves[i] for i in idx],
                    [grad_leaves[i] for i in idx],
                    [buf_leaves[i] for i in idx] if momentum != 0 else [],
                    weight_decay=weight_decay if decay[idx[0]] else 0.0,
                    momentum=momentum,
                    lr=step_lr,
                    dampening=dampening,
                    nesterov=nesterov,
                    maximize=maximize,
                    is_first_step=count == 0 and momentum != 0,  # torch's: no buffer, no flag
                )
                bumped([leaves[i] for i in idx])
        for idx in groups:  # the same ops, each one list op over the group (`grouped`)
            ps, d_ps = [leaves[i] for i in idx], [grad_leaves[i] for i in idx]
            d_ps = torch._foreach_neg(d_ps) if maximize else d_ps
            if decay[idx[0]] is True:
                d_ps = torch._foreach_add(d_ps, ps, alpha=weight_decay)
            if momentum != 0:
                bufs = [buf_leaves[i] for i in idx]
                if count == 0:
                    torch._foreach_copy_(bufs, d_ps)
                else:
                    mul_each_(bufs, momentum)
                    torch._foreach_add_(bufs, d_ps, alpha=1 - dampening)
                d_ps = torch._foreach_add(d_ps, bufs, alpha=momentum) if nesterov else bufs
            torch._foreach_add_(ps, d_ps, alpha=-step_lr)
        for i in large:
            p, g, buf, d = leaves[i], grad_leaves[i], buf_leaves[i], decay[i]
            d_p = -g if maximize else g
            if d is not False:
                d_p = d_p.add(p if d is True else p * d, alpha=weight_decay)
            if momentum != 0:
                if count == 0:
                    # torch seeds the buffer with the raw step direction on the first
                    # step, skipping the (1 - dampening) factor.
                    buf.copy_(d_p)
                else:
                    buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
                d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
            p.add_(d_p, alpha=-step_lr)
        state.count.add_(1)
        return params, state

    return Optimizer(init, from_inplace(update_), update_, fused=fused)
