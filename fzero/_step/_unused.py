"""Trainable parameters no rank's loss used in a step function's first step, said once.

torch.optim skips a parameter whose `.grad` is None; fzero's flat buckets give it a zero
gradient (as FSDP's flat parameters and DeepSpeed do), so AdamW still decays it and
momentum still moves it. A parameter the loss never uses (a pooler under a loss on the
hidden states) is almost always meant to be frozen: saying so at the first step with
data somewhere (before it, no gradient reached anything), when the ranks agree on the
rest of their configuration, costs one small exchange once.
"""

from __future__ import annotations

import warnings

from .. import _comm
from .._comm import Mesh
from .._core import ShardLayout

SHOWN = 8  # leaves named in the warning; the rest are counted


def say_unused(used: set[int], layout: ShardLayout, mesh: Mesh) -> list[str]:
    """Warns, on every rank, of the trainable leaves no rank's gradient reached (`used`:
    those that this rank's did); collective (one all-gather of a bit per leaf, on the
    control axis). Returns their paths."""
    n = len(layout.paths)
    everyone = _comm.all_gather_ints_async(_comm.pack_flags([i in used for i in range(n)]), mesh)()
    reached = [any(f) for f in zip(*(_comm.unpack_flags(w, n) for w in everyone))]
    nowhere = [i for i in range(n) if not (layout.frozen[i] or reached[i])]
    paths = [layout.paths[i] for i in nowhere]
    if paths:
        more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
        warnings.warn(
            f"fzero: rank {mesh.rank}: no rank's loss used {len(paths)} trainable "
            f"parameter(s) in this step function's first step with data: {paths[:SHOWN]}"
            f"{more}. fzero steps them with a zero gradient (AdamW decays them, momentum "
            "moves them) where "
            "torch.optim would skip a .grad of None: freeze them (shard_state(frozen=...)) "
            "if the loss never uses them (a layer computing their gradient itself, "
            "calling .backward() inside its backward as Reformer's reversible layers do, "
            "is refused given module=). Said once",
            RuntimeWarning,
            stacklevel=4,
        )
    return paths
