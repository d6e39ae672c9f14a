"""Meshes: who the ranks are, how they are arranged, and which process groups carry what.

A mesh of N ranks may be two-dimensional: groups of `shard_size` = S consecutive ranks
(a node, typically) shard the state among themselves, and the N / S groups hold
replicas of it (FSDP2's HSDP). Three axes name the process groups collectives run on:

| axis | ranks | carries |
|---|---|---|
| `world` | all N | data-parallel collectives over everyone (loss scaler flags) |
| `control` | all N | host values (agreement checks, loss weights) on a CPU backend |
| `shard` | the S of this rank's group | all-gathers of shards, reduce-scatters of gradients |
| `replica` | the N / S holding this rank's shard | the all-reduce of a reduced shard |

On gloo the shard axis has a twin: a second group over the same ranks that carries its
reductions as collectives (`Axis.twin`), apart from the gathers, which a stage-3 backward
interleaves with them in an order that may differ between ranks.

S = N (the default) is a one-dimensional mesh: the shard axis is the world and the
replica axis has one rank. `mesh.rank` and `mesh.size` stay the data-parallel ones
(which batch is this rank's); the layout of a state asks for `shard_rank`/`shard_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from . import _groups
from ._axis import Axis


@dataclass(frozen=True, eq=False)
class ProcessGroupMesh:
    """The data-parallel ranks of a `torch.distributed` process group.

    Every fzero collective goes over `group` or its sub-groups (gloo on CPU, NCCL on GPU).
    Under torchrun: `dist.init_process_group(...)` then `mesh = fzero.ProcessGroupMesh()`;
    `fzero.simulate` builds one per simulated rank.

    Args:
      group: the process group; None means the default (world) group.
      shard_size: S, the number of consecutive ranks that shard the state among
        themselves (a node); the N / S groups replicate it (hybrid sharding). None means
        N: every rank shards. Must divide N and be the same on every rank (a ValueError
        on every rank otherwise). Creating the sub-groups is collective: every rank of
        `group` builds its mesh together.
      device: the mesh's device: where `checkpoint.load` builds a state unless told
        otherwise (`shard_state` keeps the parameters' own device). None: the current
        CUDA device (`torch.cuda.set_device(local_rank)` first) when the group runs CUDA
        tensors on a GPU backend (NCCL), else the CPU. The group must have a backend for
        it: gloo takes CPU and CUDA tensors (one GPU shared by simulated ranks), NCCL
        CUDA ones; a ValueError otherwise.

    Attributes:
      rank, size: this process's rank within `group`, and the number of ranks (N).
      shard_rank, shard_size: its place in its group of S, and S.
      replica_rank, replicas: which group it is in, and N / S.
      device: the resolved `torch.device`.
      world, shard, replica, control: the axes (see the module docstring); `control`
        is over the world's ranks on a backend for CPU tensors (the world's own group
        unless that is NCCL alone, then a gloo group beside it).
    """

    group: Any = None
    shard_size: int | None = None
    device: Any = None
    rank: int = field(init=False)
    size: int = field(init=False)
    world: Axis = field(init=False, repr=False)
    shard: Axis = field(init=False, repr=False)
    replica: Axis = field(init=False, repr=False)
    control: Axis = field(init=False, repr=False)
    _secondary: dict[int, Axis] = field(init=False, repr=False)
    _peers: dict[int, Axis] = field(init=False, repr=False)

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
        n = dist.get_world_size(self.group)
        world = Axis("world", self.group, rank, n)
        device = _groups.mesh_device(self.group, self.device)
        control = Axis("control", _groups.control_group(world), rank, n)
        s = _groups.agree_shard_size(self.shard_size, control)
        set_ = object.__setattr__
        set_(self, "device", device)
        set_(self, "control", control)
        set_(self, "rank", rank)
        set_(self, "size", n)
        set_(self, "shard_size", s)
        set_(self, "world", world)
        set_(self, "_secondary", {})
        set_(self, "_peers", {})
        if s == n:
            shard = Axis("shard", self.group, rank, n)
            set_(self, "replica", Axis("replica", None, 0, 1))
        else:
            shard_group, replica_group = _groups.new_axes(world, s)
            shard = Axis("shard", shard_group, rank % s, s)
            set_(self, "replica", Axis("replica", replica_group, rank // s, n // s))
        set_(self, "shard", shard._replace(twin=_groups.twin_group(shard)))

    def __repr__(self) -> str:
        shape = "" if self.replicas == 1 else f", shard_size={self.shard_size}"
        return (
            f"ProcessGroupMesh(rank={self.rank}, size={self.size}{shape}, "
            f"backend={self.backend!r}, device={str(self.device)!r})"
        )

    @property
    def shard_rank(self) -> int:
        return self.shard.rank

    @property
    def replica_rank(self) -> int:
        return self.replica.rank

    @property
    def replicas(self) -> int:
        return self.replica.size

    @property
    def backend(self) -> str:
        """The process group's backend name ("gloo", "nccl", ...)."""
        return str(dist.get_backend(self.group))

    def secondary(self, k: int) -> Axis:
        """The axis of this rank's k consecutive ranks inside its shard group (hpZ's
        secondary copy). Made on first use, collectively: every rank asks for the same k
        in the same order (a step does, on its first call)."""
        if k not in self._secondary:
            if k == self.shard_size:
                self._secondary[k] = self.shard._replace(name="secondary")
            else:
                self._secondary[k] = _groups.new_secondary(self.shard, k)
        return self._secondary[k]

    def secondary_peers(self, k: int) -> Axis:
        """The axis of the ranks at this rank's place in each group of k of its shard
        group (`secondary(k)`'s groups), one rank from each: a compiled hpZ step gathers
        a unit along it, then along `secondary(k)`, so that the backward's gather is the
        second alone. Made on first use, collectively, after `secondary(k)`."""
        if k not in self._peers:
            self.secondary(k)  # made first, in one order on every rank (k agreed there)
            if k == 1:
                self._peers[k] = self.shard
            elif k == self.shard_size:
                self._peers[k] = Axis("shard", None, 0, 1)
            else:
                self._peers[k] = _groups.new_secondary_peers(self.shard, k)
        return self._peers[k]


# The protocol the rest of fzero relies on: `.rank`, `.size`, `.group` and the axes.
Mesh = ProcessGroupMesh
