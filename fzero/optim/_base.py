"""The functional ``Optimizer`` interface and helpers shared by the optimizer aliases."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias

import optree
import torch

from ._fused import FUSED_DTYPES

Params: TypeAlias = Any
"""An optree pytree whose leaves are ``torch.Tensor`` parameters."""

Grads: TypeAlias = Any
"""A pytree of gradients with exactly the structure of the matching ``Params``."""

OptState: TypeAlias = Any
"""An optimizer state: a pytree of tensors and python scalars."""

Schedule: TypeAlias = Callable[[int], float]
"""Maps the 0-based index of the step being computed to a learning rate."""

# Quoted: only type checkers read it, so no runtime `type | Callable` union (Python >= 3.10).
ScalarOrSchedule: TypeAlias = "float | Schedule"


class Optimizer(NamedTuple):
    """A pure-function optimizer: ``init`` and ``update``, plus an in-place ``update_``.

    ``init(params)`` builds the initial state. ``update(grads, state, params)``
    returns ``(new_params, new_state)`` and never mutates its inputs, so a step
    can be retried, replayed or checkpointed without defensive copies.
    ``update_(grads, state, params)`` computes the same values (bitwise) but writes
    them into ``params`` and ``state`` and returns those: the donating form, used by
    ``fzero.sharded_step`` so a step never holds two copies of the optimizer state.
    It is None for optimizers that cannot update in place.

    ``whole_tensors`` is None for an elementwise optimizer: each element's update
    depends only on its own gradient, state and value (and on global scalars such as a
    clipping norm), so it may run on any slice of a tensor. Otherwise it says why the
    optimizer must see whole tensors (Adafactor's factored moments, a trust ratio over
    the tensor): the flat layout cuts tensors across ranks at stages 1-3, so such an
    optimizer needs ``layout="tensor"`` there (``shard_state`` checks).

    ``fused`` is how its arithmetic runs: True as compiled kernels (`_fused`), None as
    those inside a compiled step and unfused ops otherwise, False unfused ops always.
    """

    init: Callable[[Params], OptState]
    update: Callable[[Grads, OptState, Params], tuple[Params, OptState]]
    update_: Callable[[Grads, OptState, Params], tuple[Params, OptState]] | None = None
    whole_tensors: str | None = None
    fused: bool | None = False


def check_optimizer(optimizer: Any, who: str, mesh: Any = None) -> None:
    """Raises a TypeError naming `who` (and `mesh`'s rank) if `optimizer` is not an
    `fzero.optim` Optimizer (torch's own, class or instance, is the likely mistake: the
    message says how)."""
    if isinstance(optimizer, Optimizer):
        return
    rank = getattr(mesh, "rank", None)
    who = who if rank is None else f"{who}: rank {rank}"
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = getattr(optimizer, "__name__", cls.__name__)
    if issubclass(cls, torch.optim.Optimizer):  # a class or an instance of torch's kind
        where = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
        hint = (
            f": torch's optimizers run through fzero.optim.from_torch({where}."
            f"{cls.__qualname__}, lr=...), or use fzero.optim.adamw(...) / adam / sgd"
        )
    elif callable(optimizer) and getattr(optimizer, "__module__", "").startswith("fzero."):
        hint = f": call it, fzero.optim.{name}(lr=...)"  # the factory, uncalled
    else:
        hint = ", e.g. fzero.optim.adamw(lr=1e-3)"
    raise TypeError(f"{who}: optimizer must be an fzero.optim optimizer, got {name}{hint}")


def check_slices(optimizer: Optimizer, layout: str, where: str = "") -> None:
    """Raises a ValueError if `optimizer` must see whole tensors (``whole_tensors``) and a
    `layout` of kind "flat" would hand it slices of buckets (stages 1-3).

    Args:
      optimizer: the optimizer to check.
      layout: the layout's kind, "flat" or "tensor".
      where: who asks, to start the message with (empty: the caller adds it).
    """
    if optimizer.whole_tensors is not None and layout == "flat":
        raise ValueError(
            f"{where + ': ' if where else ''}{optimizer.whole_tensors}, and with the flat "
            "layout the optimizer of stages 1-3 steps flat slices of buckets that cut tensors "
            "apart; use layout='tensor' (each rank updates whole tensors, in their shapes) or "
            "stage 0"
        )


def from_inplace(
    update_: Callable[[Grads, OptState, Params], tuple[Params, OptState]],
) -> Callable[[Grads, OptState, Params], tuple[Params, OptState]]:
    """The out-of-place ``update`` of an in-place ``update_``: it works on copies.

    Args:
      update_: an update that mutates its ``params`` and ``state`` arguments.

    Returns:
      An update that clones ``params`` and every tensor of ``state`` first.
    """

    def update(grads: Grads, state: OptState, params: Params) -> tuple[Params, OptState]:
        clone = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
        return update_(grads, optree.tree_map(clone, state), optree.tree_map(clone, params))

    return update


def validate_lr(lr: ScalarOrSchedule) -> None:
    """Rejects a constant learning rate that is negative or NaN.

    Args:
      lr: a constant learning rate or a schedule (schedules are checked when called).

    Raises:
      ValueError: if ``lr`` is a constant and not ``>= 0``.
    """
    if not callable(lr):
        validate_non_negative("learning rate", lr)


def validate_non_negative(name: str, value: float) -> None:
    """Raises ``ValueError`` unless ``value >= 0`` (NaN is rejected too).

    Args:
      name: human readable hyper-parameter name used in the error message.
      value: the value to check.
    """
    # `not value >= 0` rather than `value < 0` so that NaN is rejected as well.
    if not float(value) >= 0.0:
        raise ValueError(f"Invalid {name}: {value} (must be >= 0)")


def validate_beta(index: int, value: float) -> None:
    """Raises ``ValueError`` unless ``0 <= value < 1``.

    Args:
      index: position of the beta in ``betas`` (for the error message).
      value: the beta to check.
    """
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"Invalid beta parameter at index {index}: {value} (must be in [0, 1))")


def resolve_lr(lr: ScalarOrSchedule, count: int) -> float:
    """Returns the learning rate to use for the step with 0-based index ``count``.

    Args:
      lr: a constant learning rate or a schedule ``lr(count) -> float``.
      count: number of updates already applied (the index of this update).

    Returns:
      The learning rate as a python float. torch's SGD reads a tensor lr so too (`.item()`);
      its Adam keeps it a tensor for the step size's arithmetic (`_adam`'s docstring).

    Raises:
      ValueError: if the (scheduled) learning rate is negative or NaN.
    """
    value = lr(count) if callable(lr) else lr
    value = float(value)  # a 0-d tensor's `.item()`
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"Invalid learning rate at step {count}: {value} (must be >= 0)")
    return value


def flatten_as(
    params: Params, *trees: Any
) -> tuple[list[torch.Tensor], optree.PyTreeSpec, list[list[Any]]]:
    """Flattens ``params`` and each of ``trees`` up to the structure of ``params``.

    Args:
      params: the parameter pytree that defines the structure.
      *trees: pytrees whose prefix matches ``params`` (grads, per-leaf state ...).

    Returns:
      ``(param_leaves, treespec, [leaves_of_each_tree])``.

    Raises:
      ValueError: if one of ``trees`` does not have the structure of ``params``.
    """
    leaves, spec = optree.tree_flatten(params)
    # flatten_up_to raises a descriptive error if a tree's structure does not match.
    return leaves, spec, [spec.flatten_up_to(tree) for tree in trees]


def zeros_like_tree(params: Params) -> Params:
    """Returns a pytree of zero tensors shaped like ``params`` (same dtype/device/layout).

    Args:
      params: the parameter pytree.

    Returns:
      The zero pytree, with the structure of ``params``.
    """
    # preserve_format mirrors torch's own state initialisation, so strides match the params.
    return optree.tree_map(
        lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params
    )


def zero_count() -> torch.Tensor:
    """Returns a fresh step counter: a 0-d int64 CPU tensor equal to 0."""
    # A tensor (not a python int) so the count is checkpointed like every other state leaf;
    # on the CPU whatever the parameters' device (as torch.optim's "step"), because every
    # update reads it (the bias corrections, a schedule): on a GPU that read would sync.
    return torch.zeros((), dtype=torch.int64, device="cpu")


def decay_flags(mask: Any, params: Params, n: int, weight_decay: float) -> list[Any]:
    """Per leaf: False (no decay), True, or the `Spans` of a piece mixing parameters
    (which `by_flag` cuts or masks)."""
    if weight_decay == 0:
        return [False] * n
    if mask is None:
        return [True] * n
    from ._context import resolve_mask

    return resolve_mask(mask, params)


def by_flag(
    leaves: list[torch.Tensor], columns: list[list[Any]], decay: list[Any], fused: bool
) -> tuple[list[torch.Tensor], list[list[Any]], list[Any]]:
    """The leaves an elementwise update walks: a piece mixing parameters (`Spans`) as
    views of its runs, a decay flag each, where that costs no more than a mask. Its small
    runs then join `grouped`'s groups (one list op, or one call of torch's fused list
    kernel, for many), each large run is a leaf of its own, and no per-element mask is
    made or read (the mask's build and passes were most of a masked update's time here,
    `benchmarks/RESULTS-update-time.md`). Unfused (and a 16-bit or complex piece, which
    runs the unfused ops fused too), every mixed piece is cut. Fused, each large run is a
    compiled kernel's call (some 80 us on the host, `_fused.split`) where the mask was
    one for the piece: a piece is cut where it has at most one run over `_SMALL` elements
    or, on the CPU, where its extra calls cost less than its mask (`_CALL_ELEMENTS`); any
    other keeps a 0/1 mask of its dtype.

    Args:
      leaves: the parameter leaves (a rank's pieces, or a tree's leaves).
      columns: per leaf, each tensor updated beside it (gradient, moments; None stays).
      decay: per leaf, as `decay_flags` gives.
      fused: whether the update runs fused (`_fused.backend_for`).

    Returns:
      `(leaves, columns, decay)`, decay True, False or a 0/1 tensor per leaf.
    """
    from ._context import Spans

    if not any(isinstance(d, Spans) for d in decay):
        return leaves, columns, decay
    out, cols, flags = [], [[] for _ in columns], []
    for i, (p, d) in enumerate(zip(leaves, decay)):
        beside = [c[i] for c in columns]
        tensors = [p, *(t for t in beside if t is not None)]
        cut = (
            isinstance(d, Spans)
            and (not fused or p.dtype not in FUSED_DTYPES or _calls_pay(p, d))
            and all(t.dim() <= 1 or t.is_contiguous() for t in tensors)
        )
        if not cut:
            out.append(p)
            for col, t in zip(cols, beside):
                col.append(t)
            flags.append(d.mask(p) if isinstance(d, Spans) else d)
            continue
        # Views (the update writes through to the piece), a split per tensor: the runs
        # cover the piece, and one call for all of them costs less than a slice each.
        sizes = [hi - lo for lo, hi, _ in d.runs]
        out += _runs(p, sizes)
        for col, t in zip(cols, beside):
            col += [None] * len(sizes) if t is None else _runs(t, sizes)
        flags += [on for _, _, on in d.runs]
    return out, cols, flags


# On the CPU, a fused update's compiled kernel call costs about what building and reading
# a 0/1 mask over this many elements does: on the benchmark GPT's rank 0 (8 mixed pieces
# of 302,512 elements, 2 large runs each), its fused AdamW took 4.5-8.3 ms a step masked
# and 1.6-2.5 ms without a mask, one thread (`benchmarks/RESULTS-update-time.md`): some
# 1.4 ns an element, against some 80 us a call. The threshold is extrapolated from that
# one model. A GPU's memory is two orders faster and its calls no cheaper (not measured):
# there a piece keeps its mask unless at most one run is large.
_CALL_ELEMENTS = 1 << 16


def _calls_pay(p: torch.Tensor, spans: Any) -> bool:
    """Whether a fused update cuts piece `p` (`spans` its runs): its runs over `_SMALL`
    elements, one compiled kernel call each, cost no more than its mask."""
    large = sum(hi - lo > _SMALL for lo, hi, _ in spans.runs)
    if large <= 1:
        return True
    return p.device.type == "cpu" and p.numel() >= (large - 1) * _CALL_ELEMENTS


def _runs(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """`t`'s elements, flat, as consecutive views of `sizes` elements."""
    return list((t if t.dim() == 1 else t.view(-1)).split_with_sizes(sizes))


def scale_where_(p: torch.Tensor, factor: float, flag: Any) -> torch.Tensor:
    """`p *= factor` where `flag` (True, or a 0/1 tensor) is set, in place.

    Each element is rounded as `p.mul_(factor)` rounds it: the product of `p` and the
    Python float, in the op's compute precision. (A factor made a tensor of `p`'s dtype
    first would be rounded to bf16/fp16 before the product, and differ from torch's.)
    """
    if flag is True:
        return p.mul_(factor)
    return p.copy_(torch.where(flag.bool(), p * factor, p))


def mul_each_(xs: list[torch.Tensor], factor: float) -> None:
    """`x.mul_(factor)` for each tensor of a group (one dtype and device), in one list op,
    each element rounded as that single-tensor op rounds it.

    On the CPU, torch's `_foreach_mul_` rounds a Python scalar to a 16-bit list's dtype
    before the product (torch 2.13: 0.9 becomes 0.8984 in bf16, 0.999 becomes 1), where
    `mul_` takes it in float32, as it does a 0-d float32 tensor (checked element for
    element against `mul_`, bf16 and fp16; `tests/optim/test_optim.py::test_low_precision`).
    """
    if xs[0].device.type == "cpu" and xs[0].dtype in (torch.bfloat16, torch.float16):
        torch._foreach_mul_(xs, torch.tensor(factor, dtype=torch.float32))
    else:
        torch._foreach_mul_(xs, factor)


# Leaves of at most this many elements are updated in groups (`grouped`), where a call per
# leaf and op costs more than the arithmetic; a group holds at most `_GROUP` elements, so
# its temporaries stay small.
_SMALL, _GROUP = 1 << 14, 1 << 20


def grouped(leaves: list[torch.Tensor], decay: list[Any]) -> tuple[list[list[int]], list[int]]:
    """The small real leaves, in groups of one dtype, device and decay flag (True or
    False; a per-element mask goes leaf by leaf), and the positions of all the others.

    Elementwise optimizers update each group with torch's list ops (`torch._foreach_*`):
    on the CPU they run the single-tensor kernels leaf by leaf, so the values are bitwise
    those of the loop, without a Python call per leaf and op. Fused (`fused=True`, a
    compiled step), a group goes to torch's fused list kernel instead (`_fused.listed`).

    Args:
      leaves: the parameter leaves.
      decay: per leaf, as `by_flag` gives (True, False or a 0/1 tensor).

    Returns:
      `(groups, large)`: lists of leaf positions per group, and the other positions.
    """
    groups: dict[Any, list[list[int]]] = {}
    filled: dict[Any, int] = {}  # elements in each key's last group
    large: list[int] = []
    for i, (p, d) in enumerate(zip(leaves, decay)):
        n = p.numel()
        if n > _SMALL or p.is_complex() or not isinstance(d, bool):
            large.append(i)
            continue
        key = (p.dtype, p.device, d)
        runs = groups.setdefault(key, [[]])
        if runs[-1] and filled[key] + n > _GROUP:
            runs.append([])
            filled[key] = 0
        runs[-1].append(i)
        filled[key] = filled.get(key, 0) + n
    return [run for runs in groups.values() for run in runs], large
