"""UnitLedger: the live bytes of full unit parameters and gradients during a step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class UnitLedger:
    """Live bytes of full (unsharded) unit parameters and gradients, with their peaks.

    Pass one as `ledger=` to `sharded_step` to watch a step: what fzero itself holds
    beyond the shards, not activations or allocator overhead. `events` grows with every
    step the ledger watches; `clear()` between steps keeps a long run's ledger small.
    """

    live_params: int = 0
    peak_params: int = 0
    live_grads: int = 0
    peak_grads: int = 0
    events: list[tuple[str, str, int]] = field(default_factory=list)

    def clear(self) -> None:
        """Forgets the events and restarts the peaks from what lives now."""
        self.events.clear()
        self.peak_params, self.peak_grads = self.live_params, self.live_grads

    def _add(self, kind: str, unit: str, nbytes: int) -> None:
        if kind == "params":
            self.live_params += nbytes
            self.peak_params = max(self.peak_params, self.live_params)
        else:
            self.live_grads += nbytes
            self.peak_grads = max(self.peak_grads, self.live_grads)
        self.events.append((kind, unit, nbytes))


class Counted:
    """A gathered buffer in the ledger: counted from its gather until it is freed, once."""

    def __init__(self, ledger: UnitLedger, unit: str, full: torch.Tensor) -> None:
        self.ledger: UnitLedger | None = ledger
        self.unit, self.nbytes = unit, full.numel() * full.element_size()
        ledger._add("params", unit, self.nbytes)

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger._add("params", self.unit, -self.nbytes)
            self.ledger = None
