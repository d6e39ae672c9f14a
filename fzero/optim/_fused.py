"""Fused updates: an elementwise optimizer's arithmetic over one tensor as one compiled
kernel, for `fused=True` optimizers and the update of a compiled step.

fzero's unfused Adam runs torch's single-tensor ops, seven passes over memory per leaf,
each rounding as torch's `foreach=False` loop does (bitwise). Compiled, the same
expression is one pass (inductor's loop, vectorised and threaded on the CPU; one kernel
on a GPU): on a flat shard of 50M fp32 elements here, 1.6-1.7 G params/s against
0.3-0.4 unfused, about as fast as torch's fused CPU AdamW (`benchmarks/RESULTS-host-adam.md`).
Its rounding is not the seven ops': the step is a product subtracted where torch's
`addcdiv` multiplies by its value, and the compiler writes `lerp` its own way. The
values agree with the unfused update to a few ulps (tested: float64 to 1e-12 of
torch.optim, float32 within 4 ulps of the largest parameter); fp32 and fp64 leaves only
(`FUSED_DTYPES`).

Only what varies per step is a tensor argument (the scalars, worked out in Python floats
as the unfused ops take them, then one tensor of the leaf's dtype); the optimizer's
structure (AMSGrad, a decay mask, the dtype) is fixed per kernel, each its own compiled
function (`kernel`), and every tensor goes in flat, of a dynamic length (`run`): one
compile serves every bucket, block and owned tensor of a dtype.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

_STEP: ContextVar[str | None] = ContextVar("fzero_fused_step", default=None)
_KERNELS: dict[tuple[Any, ...], Callable[..., Any]] = {}


@contextlib.contextmanager
def compiled_updates(backend: str) -> Iterator[None]:
    """Within the block, optimizers made with `fused=None` run fused kernels compiled by
    `backend` (a compiled step's update)."""
    token = _STEP.set(backend)
    try:
        yield
    finally:
        _STEP.reset(token)


def backend_for(fused: bool | None) -> str | None:
    """The backend an optimizer made with `fused` compiles its kernels with now (None:
    unfused). True: the compiled step's backend, else inductor; None: the step's."""
    step = _STEP.get()
    if fused is None:
        return step
    return (step or "inductor") if fused else None


# What a kernel updates: fp32 and fp64. A 16-bit leaf keeps the unfused ops: its scalars
# would be tensors, which round in its dtype (beta2 = 0.999 is 1.0 in bf16) and, in
# float32, are rounded to bf16 first by a backend running the traced ops as eager kernels
# on a GPU; inductor on the CPU moved bf16 leaves away from the unfused update (measured).
FUSED_DTYPES = (torch.float32, torch.float64)


def split(
    leaves: list[torch.Tensor],
    groups: list[list[int]],
    large: list[int],
    written: list[list[Any]],
) -> tuple[list[int], list[list[int]], list[int]]:
    """Which leaves a fused update runs as kernels: `(fused, groups, large)`, the last two
    what is left of `grouped`'s answer for torch's fused list kernel (`listed`) and the
    unfused ops.

    The large contiguous fp32 or fp64 leaves with elements whose state (`written`: per
    leaf, the tensors the update writes besides it) is contiguous too: a compiled
    kernel's call costs some 80 us on the host (profiled here: dynamo's guards, then
    AOTAutograd's wrapper), many times what a small leaf costs in a group of torch's list
    kernel. A tree's and a shard's pieces alike: 100 small units' pieces a kernel each
    took 8 ms of a 45 ms compiled stage-3 step (the deep benchmark model, profiled).
    """

    def fits(i: int) -> bool:
        p = leaves[i]
        state = [c[i] for c in written if c[i] is not None]
        return (
            p.numel() > 0
            and p.dtype in FUSED_DTYPES
            and all(x.is_contiguous() for x in (p, *state))
        )

    fast = [i for i in large if fits(i)]
    taken = set(fast)
    return fast, groups, [i for i in large if i not in taken]


def run(
    make: Callable[..., Callable[..., Any]],
    key: tuple[Any, ...],
    step_scalars: list[float],
    backend: str,
    fast: list[int],
    leaves: list[torch.Tensor],
    columns: list[list[Any]],
    decay: list[Any],
) -> None:
    """`make`'s kernel over each leaf of `fast`: `kernel(p, *its columns, mask, s)`, its
    key `key` and the leaf's decay (`decay_kind`), `s` the step's scalars.

    Every tensor goes in flat (a view: `split` took contiguous ones), so the kernel sees
    one shape, of a dynamic length: dynamo specialises the number of dimensions and
    dimensions of size 0 or 1, and with the owned tensors of `layout="tensor"` in their
    own shapes a kernel compiled once per shape reached its recompile limit. Flat, a 0-d
    leaf is a view of shape (1,) too: compiled (torch 2.13, either backend), an in-place
    update of a 0-d input by a product with an element of the scalars was lost, the input
    left as it was (found here).
    """
    made: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for i in fast:
        p, d = leaves[i], decay[i]
        s = made.get((p.dtype, p.device))
        if s is None:
            s = made[p.dtype, p.device] = scalars(step_scalars, p)
        mask = None if isinstance(d, bool) else d
        flat = [None if x is None else x.reshape(-1) for x in (p, *(c[i] for c in columns), mask)]
        kernel(make, backend, (*key, decay_kind(d)), p)(*flat, s)


def listed(
    groups: list[list[int]], leaves: list[torch.Tensor], columns: list[list[Any]]
) -> tuple[list, list]:
    """Which of `grouped`'s groups (small leaves of a tree, small pieces of a shard) run
    as torch's own fused list kernel (`_fused_adam(w)_`, `_fused_sgd_`): one call a
    group, where a compiled kernel would cost some 80 us a leaf and the list ops a pass
    per op (AdamW over 400 leaves of the deep benchmark
    model's sizes: 0.55 ms a call, measured alone, against some 7 ms of a compiled step,
    profiled). Of fp32 and fp64 leaves on the CPU or a
    GPU whose tensors (`columns`: per leaf, the gradient and state beside it) are all
    contiguous: torch's kernel walks each as flat memory, and a transposed leaf beside a
    contiguous gradient came out wrong (found here). `(listed, the rest)`."""

    def fits(i: int) -> bool:
        p = leaves[i]
        return (
            p.dtype in FUSED_DTYPES
            and p.device.type in ("cpu", "cuda")
            and all(x.is_contiguous() for x in (p, *(c[i] for c in columns if c[i] is not None)))
        )

    ok = [g for g in groups if all(fits(i) for i in g)]
    return ok, [g for g in groups if g not in ok]


def bumped(params: list[torch.Tensor]) -> None:
    """The version of each tensor torch's fused list kernel updated, moved on as any
    in-place op moves it: the kernel writes them without (torch 2.13), and autograd's
    check of a saved tensor's version is how a step meeting a tensor an earlier step
    handed out, then updated, says so (`tests/engine/test_tied.py`)."""
    torch.autograd.graph.increment_version(params)


def step_tensor(step: float, like: torch.Tensor) -> torch.Tensor:
    """The step count as torch's fused kernels read it: a float32 tensor on `like`'s
    device (copied there without waiting, as `scalars` does)."""
    return torch.tensor(step, dtype=torch.float32).to(like.device, non_blocking=True)


def scalars(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A step's scalars, worked out in Python floats as the unfused ops take them, as one
    tensor of `like`'s dtype and device: an argument, not a constant of the trace, so
    the next step's values reuse the compiled kernel."""
    return torch.tensor(values, dtype=torch.float64).to(like.device, like.dtype, non_blocking=True)


def kernel(
    make: Callable[..., Callable[..., Any]], backend: str, args: tuple[Any, ...], like: torch.Tensor
) -> Callable[..., Any]:
    """The kernel `make(*args)` compiled by `backend` for tensors like `like` (its dtype
    and device type), made once per process and key.

    Each key's function gets its own code object: dynamo caches compiled code per code
    object and counts its variants against its recompile limit (8), which distinct
    optimizers and dtypes in one process would otherwise share. A key's kernel compiles
    a few variants: flat tensors of one element, and of a dynamic length (`run`) whose
    views start at offset 0, 1 or more of bases whose sizes relate one way or another
    (dynamo specialises 0 and 1, and equal sizes): three or four measured over random
    models. Not under `fullgraph`: past the limit a variant runs eagerly (the unfused
    ops' rounding) instead of raising in the middle of a run.
    """
    full = (make.__qualname__, backend, *args, like.dtype, like.device.type)
    fn = _KERNELS.get(full)
    if fn is None:
        body = make(*args)
        name = f"{body.__name__}_{len(_KERNELS)}"
        code = body.__code__.replace(co_name=name)  # co_qualname: Python >= 3.11 only
        fresh = types.FunctionType(code, body.__globals__, name, None, body.__closure__)
        fn = _KERNELS[full] = torch.compile(fresh, backend=backend, dynamic=True)
    return fn


def make_adam(amsgrad: bool, decoupled: bool, maximize: bool, decay: str) -> Callable[..., Any]:
    """Adam's update of one tensor, in place: `(p, g, m, v, v_max, mask, s)` with `s` the
    step's `(decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps, step_size)`
    where `decay` is `1 - lr * weight_decay` (AdamW) or `weight_decay` (Adam's L2 term).
    `decay`: "none", "all" or "mask" (a 0/1 tensor of `p`'s shape)."""

    def adam_kernel(p, g, m, v, v_max, mask, s):
        factor, w1, beta2, w2, bc2, eps, step_size = (s[i] for i in range(7))
        g = -g if maximize else g
        if decay != "none":
            if decoupled:
                kept = p * factor
                p.copy_(kept if decay == "all" else torch.where(mask.bool(), kept, p))
            else:
                g = g + (p if decay == "all" else p * mask) * factor
        m.lerp_(g, w1)
        v.mul_(beta2).add_(g * g * w2)
        top = v
        if amsgrad:
            v_max.copy_(torch.maximum(v_max, v))
            top = v_max
        p.sub_(m / (top.sqrt() / bc2 + eps) * step_size)

    return adam_kernel


def make_sgd(nesterov: bool, maximize: bool, momentum: bool, decay: str) -> Callable[..., Any]:
    """SGD's update of one tensor, in place: `(p, g, buf, mask, s)` with `s` the step's
    `(lr, weight_decay, momentum, keep, take)`: the buffer becomes `buf * keep + d_p *
    take` (`(0, 1)` on the first step, which seeds it with the direction, as torch does;
    `(momentum, 1 - dampening)` after)."""

    def sgd_kernel(p, g, buf, mask, s):
        lr, wd, mom, keep, take = (s[i] for i in range(5))
        d_p = -g if maximize else g
        if decay != "none":
            d_p = d_p + (p if decay == "all" else p * mask) * wd
        if momentum:
            buf.copy_(buf * keep + d_p * take)
            d_p = d_p + buf * mom if nesterov else buf
        p.sub_(d_p * lr)

    return sgd_kernel


def decay_kind(flag: Any) -> str:
    """A leaf's decay flag (`_base.by_flag`'s) as a kernel's key."""
    if flag is False:
        return "none"
    return "all" if flag is True else "mask"
