"""The ZeRO stages as data: what each one shards and communicates, stated once.

| stage | holds | optimizer of | a unit enters as | its VJP | grads held | after update |
|---|---|---|---|---|---|---|
| 0 | full tree | full tree | replica (identity) | all-reduce | buckets | nothing |
| 1 | full tree | its shard | replica (identity) | reduce-scatter | buckets | all-gather |
| 2 | full tree | its shard | replica (identity) | reduce-scatter | one unit | all-gather |
| 3 | its shard | its shard | all-gather of shards | reduce-scatter | one unit | nothing |

Reductions are means over ranks.
Everything that differs between stages is read from here (`Stage`), never from the
number: the step, the state, the checkpoints and the precision rules ask a `Stage`.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Stage(NamedTuple):
    """One row of the stage table.

    Attributes:
      number: 0-3.
      params: what a rank holds between steps: "replicated" (the full parameter tree) or
        "sharded" (its `Shards`).
      optimizer: whose optimizer state (and mixed-precision masters) a rank keeps:
        "replicated" (the full tree's) or "sharded" (its shard's).
      enter: how a unit's parameters enter the loss: "identity" (the rank's replica) or
        "all_gather" (of every rank's shard).
      reduce: the transpose over ranks that `enter`'s gradient goes through: "all_reduce"
        (mean; every rank keeps it all) or "reduce_scatter" (mean; a rank keeps its shard).
      grads: the full gradients a rank lets the backward hold: "buckets" (reductions start
        `reduce_bucket_bytes` at a time, as DDP's buckets) or "unit" (a unit's gradient is
        reduced as soon as it is complete).
      after: what follows the update: "nothing", or "all_gather" (every rank's updated
        shard, into the replicated parameters).
      like: the wrapper it stands for.
    """

    number: int
    params: str
    optimizer: str
    enter: str
    reduce: str
    grads: str
    after: str
    like: str

    @property
    def shards_params(self) -> bool:
        return self.params == "sharded"

    @property
    def shards_optimizer(self) -> bool:
        return self.optimizer == "sharded"

    @property
    def regathers(self) -> bool:
        """Whether parameters travel through an all-gather after every update (so the loss
        sees them rounded through the gather dtype from the first step)."""
        return self.after == "all_gather"


STAGES = (
    Stage(0, "replicated", "replicated", "identity", "all_reduce", "buckets", "nothing", "DDP"),
    Stage(1, "replicated", "sharded", "identity", "reduce_scatter", "buckets", "all_gather", "OSS"),
    Stage(2, "replicated", "sharded", "identity", "reduce_scatter", "unit", "all_gather", "SDP"),
    Stage(3, "sharded", "sharded", "all_gather", "reduce_scatter", "unit", "nothing", "FSDP"),
)


def stage_of(stage: Any) -> Stage:
    """The `Stage` numbered `stage`; ValueError unless it is 0, 1, 2 or 3."""
    if isinstance(stage, Stage):
        return stage
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in range(len(STAGES)):
        raise ValueError(f"stage must be one of 0, 1, 2, 3 (ZeRO stages), got {stage!r}")
    return STAGES[stage]


def gathers_to_compute(stage: Any) -> bool:
    """Whether a forward at `stage` (a number or `Stage`) gathers parameters; True for
    what is not a stage, whose call then raises its own error."""
    try:
        return stage_of(stage).shards_params
    except ValueError:
        return True
