"""A `fzero.optim.chain`'s state seen as its optimizer's, for torch.optim's format."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._schema import CheckpointError


def chained(opt_state: Any) -> tuple[tuple[int, ...], Any]:
    """`(where, state)`: a `chain`'s state, `(transformations' states..., optimizer's)`, as
    the optimizer's own state and its index path in the chain's (`(1,)` after one
    transformation; a chain inside a chain, deeper); any other state as `((), itself)`.

    torch.optim's format holds the optimizer's state alone: gradient clipping lives
    outside the optimizer there. A transformation before it may hold global values only
    (`ClipState.norm`: the last update's norm, a report, not something an update reads),
    which an export leaves out and an import starts from their init; per-parameter state
    (a moving average of the gradients, say) has no place in torch's format, and is
    refused, naming the transformation's state.
    """
    where: list[int] = []
    while _is_chain(opt_state):
        for k, s in enumerate(opt_state[:-1]):
            leaves = optree.tree_leaves(s, none_is_leaf=False)
            if any(isinstance(x, torch.Tensor) and x.dim() > 0 for x in leaves):
                raise CheckpointError(
                    f"the chain's transformation {k} keeps per-parameter state "
                    f"({type(s).__name__}), which torch.optim's format has no place for: "
                    "save with fzero.checkpoint.save, which keeps the whole chain"
                )
        where.append(len(opt_state) - 1)
        opt_state = opt_state[-1]
    return tuple(where), opt_state


def at(where: tuple[int, ...], path: str) -> str:
    """`path` in the optimizer's state as a path in the chain's (`walk`'s names)."""
    return ".".join([*map(str, where), path] if path else map(str, where))


def _is_chain(state: Any) -> bool:
    # A chain's tuple holds its transformations' states (NamedTuples, or None or () for a
    # stateless one) before its optimizer's; from_torch's own state, a tuple too, holds
    # one dict per piece, and fzero's optimizers' states are NamedTuples.
    return (
        type(state) is tuple
        and len(state) >= 2
        and all(
            s is None or s == () or (isinstance(s, tuple) and hasattr(s, "_fields"))
            for s in state[:-1]
        )
    )
