"""agree_layout: `shard_state`'s check that every rank holds params of one layout."""

from __future__ import annotations

from typing import Any

from .. import _comm
from .._comm import Mesh
from .._core import ShardLayout, UnitSpec, spec_of


def agree_layout(
    lay: ShardLayout | None, problem: str | None, stage: tuple[int, bool, bool], mesh: Mesh
) -> None:
    """`shard_state`'s check: raises on every rank unless all ranks have valid params of one
    layout and one stage (`problem`: this rank's error, if any; `stage`: its number,
    whether values come from an init, and whether the state is offloaded). Only what the
    exchange says is raised as agreed: an error of the exchange itself is this rank's."""
    mine = (problem, stage, None if lay is None else lay.fingerprint())
    everyone = _comm.all_gather_object(mine, mesh)
    for rank, (prob, _, _) in enumerate(everyone):
        if prob is not None:
            said = f"shard_state: rank {rank}: {prob.split(': ', 1)[1]}"
            raise _comm.agreed(_type_of(prob)(said))
    ref_stage, ref = everyone[0][1], everyone[0][2]
    for rank, (_, st, fp) in enumerate(everyone[1:], start=1):
        if st[0] != ref_stage[0]:
            raise _comm.agreed(
                ValueError(
                    f"shard_state: rank {rank} asked for stage {st[0]}, rank 0 for {ref_stage[0]}"
                )
            )
        if st[1] != ref_stage[1]:
            has = "passed" if st[1] else "did not pass"
            said = f"shard_state: rank {rank} {has} init=, rank 0 did the opposite"
            raise _comm.agreed(ValueError(said))
        if st[2] != ref_stage[2]:  # placing the state is collective: it would hang
            has = "passed" if st[2] else "did not pass"
            said = f"shard_state: rank {rank} {has} offload=, rank 0 did the opposite"
            raise _comm.agreed(ValueError(said))
        if fp != ref:
            said = f"shard_state: rank {rank}'s params differ from rank 0's: {_first_diff(ref, fp)}"
            raise _comm.agreed(ValueError(said))


def _type_of(problem: str) -> type[Exception]:
    return TypeError if problem.startswith("TypeError") else ValueError


def _first_diff(ref: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    kind, _, tdef, leaves, units, frozen = ref
    okind, _, otdef, oleaves, ounits, ofrozen = other
    if kind != okind:
        return f"layout {okind!r} vs {kind!r}"
    for (p, s, d), (op, os_, od) in zip(leaves, oleaves):
        if p != op:
            return f"leaf {op!r} where rank 0 has {p!r}"
        if s != os_ or d != od:
            return f"leaf {p!r} is {tuple(os_)} {od}, rank 0 has {tuple(s)} {d}"
    if len(leaves) != len(oleaves):
        extra = oleaves[len(leaves) :] or leaves[len(oleaves) :]
        return f"{len(oleaves)} leaves vs rank 0's {len(leaves)} (first unmatched: {extra[0][0]!r})"
    if units != ounits:
        return f"units {_specs(ounits)} vs rank 0's {_specs(units)}"
    for (p, _, _), f, of in zip(leaves, frozen, ofrozen):
        if f != of:
            return f"leaf {p!r} is {'frozen' if of else 'trainable'}, rank 0's is not"
    return f"tree structure {otdef} vs {tdef}"


def _specs(members: tuple[tuple[str, ...], ...]) -> list[UnitSpec]:
    return [spec_of(m) for m in members[1:]]
