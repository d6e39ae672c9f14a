"""Parameter sources: where a step's units' full parameters come from.

`ParamSource` is the contract between the engine and the two ways a stage holds its
parameters (`Stage.params`): `Replica` (stages 0-2: the rank's replicated buffers, at
hand) and `_gatherer.Gatherer` (stage 3: the all-gather of every rank's shard). The
engine calls a source at fixed points of a micro-batch, the same for both:

    forward    start(upfront) -> open(entry) per entry, entered(unit), left(entry) ...
    backward   again(entry) for a recompute, reduced(entry) once an entry's gradient is
               reduced, end_backward(), then settle() once every reduction is done
    no backward (sharded_forward): end_forward(entries)

A source implements `open`, `again` and `aliases`; the protocol's other methods are what
a source whose parameters are at hand does: nothing.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .._core import PyTree, ShardLayout, tree_flatten
from ._entry import Entry


class ParamSource(Protocol):
    """Where the full parameters of a micro-batch's entries come from (see the module)."""

    @abstractmethod
    def open(self, entry: Entry, jit: bool) -> tuple[torch.Tensor, ...]:
        """`entry`'s full flat buffers as the forward enters them (`jit`: the unit is
        entered just in time, not before the forward)."""
        ...

    @abstractmethod
    def again(self, entry: Entry) -> tuple[torch.Tensor, ...]:
        """Inside the backward, `entry`'s full buffers once more (a recompute)."""
        ...

    @abstractmethod
    def aliases(self, entries: Sequence[Entry]) -> list[tuple[int, torch.Tensor]]:
        """The full buffers of `entries` still alive, by bucket: what a forward's outputs
        must not share memory with once it returns (they are freed, or updated in place
        by a donating step)."""
        ...

    def freed(self, entry: Entry) -> list[torch.Tensor]:
        """The full buffers `left(entry)` frees now: none, but a resharding gather's."""
        return []

    def start(self, upfront: Sequence[str]) -> None:
        """The forward starts; `upfront` are the units it enters before the loss runs."""

    def entered(self, unit: str) -> None:
        """The forward entered just-in-time `unit`."""

    def left(self, entry: Entry) -> None:
        """The forward is done with `entry` (its submodule's forward hook ran)."""

    def computes(self, entry: Entry) -> None:
        """`entry`'s submodule's forward pre-hooks have all run: its forward starts under
        whatever saved-tensor hooks they pushed (a layer's own checkpoint)."""

    def saving(self) -> AbstractContextManager[Any]:
        """Around the forward: how autograd saves tensors for the backward."""
        return contextlib.nullcontext()

    def hold(self, t: Any) -> Any:
        """What a recompute (`fzero.remat`) keeps of `t` across the forward."""
        return t

    def fetch(self, held: Any) -> Any:
        """`hold`'s value again, for the recompute."""
        return held

    def flags(self) -> list[bool]:
        """Per unit of the layout, a flag for the call check to OR over the ranks (what
        this rank's backward may need); [] for none."""
        return []

    def reduced(self, entry: Entry) -> None:
        """`entry`'s gradient is reduced: every use of its parameters is over."""

    def end_backward(self) -> None:
        """This rank's backward is over: starts what a peer's backward may still wait for."""

    def settle(self) -> None:
        """Every reduction is done: finishes and frees what is left."""

    def end_forward(self, entries: Sequence[Entry]) -> None:
        """A forward without a backward is over: frees what it entered."""


class Replica(ParamSource):
    """Stages 0-2: a unit enters as this rank's replica (identity), with no communication."""

    def __init__(self, local: tuple[torch.Tensor, ...]) -> None:
        self.local = local

    def open(self, entry: Entry, jit: bool) -> tuple[torch.Tensor, ...]:
        return tuple(self.local[i].detach() for i in entry.buckets)

    def again(self, entry: Entry) -> tuple[torch.Tensor, ...]:
        return self.open(entry, False)

    def aliases(self, entries: Sequence[Entry]) -> list[tuple[int, torch.Tensor]]:
        return list(enumerate(self.local))  # the state's own buffers


def full_buckets(params: PyTree, layout: ShardLayout) -> tuple[torch.Tensor, ...]:
    """The flat buffers a replicated tree's leaves are views of (packed afresh if not)."""
    leaves = tree_flatten(params)[0]
    out = []
    for bucket in layout.buckets:
        base = leaves[bucket.slots[0].index]._base if bucket.slots else None
        if base is None or base.numel() != bucket.full_numel or base.dtype != bucket.dtype:
            return layout.flatten(params)
        out.append(base)
    return tuple(out)


def own_slices(
    full: tuple[torch.Tensor, ...], layout: ShardLayout, rank: int
) -> tuple[torch.Tensor, ...]:
    """Views of `rank`'s slice of each full flat bucket."""
    return tuple(
        f.narrow(0, rank * b.shard_numel, b.shard_numel) for f, b in zip(full, layout.buckets)
    )
