"""Dynamic loss scaling (FairScale's ShardedGradScaler, torch.amp.GradScaler) as pure state."""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _comm
from ._mesh import Mesh


class DynamicLossScale(NamedTuple):
    """How the loss scale moves; the defaults are torch.amp.GradScaler's.

    The loss is multiplied by the scale before differentiation; gradients are divided by
    it after reduction. If any rank's gradient shard holds an inf or NaN, every rank skips
    the update and the scale is multiplied by `backoff_factor`; after `growth_interval`
    clean steps in a row it is multiplied by `growth_factor`.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def init(self) -> LossScaleState:
        """The scaler state of step 0."""
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1):
            raise ValueError(
                "DynamicLossScale needs init_scale > 0, growth_factor > 1 and "
                f"0 < backoff_factor < 1, got {self}"
            )
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")
        return LossScaleState(
            torch.tensor(float(self.init_scale), dtype=torch.float32),
            torch.tensor(0, dtype=torch.int32),
            self,
        )


class LossScaleState(NamedTuple):
    """The scaler's state in a ShardedState: identical on every rank."""

    scale: torch.Tensor  # float32, 0-d
    growth_tracker: torch.Tensor  # int32, 0-d: clean steps since the last change
    config: DynamicLossScale

    def next(self, found_inf: bool) -> LossScaleState:
        """The state after a step that did (or did not) find an inf/NaN gradient.

        torch.amp.GradScaler.update's rule, so a run matches one using it step for step.
        """
        c = self.config
        if found_inf:
            scale, tracker = self.scale * c.backoff_factor, torch.zeros_like(self.growth_tracker)
        elif int(self.growth_tracker) + 1 == c.growth_interval:
            grown = self.scale * c.growth_factor
            scale = grown if torch.isfinite(grown) else self.scale
            tracker = torch.zeros_like(self.growth_tracker)
        else:
            scale, tracker = self.scale.clone(), self.growth_tracker + 1
        return LossScaleState(scale, tracker, c)


def unscale_(grads: list[torch.Tensor], scale: torch.Tensor, mesh: Mesh) -> bool:
    """Divides this rank's gradient pieces by `scale` in place; True if ANY rank found an
    inf or NaN (one all-reduce of one flag, so every rank takes the same branch)."""
    # GradScaler multiplies by the float32 reciprocal computed in double: the same bits.
    inv = scale.double().reciprocal().float()
    bad = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if g.numel():
            g.mul_(inv.to(g.dtype))
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
    return bool(_comm.all_reduce_sum(bad, mesh).item() > 0)
