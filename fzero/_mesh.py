"""Meshes: who the ranks are and which process group carries their collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, eq=False)
class ProcessGroupMesh:
    """The data-parallel ranks of a `torch.distributed` process group.

    Every fzero collective goes over `group` (gloo on CPU, NCCL on GPU). Under torchrun:
    `dist.init_process_group(...)` then `mesh = fzero.ProcessGroupMesh()`; `fzero.simulate`
    builds one per simulated rank.

    Args:
      group: the process group; None means the default (world) group.

    Attributes:
      rank: this process's rank within `group`.
      size: the number of ranks in `group`.
    """

    group: Any = None
    rank: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fzero.ProcessGroupMesh needs an initialised torch.distributed process group: "
                "call torch.distributed.init_process_group(...) first (torchrun sets the "
                "environment for it), or run your function under fzero.simulate(world_size, fn)."
            )
        rank = dist.get_rank(self.group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "size", dist.get_world_size(self.group))

    def __repr__(self) -> str:
        return f"ProcessGroupMesh(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    @property
    def backend(self) -> str:
        """The process group's backend name ("gloo", "nccl", ...)."""
        return str(dist.get_backend(self.group))


# The protocol the rest of fzero relies on: `.rank`, `.size`, `.group`.
Mesh = ProcessGroupMesh
