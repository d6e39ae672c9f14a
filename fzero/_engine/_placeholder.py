"""Placeholders: what a loss holds of a just-in-time unit's parameters before they enter it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .._core import ShardLayout, spec_of, tree_flatten


class Placeholder(torch.Tensor):
    """A parameter of a just-in-time unit where the loss has not entered the unit: its
    shape and dtype, no data, and any computation with it raises a ValueError naming the
    leaf, the unit and the rank.

    Not a meta tensor: torch's CPU matmul, `linear` without bias and convolutions accept
    a meta weight and read its missing data as memory, so a weight tied across units
    (or used outside its submodule) would train on garbage, silently.
    """

    path: str
    unit: str | tuple[str, ...]  # its `units=` entry: what `fzero.gathered` asks for
    rank: int

    @staticmethod
    def __new__(
        cls,
        shape: torch.Size,
        dtype: torch.dtype,
        *,
        path: str,
        unit: str | tuple[str, ...],
        rank: int,
    ) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="meta")
        t.path, t.unit, t.rank = path, unit, rank
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Asking autograd for a placeholder's gradient dispatches no operation, so torch
        # would only say that it "does not require grad".
        if func in _DIFFERENTIATE:
            used = _placeholder(args, kwargs)
            raise ValueError(
                f"rank {used.rank}: the loss asked autograd for the gradient with respect to "
                f"the parameter {used.path!r} of the just-in-time unit {used.unit!r} "
                f"({func.__module__}.{func.__name__}) where it only has a placeholder for "
                "it: a unit's parameters are present only inside its submodule's forward "
                "(module=) or what fzero.gathered returns (just_in_time=True). A loss that "
                "differentiates by the parameters itself (SAM, MAML) needs them where it "
                "does so: leave those units out of units= (their parameters then join the "
                "root, entered before the forward)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        used = _placeholder(args, kwargs)
        raise ValueError(
            f"rank {used.rank}: the parameter {used.path!r} of the just-in-time unit "
            f"{used.unit!r} was used (by aten.{func.overloadpacket.__name__}) where the loss "
            "only has a placeholder for it: with module=, outside its submodule's forward (read "
            "directly by a module outside the unit, or by a method of the submodule other than "
            "forward: fzero.register_forward_method(submodule, name) enters the unit around "
            "it); with just_in_time=True, without "
            f"fzero.gathered(params, {used.unit!r}). Use it there, or leave its unit out of "
            "units= (its parameters then join the root, entered before the forward)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"Placeholder({self.path!r} of just-in-time unit {self.unit!r}, "
            f"shape={tuple(self.shape)}, dtype={self.dtype})"
        )


_DIFFERENTIATE = (torch.autograd.grad, torch.autograd.backward)


def _placeholder(args: Any, kwargs: Any) -> Placeholder:
    """The first placeholder among an operation's arguments."""
    return next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Placeholder))


def placeholders_for(
    layout: ShardLayout, jit: Iterable[str], rank: int
) -> dict[str, tuple[tuple[int, Placeholder], ...]]:
    """Per just-in-time unit of `jit`, its leaves' index in the tree and `Placeholder`."""
    out = {}
    for unit in jit:
        spec = spec_of(layout.unit_members(unit))
        out[unit] = tuple(
            (s.index, Placeholder(s.shape, b.dtype, path=s.path, unit=spec, rank=rank))
            for b in (layout.buckets[i] for i in layout.unit_buckets(unit))
            for s in b.slots
        )
    return out


class Unentered:
    """A parameter of a just-in-time unit inside a compiled step's loss, until
    `fzero.gathered` enters the unit: not a tensor (the graph has no value for it), but
    what entering needs. `enter()` adds the unit's entry to the graph and returns its
    leaves' views by path; `unit` is its `units=` entry, `count` its number of leaves,
    all of which a `gathered` call must cover (as eagerly: every call enters the whole
    unit)."""

    def __init__(
        self, path: str, unit: str | tuple[str, ...], count: int, rank: int, enter: Any
    ) -> None:
        self.path, self.unit, self.count, self.rank, self.enter = path, unit, count, rank, enter

    def __repr__(self) -> str:
        return (
            f"Unentered({self.path!r} of the just-in-time unit {self.unit!r} on rank "
            f"{self.rank}: enter it with fzero.gathered(params, {self.unit!r}) before use)"
        )
