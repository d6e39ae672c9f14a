"""Loss weights: what each rank's losses count for in the mean.

A loss is either a scalar (the mean over its micro-batch; it counts once) or a pair
`(total, weight)`, e.g. the sum of token losses and the number of real tokens. The
step's gradient is the gradient of `sum(total) / sum(weight)` over every rank and
micro-batch: exactly one process minimising the global token mean. The engine reduces
unit gradients as a mean over ranks (and the step averages micro-batches), so with `N`
ranks and `M` micro-batches the gradient it produces is `sum(grad total) / (N * M)`,
and the step multiplies it by `N * M / sum(weight)` (exactly 1, and skipped, for scalar
losses on ranks that all had data: today's numbers, bitwise).

The ranks agree on the sums once a step (`_sync.StepSync`). A micro-batch that is None
(a rank without data) counts with weight 0 and its rank is marked absent, so that
buffers follow only the ranks that ran a forward.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .._core import LossFn, PyTree, bad_loss, check_differentiable, check_loss


class Weighed:
    """`loss_fn` as a scalar loss for differentiation, keeping each call's (total, weight).

    A pair's total is what is differentiated; a scalar counts with weight 1."""

    def __init__(self, loss_fn: LossFn, rank: int, trainable: bool = True) -> None:
        """`trainable`: the state has trainable parameters, so a loss (of weight > 0)
        without a gradient is an error."""
        self.loss_fn, self.rank, self.trainable = loss_fn, rank, trainable
        self.totals: list[torch.Tensor] = []  # detached, as returned
        self.weights: list[float] = []
        self.pairs = self.scalars = 0

    def __call__(self, params: PyTree, batch: Any) -> torch.Tensor:
        out = self.loss_fn(params, batch)
        if isinstance(out, tuple):
            if len(out) != 2:
                raise bad_loss(
                    TypeError(
                        f"rank {self.rank}: loss_fn returned a tuple of {len(out)}; it must return "
                        "a scalar loss or a pair (total, weight)"
                    )
                )
            total = check_loss(out[0], "loss_fn's total", self.rank)
            weight = _weight_value(out[1], self.rank)
            self.pairs += 1
        else:
            total, weight = check_loss(out, rank=self.rank), 1.0
            self.scalars += 1
        if self.trainable and weight > 0:
            check_differentiable(total, "loss_fn's loss", self.rank)
        self.totals.append(total.detach())
        self.weights.append(weight)
        return total

    def local_loss(self) -> torch.Tensor | None:
        """This rank's mean loss over its micro-batches (None if it had none)."""
        return torch.stack(self.totals).mean() if self.totals else None


def _weight_value(weight: Any, rank: int) -> float:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            raise bad_loss(
                ValueError(
                    f"rank {rank}: loss_fn's weight must be a real number or one-element "
                    f"tensor, got shape {tuple(weight.shape)} dtype {weight.dtype}"
                )
            )
        if weight.requires_grad:  # its gradient would be dropped: Σ total / Σ weight is not
            raise bad_loss(  # differentiated in its denominator
                ValueError(
                    f"rank {rank}: loss_fn's weight requires grad: weights are counts, "
                    "constants of the parameters (the update divides by their sum, not "
                    "differentiated); .detach() it if that is meant"
                )
            )
        if weight.is_meta:
            raise bad_loss(ValueError(f"rank {rank}: loss_fn's weight is on the meta device"))
        weight = weight.item()
    # numbers.Real takes numpy's scalars (np.int64 from a batch's length) as well; a
    # bool is a mistake more likely than a weight of 0 or 1.
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise bad_loss(
            TypeError(
                f"rank {rank}: loss_fn's weight must be a number or tensor, got "
                f"{type(weight).__name__}"
            )
        )
    w = float(weight)
    if not (math.isfinite(w) and w >= 0):
        raise bad_loss(
            ValueError(f"rank {rank}: loss_fn's weight must be finite and >= 0, got {w}")
        )
    return w
