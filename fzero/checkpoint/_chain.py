"""A `fzero.optim.chain`'s state seen as its optimizer's, for torch.optim's format."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._schema import CheckpointError


def chained(opt_state: Any) -> tuple[str, Any]:
    """`(prefix, state)`: a `chain`'s state, `(transformations' states..., optimizer's)`,
    as the optimizer's own state and the prefix of its paths in the chain's ("1." after
    one transformation); any other state as `("", itself)`.

    torch.optim's format holds the optimizer's state alone: gradient clipping lives
    outside the optimizer there. A transformation before it may hold global values only
    (`ClipState.norm`: the last update's norm, a report, not something an update reads),
    which an export leaves out and an import starts from their init; per-parameter state
    (a moving average of the gradients, say) has no place in torch's format, and is
    refused, naming the transformation's state.
    """
    # A chain's tuple holds NamedTuples before its optimizer's state; from_torch's own
    # state (also a tuple) holds one dict per piece, and fzero's optimizers' are NamedTuples.
    if not (
        type(opt_state) is tuple
        and len(opt_state) >= 2
        and all(isinstance(s, tuple) and hasattr(s, "_fields") for s in opt_state[:-1])
    ):
        return "", opt_state
    for k, s in enumerate(opt_state[:-1]):
        leaves = optree.tree_leaves(s, none_is_leaf=False)
        wide = [x for x in leaves if not isinstance(x, torch.Tensor) or x.dim() > 0]
        if wide:
            raise CheckpointError(
                f"the chain's transformation {k} keeps per-parameter state "
                f"({type(s).__name__}), which torch.optim's format has no place for: "
                "save with fzero.checkpoint.save, which keeps the whole chain"
            )
    return f"{len(opt_state) - 1}.", opt_state[-1]
