"""Process groups: set-up and tear-down, the sub-groups of a 2-D mesh, and what a peer's
failure looks like."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._axis import Axis


def agree_shard_size(shard_size: Any, world: Axis) -> int:
    """`shard_size` checked on every rank of `world` (None: all of them); a ValueError on
    every rank when it does not divide the world or the ranks disagree on it."""
    n = world.size
    mine = n if shard_size is None else shard_size
    if world.size > 1:
        out: list[Any] = [None] * n
        dist.all_gather_object(out, mine, group=world.group)
        if len(set(map(repr, out))) > 1:
            seen = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(out))
            raise ValueError(
                f"the ranks disagree on the mesh's shard_size ({seen}); "
                f"every rank must build its ProcessGroupMesh with the same shard_size"
            )
    if isinstance(mine, bool) or not isinstance(mine, int) or mine < 1 or n % mine:
        raise ValueError(
            f"rank {world.rank}: shard_size={mine!r} must be a positive int dividing the "
            f"{n} ranks (groups of shard_size consecutive ranks shard, {n}/shard_size "
            f"groups replicate)"
        )
    return mine


def _new_group(
    ranks: list[int], parent: Axis, backend: str | None = None, every: Any = None
) -> Any:
    """A group over `ranks` (global) with `parent`'s timeout: it waits as long as the
    user's group does, not torch's default for new groups (30 minutes), so a peer that
    stops calling a collective fails the others within the timeout the user chose.

    `every`: all the groups of this kind, `ranks` among them, the same list on every rank
    of `parent`. Where `parent` spans the whole job, every rank makes every one of them in
    that order, as DeviceMesh does: torch names such a group by a count every rank keeps
    alike. Otherwise only the members make theirs (a mesh over a sub-group must not need
    every process of the job), and torch names it by a count of the groups each member
    has registered, which the job's other groups may have left apart: checked first."""
    timeout = timeout_of(parent.group)
    if every is not None and parent.size == dist.get_world_size():
        made = [(g, dist.new_group(g, backend=backend, timeout=timeout)) for g in every]
        return next(group for g, group in made if g == ranks)
    _check_names(parent)
    return dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)


def _check_names(parent: Axis) -> None:
    """Raises on every rank of `parent` where its ranks have registered different numbers
    of process groups: the members of a group made with local synchronization would name
    it apart (torch hashes that count in) and wait for each other until the timeout."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if parent.size == 1 or names is None:
        return
    counts: list[Any] = [None] * parent.size
    dist.all_gather_object(counts, len(names), group=parent.group)
    if len(set(counts)) > 1:
        raise ValueError(
            f"rank {parent.rank}: the mesh's ranks have made different numbers of process "
            f"groups ({counts}, by rank), and torch would name the groups this mesh makes "
            "over them apart (a hang until the timeout). Build fzero's meshes first, or "
            "over the whole job, or make the same groups on each of its ranks"
        )


def timeout_of(group: Any) -> timedelta | None:
    """How long `group`'s collectives wait for a peer, or None where torch does not say."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:  # private but stable since torch 2.0: every c10d backend has options._timeout
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def backend_for(group: Any, device: torch.device) -> str | None:
    """The backend `group` runs collectives of `device`'s tensors on ("gloo", "nccl", ...),
    or None if it has none for that device type.

    What the group really does for that device, not its name: a mixed group
    ("cpu:gloo,cuda:nccl") sends CPU tensors to gloo and CUDA tensors to NCCL, and plain
    "gloo" takes CUDA tensors too (staged through the host).
    """
    pg = group if group is not None else dist.group.WORLD
    try:  # ProcessGroup's per-device-type backend (torch >= 2.0; fzero needs 2.5)
        return str(pg._get_backend(device).name()).lower()
    except RuntimeError:  # "No backend type associated with device type ..."
        return None


def mesh_device(group: Any, device: Any) -> torch.device:
    """The device a mesh's tensors live on: `device` if given (checked against what the
    group supports), else the current CUDA device when the group runs CUDA tensors on a
    GPU backend (NCCL), else the CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: torch sees no CUDA device on this machine")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if backend_for(group, dev) is None:
            raise ValueError(
                f"device={device!r}: the process group (backend {dist.get_backend(group)!r}) "
                f"has no backend for {dev.type} tensors"
            )
        return dev
    gpu_backend = torch.cuda.is_available() and backend_for(group, torch.device("cuda"))
    if gpu_backend and gpu_backend != "gloo":  # gloo takes CUDA tensors, but by the host
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def control_group(world: Axis) -> Any:
    """A group over `world`'s ranks that carries CPU tensors: agreement checks and loss
    weights are a few host values, and sending them from the CPU (gloo) keeps the host
    from waiting for the GPU. `world`'s own group when it has a CPU backend (gloo, or a
    mixed "cpu:gloo,cuda:nccl"), else a new gloo group (collective over `world`)."""
    if world.size == 1 or backend_for(world.group, torch.device("cpu")) is not None:
        return world.group
    ranks = [world.global_rank(r) for r in range(world.size)]
    return _new_group(ranks, world, backend="gloo", every=[ranks])


def twin_group(axis: Axis) -> Any:
    """A second group over `axis`'s ranks for its gloo reductions (`Axis.twin`), or None
    where it has no gloo backend for CPU tensors or one rank (collective over `axis`)."""
    if axis.size == 1 or backend_for(axis.group, torch.device("cpu")) != "gloo":
        return None
    ranks = [axis.global_rank(r) for r in range(axis.size)]
    return _new_group(ranks, axis, backend="gloo", every=[ranks])


def new_axes(world: Axis, s: int) -> tuple[Any, Any]:
    """The process groups of a 2-D mesh for this rank: its group of `s` consecutive ranks
    of `world` (the shard axis) and the ranks at its place in every group (replicas)."""
    g, i = divmod(world.rank, s)
    n = world.size // s
    shards = [[world.global_rank(h * s + j) for j in range(s)] for h in range(n)]
    replicas = [[world.global_rank(h * s + j) for h in range(n)] for j in range(s)]
    shard = _new_group(shards[g], world, every=shards)
    return shard, _new_group(replicas[i], world, every=replicas)


def new_secondary(shard: Axis, k: int) -> Axis:
    """hpZ's axis: this rank's `k` consecutive ranks inside its `shard` group; every rank
    of the group must ask for the same `k` (a ValueError on every rank otherwise)."""
    out: list[Any] = [None] * shard.size
    dist.all_gather_object(out, k, group=shard.group)
    if len(set(map(repr, out))) > 1 or not isinstance(k, int) or k < 1 or shard.size % k:
        raise ValueError(
            f"reshard_after_forward must be the same int dividing "
            f"the {shard.size} ranks that shard on every rank (got {out})"
        )
    g, j = divmod(shard.rank, k)
    every = [[shard.global_rank(h * k + m) for m in range(k)] for h in range(shard.size // k)]
    return Axis("secondary", _new_group(every[g], shard, every=every), j, k)


def new_secondary_peers(shard: Axis, k: int) -> Axis:
    """The ranks at this rank's place in every group of `k` (`new_secondary`'s) of its
    `shard` group, one from each: a compiled hpZ step gathers a unit over them first,
    then over its group of k (collective over `shard`'s ranks, k already agreed)."""
    g, j = divmod(shard.rank, k)
    groups = shard.size // k
    every = [[shard.global_rank(h * k + m) for h in range(groups)] for m in range(k)]
    return Axis("shard", _new_group(every[j], shard, every=every), g, groups)


# What gloo and NCCL say when a peer never arrives or has gone (their errors are plain
# RuntimeErrors as often as torch.distributed.DistError).
_PEER_GONE = (
    "timeout",
    "timed out",
    "closed by peer",
    "connection reset",
    "pair closure",
    "broken pipe",
    "nccl communicator was aborted",
)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because a peer is late, stuck or gone."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc).lower() for s in _PEER_GONE)


def is_initialized() -> bool:
    """Whether this process has a default process group."""
    return dist.is_available() and dist.is_initialized()


def init_process_group(
    backend: str,
    timeout: float,
    *,
    store_file: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Starts the default process group: from torchrun's environment, or (`store_file`,
    `rank`, `world_size`) from a file store that every rank of one machine shares."""
    if store_file is None:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        return
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )


def destroy_process_group() -> None:
    """Tears down the default process group."""
    dist.destroy_process_group()
