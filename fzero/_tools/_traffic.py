"""Communication per step by mesh axis: the ZeRO and ZeRO++ formulas, for `fzero estimate`."""

from __future__ import annotations

from typing import NamedTuple

from .._core import stage_of


class Traffic(NamedTuple):
    """Logical bytes one rank's collectives move per step (ZeRO's accounting: an
    all-gather or reduce-scatter its full buffer once, an all-reduce twice).

    Attributes:
      inside: along axes that stay inside a group of `shard_size` ranks (a node).
      across: along axes that cross groups.
    """

    inside: float
    across: float


def estimate_comm(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    shard_size: int | None = None,
    hpz: int | None = None,
    qwz: bool = False,
    qgz: bool = False,
    elem_bytes: float = 2,
    block: int = 256,
) -> Traffic:
    """Bytes per rank per step inside and across groups of `shard_size` ranks.

    Args:
      num_params: Ψ.
      world_size: N.
      stage: 0-3.
      shard_size: S; the state is sharded inside groups of S (HSDP). None: over all N,
        whose collectives then all count as crossing groups, but hpZ's.
      hpz: stage 3: the backward's gathers come from a secondary copy inside groups of
        this many ranks (`reshard_after_forward=k`).
        Stage 3 counts every parameter gathered again for the backward, as ZeRO does; a
        step moves less by the units it does not gather again (the root, the forward's
        last one or two, kept for the backward, and those no backward uses): the count
        is an upper bound.
      qwz, qgz: stage 3's parameter gathers, and gradient reduce-scatters (stages 1-3),
        travel as int8 blocks of `block` with a 4-byte scale each.
      elem_bytes: bytes per element otherwise (2 for bf16).

    Returns:
      `Traffic(inside, across)`; nothing at one rank.
    """
    spec = stage_of(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:  # nothing to send: fzero's collectives return at one rank
        return Traffic(0.0, 0.0)
    q = 1 + 4 / block  # bytes per element as int8 blocks
    gathers = spec.enter == "all_gather"  # parameters gathered for the forward (and backward)
    quant_reduce = qgz and spec.reduce == "reduce_scatter"
    gather = num_params * (q if qwz and gathers else elem_bytes)
    reduce = num_params * (q if quant_reduce else elem_bytes)
    all_reduce = 2 * num_params * elem_bytes  # stage 0: an all-reduce counts twice
    after = num_params * elem_bytes  # the updated shards gathered after the update (exact)
    if shard_size is not None and shard_size < world_size:  # HSDP: 1/S crosses groups
        if spec.reduce == "all_reduce":
            inside = all_reduce
        elif gathers:  # the forward's and the backward's gathers (hpZ's exact: from the
            # secondary copy, the values the forward computed with)
            inside = reduce + gather + (num_params * elem_bytes if hpz else gather)
        else:
            inside = reduce + after
        return Traffic(inside, 2 * (num_params / shard_size) * (q if quant_reduce else elem_bytes))
    # A 1-D mesh shards over all N ranks: its collectives span the nodes (ZeRO++'s view),
    # except hpZ's backward gathers, inside groups of `hpz`.
    if not gathers:
        return Traffic(0.0, all_reduce if spec.reduce == "all_reduce" else reduce + after)
    if hpz:
        return Traffic(num_params * elem_bytes, gather + reduce)  # regathered exact
    return Traffic(0.0, 2 * gather + reduce)
