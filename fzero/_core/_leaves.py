"""The checks a parameter tree's leaves pass before anything is built from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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
    """Raises naming two leaves that are the same tensor (one object, or one view of the
    same memory), one of them trained (`frozen`: per leaf).

    fzero trains each leaf apart, with its own shard and optimizer state: a weight listed
    twice would be two weights after the first step, where torch.optim (given it twice)
    steps it once with both gradients summed. Frozen leaves are never written.
    """
    seen: dict[Any, tuple[str, bool]] = {}
    for path, x, f in zip(paths, leaves, frozen):
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            continue
        if x.device.type == "meta":  # no memory to compare: the object itself
            key: Any = id(x)
        else:
            view = (x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)
            key = (x.device, x.untyped_storage().data_ptr(), *view)
        other, other_frozen = seen.setdefault(key, (path, f))
        if other != path and not (f and other_frozen):
            raise ValueError(
                f"params leaves {other!r} and {path!r} are the same tensor: fzero trains "
                "each leaf apart (its own shard and optimizer state), so the two would part "
                "after the first step. List it once and read it at both places in the loss "
                "(dict(model.named_parameters()) lists a module's tied weights once)"
            )
