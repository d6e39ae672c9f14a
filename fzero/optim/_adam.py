"""Adam and AdamW, bitwise-equal to ``torch.optim.Adam``/``AdamW`` with ``foreach=False``
(on the CPU, where it is tested) for Python-number hyper-parameters: large leaves op by
op, small ones a group at a time; fused (`_fused`), large leaves one compiled kernel
each, small ones (a tree's leaves, a shard's pieces) a group a call of torch's own fused
list kernel.

A tensor `lr` or `betas` is read as a Python float (`.item()`), and the step's scalars
(the step size, the bias corrections) computed in float64, as for numbers: torch keeps
them tensors and computes those scalars in the tensor's dtype, so float32 tensor
hyper-parameters differ from torch's by that rounding (a relative 1e-7 of a step)."""

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
    scale_where_,
    validate_beta,
    validate_lr,
    validate_non_negative,
    zero_count,
    zeros_like_tree,
)
from ._fused import backend_for, bumped, listed, make_adam, run, split, step_tensor


class AdamState(NamedTuple):
    """State of :func:`adam` and :func:`adamw`.

    Attributes:
      count: 0-d int64 tensor, number of updates applied so far.
      mu: first-moment estimates (torch's ``exp_avg``), mirroring the params pytree.
      nu: second-moment estimates (torch's ``exp_avg_sq``), mirroring the params.
      nu_max: running maximum of ``nu`` (torch's ``max_exp_avg_sq``) when
        ``amsgrad=True``, otherwise ``None``.
    """

    count: torch.Tensor
    mu: Params
    nu: Params
    nu_max: Params | None


def _adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    mask: Any = None,
    fused: bool | None = None,
) -> Optimizer:
    """Shared implementation; ``decoupled`` selects AdamW's weight decay."""
    validate_lr(lr)
    validate_non_negative("epsilon value", eps)
    validate_beta(0, betas[0])
    validate_beta(1, betas[1])
    validate_non_negative("weight_decay value", weight_decay)
    beta1, beta2 = float(betas[0]), float(betas[1])

    def init(params: Params) -> AdamState:
        nu_max = zeros_like_tree(params) if amsgrad else None
        return AdamState(zero_count(), zeros_like_tree(params), zeros_like_tree(params), nu_max)

    @torch.no_grad()
    def update_(grads: Grads, state: AdamState, params: Params) -> tuple[Params, AdamState]:
        count = int(state.count)
        step_lr = resolve_lr(lr, count)
        # Same python-float arithmetic as torch's single-tensor path, which reads the
        # (incremented) step back as a float before exponentiating.
        step = float(count + 1)
        step_size = step_lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5

        trees = (grads, state.mu, state.nu) + ((state.nu_max,) if amsgrad else ())
        leaves, _, (g_l, mu_l, nu_l, *rest) = flatten_as(params, *trees)
        nu_max_l = rest[0] if amsgrad else [None] * len(leaves)
        decay = decay_flags(mask, params, len(leaves), weight_decay)
        backend = backend_for(fused)
        leaves, (g_l, mu_l, nu_l, nu_max_l), decay = by_flag(
            leaves, [g_l, mu_l, nu_l, nu_max_l], decay, backend is not None
        )
        groups, large = grouped(leaves, decay)
        if backend is not None:  # a compiled kernel per large leaf, the rest as below
            step_scalars = [
                1 - step_lr * weight_decay if decoupled else weight_decay,
                1 - beta1,
                beta2,
                1 - beta2,
                bias_correction2_sqrt,
                eps,
                step_size,
            ]
            fast, groups, large = split(leaves, groups, large, [mu_l, nu_l, nu_max_l])
            columns = [g_l, mu_l, nu_l, nu_max_l]
            key = (amsgrad, decoupled, maximize)
            run(make_adam, key, step_scalars, backend, fast, leaves, columns, decay)
            lists, groups = listed(groups, leaves, columns)
            fused_list = torch._fused_adamw_ if decoupled else torch._fused_adam_
            for idx in lists:
                at = [leaves[i] for i in idx]
                fused_list(
                    at,
                    [g_l[i] for i in idx],
                    [mu_l[i] for i in idx],
                    [nu_l[i] for i in idx],
                    [nu_max_l[i] for i in idx] if amsgrad else [],
                    [step_tensor(step, at[0])] * len(idx),
                    lr=step_lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=weight_decay if decay[idx[0]] else 0.0,
                    eps=eps,
                    amsgrad=amsgrad,
                    maximize=maximize,
                )
                bumped(at)
        scratch = _Scratch([nu_l[i] for i in large], [[nu_l[i] for i in g] for g in groups])

        def one(
            p: torch.Tensor,
            g: torch.Tensor,
            m: torch.Tensor,
            v: torch.Tensor,
            v_max: torch.Tensor | None,
            d: Any,
        ) -> None:
            # The very in-place ops of torch's single-tensor Adam, on the given tensors.
            g = -g if maximize else g
            if d is not False:
                if decoupled:
                    scale_where_(p, 1 - step_lr * weight_decay, d)
                else:
                    g = g.add(p if d is True else p * d, alpha=weight_decay)
            if torch.is_complex(p):
                # torch updates complex tensors through real views, so that the second
                # moment accumulates |g|^2 per component rather than the complex g*g.
                p, g, m, v = (torch.view_as_real(t) for t in (p, g, m, v))
                v_max = torch.view_as_real(v_max) if amsgrad else None
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if amsgrad:
                torch.maximum(v_max, v, out=v_max)
            denom = scratch.like(v)
            torch.sqrt(v_max if amsgrad else v, out=denom)
            denom.div_(bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, denom, value=-step_size)

        def many(idx: list[int]) -> None:
            # The same ops, each one call over a group of small real leaves sharing a
            # decay flag; on the CPU torch runs a list op leaf by leaf with the very
            # kernels above (bitwise the same), without a Python call per leaf and op.
            p, m, v = [leaves[i] for i in idx], [mu_l[i] for i in idx], [nu_l[i] for i in idx]
            g = [g_l[i] for i in idx]
            g = torch._foreach_neg(g) if maximize else g
            if decay[idx[0]] is True:
                if decoupled:
                    mul_each_(p, 1 - step_lr * weight_decay)
                else:
                    g = torch._foreach_add(g, p, alpha=weight_decay)
            torch._foreach_lerp_(m, g, 1 - beta1)
            mul_each_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            top = v
            if amsgrad:
                top = [nu_max_l[i] for i in idx]
                torch._foreach_maximum_(top, v)
            denom = scratch.split_like(v)
            torch._foreach_copy_(denom, top)
            torch._foreach_sqrt_(denom)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(p, m, denom, value=-step_size)

        for idx in groups:
            many(idx)
        for i in large:
            one(leaves[i], g_l[i], mu_l[i], nu_l[i], nu_max_l[i], decay[i])
        state.count.add_(1)
        return params, state

    return Optimizer(init, from_inplace(update_), update_, fused=fused)


class _Scratch:
    """One buffer per dtype and device, as large as the largest second moment (or group of
    them), that every leaf's denominator is written into in turn.

    torch's single-tensor Adam allocates two temporaries per leaf (the square root, then
    its quotient), each of which may fault its pages in afresh (docs/design.md, [Note:
    the pool]). Writing into one buffer computes the very same values (the same kernels,
    into a buffer or in place) with one allocation per step.
    """

    def __init__(self, moments: list[torch.Tensor], groups: list[list[torch.Tensor]]) -> None:
        self._sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for v in moments:
            r = torch.view_as_real(v) if v.is_complex() else v
            self._need(r, r.numel())
        for group in groups:
            self._need(group[0], sum(v.numel() for v in group))
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _need(self, v: torch.Tensor, numel: int) -> None:
        key = (v.dtype, v.device)
        self._sizes[key] = max(self._sizes.get(key, 0), numel)

    def _buffer(self, v: torch.Tensor) -> torch.Tensor:
        key = (v.dtype, v.device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(self._sizes[key], dtype=v.dtype, device=v.device)
        return buf

    def like(self, v: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of `v`'s shape, dtype and device over the shared buffer."""
        return self._buffer(v)[: v.numel()].view(v.shape)

    def split_like(self, vs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors shaped as `vs` (one dtype and device) side by side in the buffer."""
        sizes = [v.numel() for v in vs]
        parts = self._buffer(vs[0])[: sum(sizes)].split_with_sizes(sizes)
        return [part.view(v.shape) for part, v in zip(parts, vs)]


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Any = None,
    fused: bool | None = None,
) -> Optimizer:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
      lr: learning rate, or a schedule ``lr(count) -> float`` called with the
        0-based index of the update being computed (0 for the first update). A tensor
        is read as its float (see the module's docstring).
      betas: decay rates of the first and second moment estimates, each in [0, 1).
      eps: term added to the denominator for numerical stability.
      weight_decay: L2 penalty coefficient, added to the gradient (``g + wd * p``).
      amsgrad: use the AMSGrad variant (normalise by the running max of ``nu``).
      maximize: maximize the objective instead of minimizing it.
      mask: where weight decay applies: a predicate on parameter paths or a pytree of
        bools like the parameters (True = decay); None decays everything. Resolved per
        element under sharding, so it works on flat shards too.
      fused: each large leaf's (a flat shard's) update as one compiled kernel
        (`torch.compile`; one pass over memory instead of seven), the small fp32 and
        fp64 leaves or pieces a group at a time through torch's `_fused_adam(w)_`
        (contiguous, on the CPU or a GPU; others keep the list ops), agreeing with
        the unfused ops to a few ulps rather than bitwise. None: fused inside a compiled
        step (`sharded_step(compile=...)`, with its backend), unfused otherwise.

    Returns:
      An :class:`Optimizer` whose state is an :class:`AdamState`.

    Raises:
      ValueError: for invalid hyper-parameters (same rules as torch).
    """
    return _adam(
        lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False, mask=mask, fused=fused
    )


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    mask: Any = None,
    fused: bool | None = None,
) -> Optimizer:
    """AdamW (decoupled weight decay), as ``torch.optim.AdamW``.

    Args:
      lr: learning rate, or a schedule ``lr(count) -> float`` called with the
        0-based index of the update being computed (0 for the first update). A tensor
        is read as its float (see the module's docstring).
      betas: decay rates of the first and second moment estimates, each in [0, 1).
      eps: term added to the denominator for numerical stability.
      weight_decay: decoupled decay; params are first scaled by ``1 - lr * wd``.
      amsgrad: use the AMSGrad variant (normalise by the running max of ``nu``).
      maximize: maximize the objective instead of minimizing it.
      mask: where weight decay applies: a predicate on parameter paths or a pytree of
        bools like the parameters (True = decay); None decays everything. Resolved per
        element under sharding, so it works on flat shards too.
      fused: each large leaf's (a flat shard's) update as one compiled kernel
        (`torch.compile`; one pass over memory instead of seven), the small fp32 and
        fp64 leaves or pieces a group at a time through torch's `_fused_adam(w)_`
        (contiguous, on the CPU or a GPU; others keep the list ops), agreeing with
        the unfused ops to a few ulps rather than bitwise. None: fused inside a compiled
        step (`sharded_step(compile=...)`, with its backend), unfused otherwise.

    Returns:
      An :class:`Optimizer` whose state is an :class:`AdamState`.

    Raises:
      ValueError: for invalid hyper-parameters (same rules as torch).
    """
    return _adam(
        lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=True, mask=mask, fused=fused
    )
