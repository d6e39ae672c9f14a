"""What a compiled step takes: the options it does not compile yet (refused), and the
micro-batches every rank must bring, since the graph runs its collectives inside it."""

from __future__ import annotations

from typing import Any

from .. import _comm
from .._comm import Mesh


def check(o: Any, hooks: bool = False) -> None:
    """What this slice of compiled steps takes (`o`: the step's options, checked on its
    first step, every rank's error agreed; `hooks`: whether `module=`'s trained
    parameters have gradient hooks); a ValueError naming what it does not."""
    refused = {
        "ledger=": o.ledger is not None,
        "gradient hooks on module='s parameters (Tensor.register_hook)": hooks,
    }
    said = [what for what, bad in refused.items() if bad]
    if said:
        raise ValueError(
            f"rank {o.mesh.rank}: sharded_step(compile=...) does not yet compile a step with "
            f"{', '.join(said)}; step eagerly (compile=False) for those"
        )


def agree_present(micro: list[Any], mesh: Mesh, stands_in: bool = False) -> None:
    """Before a compiled forward, whose collectives run inside the graph: every rank has
    every micro-batch, as many as the others, or can stand in for the ones it lacks, or
    every rank raises (a rank that cannot join the graph's collectives would leave a peer
    waiting in them for the group's timeout). `stands_in`: this rank runs a batch of its
    own in a missing one's place (a step's with zero gradients, `_compiled_grad.stand_in`),
    or needs no graph for it (local accumulation)."""
    mine = [len(micro), sum(mb is not None for mb in micro), int(stands_in)]
    everyone = _comm.all_gather_ints_async(mine, mesh)()
    absent = [r for r, (n, have, stand) in enumerate(everyone) if have < n and not stand]
    if absent:
        raise _comm.agreed(
            ValueError(
                f"rank(s) {absent} stepped without a batch or micro-batch (None); "
                "compiled, a step or forward runs its collectives inside the graph and "
                "needs every one on every rank: a rank without data runs a batch of its "
                "own again (a step's with zero gradients), which it cannot before it had "
                "one in this step or forward function (its first call, or the first after "
                "a new layout or precision, with none at all): give each rank a batch "
                "(with weight 0 where it should not count)"
            )
        )
    counts = [e[0] for e in everyone]
    if len(set(counts)) > 1:
        raise _comm.agreed(
            ValueError(
                f"the ranks stepped different numbers of micro-batches ({counts}, by rank); a "
                "compiled step runs each one's collectives inside the graph: give every rank "
                "as many"
            )
        )
