"""UnitLedger: the live bytes of full unit parameters and gradients during a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class UnitLedger:
    """Live bytes of full (unsharded) unit parameters and gradients, with their peaks.

    Pass one as `ledger=` to `sharded_step` to watch a step: what fzero itself holds
    beyond the shards, not activations or allocator overhead.
    """

    live_params: int = 0
    peak_params: int = 0
    live_grads: int = 0
    peak_grads: int = 0
    events: list[tuple[str, str, int]] = field(default_factory=list)

    def _add(self, kind: str, unit: str, nbytes: int) -> None:
        if kind == "params":
            self.live_params += nbytes
            self.peak_params = max(self.peak_params, self.live_params)
        else:
            self.live_grads += nbytes
            self.peak_grads = max(self.peak_grads, self.live_grads)
        self.events.append((kind, unit, nbytes))
