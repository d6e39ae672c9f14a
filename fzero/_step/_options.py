"""The step's options for hybrid meshes: hpZ's secondary axis and quantized communication."""

from __future__ import annotations

from typing import Any

import torch

from .._comm import Axis, Mesh, QuantizedComm, all_reduce_sum
from .._core import Shards


def check_quantize(quantize: Any, stage: int) -> None:
    if quantize is None:
        return
    if not isinstance(quantize, QuantizedComm):
        raise TypeError(f"quantize must be a fzero.QuantizedComm, got {quantize!r}")
    quantize.check()
    if quantize.weights and stage != 3:
        raise ValueError(
            f"QuantizedComm(weights=True) quantizes stage 3's per-unit parameter all-gathers "
            f"(qwZ); stage {stage} has none (its parameters are gathered once after the "
            f"update, into the replicas the optimizer reads): use weights=False"
        )
    if quantize.grads and stage == 0:
        raise ValueError(
            "QuantizedComm(grads=True) quantizes gradient reduce-scatters (qgZ, stages 1-3); "
            "stage 0 all-reduces: use stage >= 1 or grads=False"
        )


def check_finite(grads: Any, mesh: Mesh, step: int) -> None:
    """qgZ without a loss scaler: a non-finite gradient fails every rank, not one.

    Int8 blocks carry inf or NaN as NaN to whichever rank owns them; that rank alone
    would see it, so the ranks compare (one small all-reduce and a host sync per step).
    """
    if not isinstance(grads, Shards):
        return
    # One flag for every buffer, so one host sync (below) rather than one per buffer.
    bad = sum((~torch.isfinite(g)).any().double() for g in grads.buffers if g.numel())
    flags = all_reduce_sum(
        torch.as_tensor(bad, dtype=torch.float64).clamp(max=1).view(1), mesh, control=True
    )
    if flags.item():
        raise ValueError(
            f"rank {mesh.rank}: step {step}: the gradients hold inf or NaN after the quantized "
            f"reduction (QuantizedComm(grads=True)) on {int(flags.item())} rank(s); without "
            f"a loss scaler the step cannot skip it. Find the overflow, use a "
            f"DynamicLossScale, or turn qgZ off"
        )


def secondary_axis(reshard: Any, stage: int, mesh: Mesh) -> Axis | None:
    """hpZ's axis for an int `reshard_after_forward` (None for a bool)."""
    if isinstance(reshard, bool):
        return None
    if not isinstance(reshard, int):
        raise TypeError(f"reshard_after_forward must be a bool or an int, got {reshard!r}")
    if stage != 3:
        raise ValueError(
            f"reshard_after_forward={reshard} (hpZ's secondary copy) is for stage 3, whose "
            f"parameters are sharded; this step is stage {stage}"
        )
    return mesh.secondary(reshard)
