"""Aux: a loss's auxiliary outputs (`sharded_step(has_aux=True)`, JAX's `has_aux`), split
from what the step differentiates and handed back detached, one per micro-batch."""

from __future__ import annotations

from typing import Any

import torch

from .._core import LossFn, PyTree, bad_loss, tree_map, unaliased


class Aux:
    """`loss_fn` returning `(output, aux)`, called with whatever the step's other wrappers
    pass it: returns `output` (what `loss_fn` returns without `has_aux`: a scalar, a pair
    `(total, weight)`, or with buffers `(loss, new_buffers)`) and keeps `aux`, one per
    call, its tensors detached (they would otherwise hold the forward's graph) and copied
    where they share memory with the state (`owned`: its parameters and masters, which a
    parameter returned as it is shares, and the step then updates in place)."""

    def __init__(self, loss_fn: LossFn, rank: int, owned: tuple[PyTree, ...] = ()) -> None:
        self.loss_fn, self.rank, self.owned = loss_fn, rank, owned
        self.kept: list[Any] = []

    def __call__(self, *args: Any) -> Any:
        out = self.loss_fn(*args)
        if not (isinstance(out, tuple) and len(out) == 2):
            got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
            raise bad_loss(
                TypeError(
                    f"rank {self.rank}: with has_aux=True loss_fn must return (output, aux), "
                    f"output being what it returns without has_aux; got {got}"
                )
            )
        output, aux = out
        self.kept.append(tree_map(_detached, unaliased(aux, *self.owned)))
        return output

    def handed(self, micro: list[Any], accumulating: bool) -> Any:
        """The step's aux: with accumulation a list, per micro-batch in order (None for one
        this rank had no data for); otherwise the one micro-batch's (None: no data)."""
        kept = iter(self.kept)
        per = [None if mb is None else next(kept, None) for mb in micro]
        return per if accumulating else per[0]


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x
