"""Micro-batches: a step's batch cut into the micro-batches it accumulates over."""

from __future__ import annotations

from typing import Any


def micro_batches(batch: Any, accumulate: str | None, last: int | None) -> list[Any]:
    """The step's micro-batches (None: this rank has no data for that one).

    Args:
      batch: what the step was given: one batch, or with `accumulate` a list of them;
        None for a rank without data.
      accumulate: the step's `accumulate=` option.
      last: how many micro-batches the last step had (None: no step yet), which a rank
        without data repeats.

    Returns:
      The micro-batches, in order.
    """
    if accumulate is None:
        return [batch]
    if batch is None:  # no data at all: as many empty micro-batches as last step
        if last is None:
            raise ValueError(
                f"with accumulate={accumulate!r}, step(state, None) repeats the number of "
                "micro-batches of the last step, and there was none: pass [None] * M"
            )
        return [None] * last
    if not isinstance(batch, list) or not batch:
        # Not a tuple: (x, y) is what one micro-batch looks like, and taken for two
        # micro-batches x and y it may even run, training on the wrong data.
        hint = (
            " (a tuple reads as one micro-batch's fields, such as (x, y): pass [batch], or "
            "a list of micro-batches)"
            if isinstance(batch, tuple)
            else ""
        )
        raise TypeError(
            f"with accumulate={accumulate!r} a step takes a non-empty list of micro-batches, "
            f"got {type(batch).__name__}{hint}"
        )
    return list(batch)
