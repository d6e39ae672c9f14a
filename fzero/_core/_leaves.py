"""The checks a parameter tree's leaves pass before anything is built from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin


def check_leaves(paths: list[str], leaves: list[Any]) -> None:
    """Raises naming the first leaf that is not a dense floating-point tensor, or if the
    leaves are none or live on several devices."""
    if not leaves:
        raise ValueError("params has no leaves: expected a pytree of floating-point tensors")
    devices = set()
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"params leaf {path!r} is a {type(leaf).__name__}, expected a "
                "floating-point torch.Tensor"
            )
        if isinstance(leaf, UninitializedTensorMixin):  # has no shape: any use raises
            raise ValueError(
                f"params leaf {path!r} is an uninitialized parameter (a lazy module's, such "
                "as nn.LazyLinear's, before its first forward): it has no shape to shard "
                "yet. Run the model once on a batch before shard_state; torch's lazy "
                "modules take their shapes there"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"params leaf {path!r} has dtype {leaf.dtype}, expected a floating-point dtype"
                + (_COMPLEX if leaf.is_complex() else "")
            )
        if leaf.layout != torch.strided:
            raise TypeError(f"params leaf {path!r} has layout {leaf.layout}, expected dense")
        devices.add(leaf.device)
    if len(devices) > 1:
        raise ValueError(f"params leaves live on several devices {sorted(map(str, devices))}")


# torch.optim steps a complex parameter as its real view, which fzero's flat buckets hold.
_COMPLEX = ": hold it as torch.view_as_real(x) and torch.view_as_complex it in the loss"


def check_distinct(paths: list[str], leaves: list[Any], frozen: Sequence[bool]) -> None:
    """Raises naming two leaves that share elements (one tensor twice, a view of another:
    its transpose, a slice of it), one of them trained (`frozen`: per leaf).

    fzero trains each leaf apart, with its own shard and optimizer state: a weight listed
    twice would be two weights after the first step, where torch.optim (given it twice)
    steps it once with both gradients summed. Frozen leaves are never written. Views of
    one buffer that share no element (its rows as leaves) are distinct.
    """
    by_memory: dict[Any, list[tuple[int, int, str, bool, torch.Tensor]]] = {}
    for path, x, f in zip(paths, leaves, frozen):
        if isinstance(x, torch.Tensor) and x.numel():
            by_memory.setdefault(_memory(x), []).append((*_span(x), path, f, x))
    for views in by_memory.values():
        # A sweep in the order the views start: each is compared with those still open
        # (a buffer cut into many leaves costs a sort, not every pair).
        open_: list[tuple[int, int, str, bool, torch.Tensor]] = []
        for start, end, path, f, x in sorted(views, key=lambda v: v[0]):
            open_ = [v for v in open_ if v[1] > start]
            for _, _, other, other_frozen, y in open_:
                if not (f and other_frozen) and _overlap(x, y):
                    raise ValueError(
                        f"params leaves {other!r} and {path!r} share elements (one tensor, "
                        "or views of it): fzero trains each leaf apart (its own shard and "
                        "optimizer state), so they would part after the first step. List the "
                        "tensor once and read it at both places in the loss "
                        "(dict(model.named_parameters()) lists a module's tied weights once)"
                    )
            open_.append((start, end, path, f, x))


def _memory(x: torch.Tensor) -> Any:
    """What `x`'s elements live in: its storage, or the tensor itself where it has none
    to compare (meta and fake tensors, wrapper subclasses)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.device.type == "meta":
        return id(x)
    ptr = x.untyped_storage().data_ptr()
    return (x.device, ptr) if ptr else id(x)


def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two tensors of one memory (`_memory`) share an element (meta, fake and
    wrapper tensors: whether they are one)."""
    if x is y:
        return True
    spans = [_span(t) for t in (x, y)]
    if spans[0][1] <= spans[1][0] or spans[1][1] <= spans[0][0]:
        return False  # apart: rows of one buffer, say
    if x.dtype != y.dtype:
        return True  # reinterpreted memory, its spans crossing: taken as shared
    return bool(torch.isin(_elements(x), _elements(y)).any())  # interleaved strides


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes `t` reaches in its storage, from its first to past its last element
    (torch's strides are never negative)."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _elements(t: torch.Tensor) -> torch.Tensor:
    """The storage indices of `t`'s elements."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.arange(n).as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1)


def unmatched_leaves(ours: Sequence[str], we: str, theirs: Sequence[str], they: str) -> str | None:
    """The leaf paths only one of two trees has, said by name (up to three a side), or
    None where both have the same. A comparison position by position would name the
    first leaf after a gap, which both have."""
    mine, yours = set(ours), set(theirs)
    said = [
        f"{len(only)} leaves {a} has and {b} lacks: {only[:3]}{' ...' if len(only) > 3 else ''}"
        for only, a, b in (
            ([p for p in ours if p not in yours], we, they),
            ([p for p in theirs if p not in mine], they, we),
        )
        if only
    ]
    return "; ".join(said) or None
