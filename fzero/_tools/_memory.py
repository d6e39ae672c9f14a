"""Model-state memory per rank: the ZeRO paper's arithmetic, and bytes measured on a state."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._core import stage_of, tree_nbytes
from .._state import ShardedState, compute_device, offloaded_bytes, offloaded_param_bytes


class MemoryEstimate(NamedTuple):
    """Bytes per rank of each kind of model state."""

    params: float
    grads: float
    opt_state: float  # what stays on the device
    host: float = 0.0  # optimizer state (masters included) offloaded to host memory,
    # and parameter shards there (`params_offload`)
    disk: float = 0.0  # optimizer state offloaded to disk

    @property
    def total(self) -> float:
        """The bytes on the device."""
        return self.params + self.grads + self.opt_state


def estimate_memory(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optim_bytes: float = 12,
    offload: str | None = None,
    fraction: float = 1.0,
    params_offload: bool = False,
) -> MemoryEstimate:
    """Model-state bytes per rank for ZeRO `stage` (ZeRO, arXiv 1910.02054, section 5).

    Stage 0 keeps everything; stage 1 shards the optimizer state, stage 2 also the
    gradients, stage 3 also the parameters. Defaults are mixed-precision Adam (2-byte
    params and grads, 12 bytes of fp32 master weights and moments); plain fp32 Adam is
    `param_bytes=4, grad_bytes=4, optim_bytes=8`. Padding (< world_size elements per
    buffer) is not counted. Under `fzero.Precision`, fzero's stage 3 keeps no compute-dtype
    shard beside the masters (its shards are them, cast as they are gathered): for it,
    `param_bytes=0`.

    Args:
      num_params: Ψ, the number of parameters.
      world_size: N, the number of ranks the state is sharded over: on a 2-D mesh
        (HSDP) its shard size S, not the number of ranks (as `fzero estimate
        --shard-size S` counts it).
      stage: 0-3.
      param_bytes: bytes per parameter as held for compute.
      grad_bytes: bytes per gradient element.
      optim_bytes: bytes of optimizer state per parameter.
      offload: "host" or "disk": `fraction` of the optimizer state (masters included)
        leaves the device (ZeRO-Offload, ZeRO-Infinity; stages 1-3). With it fzero's
        stage 3 keeps a compute-dtype shard on the device beside the offloaded masters:
        `param_bytes` counts it.
      fraction: the offloaded share, in (0, 1].
      params_offload: stage 3 with `offload`: that share of the parameter shards on the
        host too (`Offload(params=True)`; the device keeps none of them between gathers).
        Under `Precision` the host keeps them beside the masters, in the compute dtype;
        without it (the host tier) they are the masters: `param_bytes=0` then.

    Returns:
      A MemoryEstimate: `.total` sums what stays on the device; `host` or `disk` what
      leaves it.
    """
    spec = stage_of(stage)
    if world_size < 1 or num_params < 0:
        raise ValueError("need world_size >= 1 and num_params >= 0")
    if offload is not None:
        if offload not in ("host", "disk"):
            raise ValueError(f"offload is 'host' or 'disk', got {offload!r}")
        if not 0 < fraction <= 1:
            raise ValueError(f"the offloaded fraction must be in (0, 1], got {fraction}")
        if not spec.shards_optimizer:
            raise ValueError("offload needs stage 1, 2 or 3")
    if params_offload and (offload is None or not spec.shards_params):
        raise ValueError("params_offload needs offload= and stage 3")
    per = num_params / world_size
    opt = (per if spec.shards_optimizer else num_params) * optim_bytes
    off = 0.0 if offload is None else opt * fraction
    # The paper's gradient arithmetic: stage 1 holds full gradients through the backward
    # (they are reduced in buckets), stages 2-3 one unit's at a time besides the shard.
    params = (per if spec.shards_params else num_params) * param_bytes
    moved = params * fraction if params_offload else 0.0
    return MemoryEstimate(
        params=params - moved,
        grads=(per if spec.grads == "unit" else num_params) * grad_bytes,
        opt_state=opt - off,
        host=(off if offload == "host" else 0.0) + moved,
        disk=off if offload == "disk" else 0.0,
    )


class MemoryReport(NamedTuple):
    """Bytes one rank really holds in a ShardedState (tensor storages, each counted once),
    and, for a state on a CUDA device, what the caching allocator says of that device.

    Attributes:
      params: bytes of the parameters (stage 3: this rank's shards; under mixed
        precision, only those without masters, the frozen ones: the others are their
        masters, counted in `opt_state`).
      opt_state: bytes of the optimizer state, masters included.
      device: the state's device.
      allocated, peak_allocated, reserved: `torch.cuda.memory_allocated`,
        `max_memory_allocated` (since the last `torch.cuda.reset_peak_memory_stats`) and
        `memory_reserved` of that device: what a step really needs, gradients, gathered
        units and communication buffers included. None off CUDA.
      host, disk: the part of `opt_state` (masters and optimizer state) offloaded to
        host memory or to disk (`shard_state(offload=)`), and in `host` the parameter
        shards held there beside their masters (`Offload(params=True)`); 0 without
        offload.
      buffers: bytes of the state's buffers (whole on every rank: a rotary table, a
        causal mask, BatchNorm's statistics) and of its loss scaler.
    """

    params: int
    opt_state: int
    device: torch.device | None = None
    allocated: int | None = None
    peak_allocated: int | None = None
    reserved: int | None = None
    host: int = 0
    disk: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.opt_state + self.buffers

    @property
    def on_device(self) -> int:
        """The bytes held on the device: the total less what is offloaded."""
        return self.total - self.host - self.disk


def memory_report(state: ShardedState) -> MemoryReport:
    """Measures the bytes of the parameters, optimizer state and buffers this rank holds.

    Under mixed precision `opt_state` includes the master copies, as in ZeRO's
    arithmetic. Gradients are not part of a state between steps (fzero's steps hold them only inside
    the step); measure them on what `reduce_scatter_grads` / `all_reduce_grads` return.

    Args:
      state: a ShardedState.

    Returns:
      A MemoryReport.
    """
    # Master copies are optimizer state in ZeRO's accounting (12 bytes per parameter for
    # mixed-precision Adam: fp32 master, momentum and variance).
    opt = tree_nbytes((state.opt_state, state.master))
    # Stage 3's trainable shards under mixed precision are the masters (one storage):
    # counted once, as masters; `params` is then what only the parameters hold.
    params = tree_nbytes((state.params, state.opt_state, state.master)) - opt
    device = compute_device(state)
    off = offloaded_bytes(state)
    tier = None if state.offload is None else state.offload.offload.to
    host = (off if tier == "host" else 0) + offloaded_param_bytes(state)
    held = (state.params, state.opt_state, state.master)
    buffers = tree_nbytes((*held, state.buffers, state.scaler)) - tree_nbytes(held)
    disk = off if tier == "disk" else 0
    report = MemoryReport(params, opt, device, host=host, disk=disk, buffers=buffers)
    if device is None or device.type != "cuda":
        return report
    return report._replace(
        allocated=torch.cuda.memory_allocated(device),
        peak_allocated=torch.cuda.max_memory_allocated(device),
        reserved=torch.cuda.memory_reserved(device),
    )


def profiled_bytes(prof: torch.profiler.profile) -> tuple[int, int]:
    """`(peak, end)`: the most bytes of the allocations a profile (`profile_memory=True`)
    recorded alive at once, and those alive at its end, from the allocator's own events
    (what `torch.cuda.max_memory_allocated` sums on a GPU). Frees of tensors made before
    the profile are not counted. For the tests and benchmarks that measure memory apart
    from fzero's accounting.

    The profiler records the threads it profiles only: a free on another (gloo drops a
    collective's buffer on its worker thread when that thread holds the last reference)
    goes unseen. An allocation at an address still counted shows such a free, and is
    taken as one; a buffer freed unseen and never reused stays counted."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.ptr, f.alloc_size))
        stack.extend(node.children)
    sizes: dict[int, int] = {}
    now = peak = 0
    for _, ptr, size in sorted(events):
        if size > 0:
            now += size - sizes.get(ptr, 0)
            sizes[ptr] = size
        elif ptr in sizes:
            now -= sizes.pop(ptr)
        peak = max(peak, now)
    return peak, now
