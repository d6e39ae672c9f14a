"""Axis: one dimension of a mesh, a process group and this rank's place in it."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.distributed as dist


class Axis(NamedTuple):
    """One axis of a mesh: a process group and this rank's place in it.

    Attributes:
      name: "world", "shard" (also a part of it: a compiled hpZ step's gather across
        the groups of k), "replica", "control" or "secondary" (hpZ's in-group copy);
        the communication ledger files bytes under it.
      group: the process group (None: the default group).
      rank: this rank's index along the axis.
      size: the number of ranks along it.
      twin: a second gloo group over the same ranks, for reductions that run as gloo
        collectives (None: there are none, they pair by their own message tags). Gloo
        pairs a group's collectives by the order they start in, and a stage-3 backward
        may start a re-gather and a reduction in either order on different ranks.
    """

    name: str
    group: Any
    rank: int
    size: int
    twin: Any = None

    def global_rank(self, r: int) -> int:
        """The default group's rank of this axis's rank `r`."""
        return dist.get_global_rank(self.group, r) if self.group is not None else r
