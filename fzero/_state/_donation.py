"""Donation: the states a donating step has consumed, refused wherever they come back."""

from __future__ import annotations

import weakref
from typing import Protocol


class _State(Protocol):
    """What donation needs of a state: its identity, and its step count for messages."""

    step: int


# States a donating step has consumed. Their buffers were updated in place and belong to
# the state that step returned: a second step from one would train on those values under
# the old step count (Adam's bias correction, schedules), silently. JAX deletes a donated
# array for the same reason. Held weakly: a consumed state is forgotten once dropped.
_consumed: dict[int, weakref.ref[_State]] = {}


def mark_consumed(state: _State) -> None:
    """Records that a donating step has taken `state` (see `check_live`)."""
    key = id(state)
    _consumed[key] = weakref.ref(state, lambda _: _consumed.pop(key, None))


def check_live(state: _State, rank: int, what: str) -> None:
    """Raises a ValueError if a donating step has consumed `state` (`mark_consumed`)."""
    ref = _consumed.get(id(state))
    if ref is not None and ref() is state:
        raise ValueError(
            f"rank {rank}: {what}: this state (step {state.step}) was already donated to a "
            "step, which updated its buffers in place: use the state that step returned, or "
            "make the step with donate=False to keep states reusable"
        )
