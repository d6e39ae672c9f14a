"""The call check: after each forward, ranks agree on the units they called (and on
what else a step must agree on before its backward).

With module hooks a unit is called when its submodule runs, so a rank-dependent branch
can skip one on some ranks, and the backward's collectives, which pair up by the order
they start in, would pair one unit with another. Each rank sends its calls after its
forward and reads everyone's before its backward's first collective; the same exchange
ORs a flag per unit over the ranks and carries the step's loss weights
(docs/design.md, [Note: one exchange after the forward]).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .. import _comm
from .._comm import Mesh


class Agreement(NamedTuple):
    """An exchange of call sequences in flight: `check` waits for it."""

    called: list[str]
    wait: Callable[[], list[list[int]]]
    flags: int  # how many flags follow the header's words
    carried: int = 0  # how many carried words follow the flags' words
    error: BaseException | None = None  # this rank's loss failed its checks

    def check(self, mesh: Mesh) -> tuple[list[bool], list[list[int]]]:
        """Raises on every rank, the same error, if a rank's loss failed its checks, the
        ranks' micro-batch counts differ or their calls do; returns the flags, each OR-ed
        over the ranks, and every rank's carried words."""
        everyone = self.wait()
        cut = len(everyone[0]) - self.carried
        carried = [e[cut:] for e in everyone]
        if any(e[_ERROR] for e in everyone):
            raise _loss_errors(self.error, mesh) from self.error
        counts = [e[_MICRO] for e in everyone]
        if len(set(counts)) > 1:
            raise micro_batches_differ(counts)
        if all(e[:2] == everyone[0][:2] for e in everyone):
            words = [0] * (cut - _HEADER)
            for e in everyone:
                words = [a | b for a, b in zip(words, e[_HEADER:cut])]
            return _comm.unpack_flags(words, self.flags), carried
        calls = _comm.all_gather_object(self.called, mesh)
        said = "; ".join(
            f"rank {r}: {', '.join(map(repr, c)) or 'none'}" for r, c in enumerate(calls)
        )
        absent = [r for r, e in enumerate(everyone) if not e[2]]
        if absent:
            raise _comm.agreed(
                ValueError(
                    f"rank(s) {absent} had no batch this step and repeated the units of a "
                    "batch before (eagerly the step's last calls; compiled, a batch of its "
                    f"own run again), but the others called different ones ({said}). A rank "
                    "without data can only follow a forward whose unit calls do not change "
                    "from batch to batch; give it a batch (with weight 0) instead"
                )
            )
        raise _comm.agreed(
            ValueError(
                f"the forward called different units on different ranks ({said}). Every rank "
                "must call the same units in the same order: fzero reduces unit gradients (and "
                "stage 3 gathers unit parameters) in call order, so a unit skipped on some "
                "ranks would be paired with another unit's collective. Run the unit on every "
                "rank (multiplying its output by 0 where it should not count), or leave it out "
                "of units= so its parameters join the root unit"
            )
        )


def _loss_errors(error: BaseException | None, mesh: Mesh) -> BaseException:
    """The same error on every rank for the ranks whose loss failed its checks: the first
    one's class, every one's message (each names its rank)."""
    mine = None if error is None else (type(error).__name__, str(error))
    said = [(r, m) for r, m in enumerate(_comm.all_gather_object(mine, mesh)) if m is not None]
    cls = {"TypeError": TypeError}.get(said[0][1][0], ValueError)
    return _comm.agreed(
        cls("; ".join(m if m.startswith(f"rank {r}") else f"rank {r}: {m}" for r, (_, m) in said))
    )


# The header's words: how many units this rank called (-1: calls not compared), their
# digest, whether it had a batch, its micro-batch count, whether its loss failed.
_HEADER, _MICRO, _ERROR = 5, 3, 4


def start_agreement(
    called: list[str] | None,
    mesh: Mesh,
    present: bool = True,
    flags: Sequence[bool] = (),
    carry: Sequence[int] = (),
    micro: int = 1,
    error: BaseException | None = None,
) -> Agreement:
    """Starts comparing this rank's unit calls (`called`, unit names in call order; None:
    not compared) with the other ranks' (host values on the control axis: checking them
    never waits for a GPU). `present`: whether this rank ran a forward (False: it had no
    batch and followed the units called last step). `flags`: as many on every rank (one
    per unit of the layout), OR-ed over the ranks by the check. `carry`: int64 words (as
    many on every rank) that travel along, handed back per rank by the check. `micro`:
    the step's micro-batch count; `error`: this rank's loss failed its checks (every rank
    raises it at the check)."""
    # A digest of the names, not Python's hash(): that one is salted per process.
    names = "\0".join(called or ())
    digest = hashlib.blake2b(names.encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little", signed=True)
    words = _comm.pack_flags(flags)
    count = -1 if called is None else len(called)
    values = [count, h, int(present), micro, int(error is not None), *words, *carry]
    wait = _comm.all_gather_ints_async(values, mesh)
    return Agreement(called or [], wait, len(flags), len(carry), error)


class CallCheck:
    """One micro-batch's exchange among ranks after its forward, in one collective: the
    units each rank called, the step's micro-batch count, whether a rank's loss returned
    something refused, and the words the step sends along (the losses' weights, on a
    step's last micro-batch).

    `after_forward` starts it once the forward is done (the engine's, or a step's that
    differentiates by leaf). Where it compares calls it gates the backward:
    `before_collective` waits for it before the backward's first collective (raising on
    every rank if the calls differ). Otherwise it runs behind the backward, which a rank
    whose loss was refused takes part in with zero gradients, and `finish` waits for it
    at the micro-batch's end; the step reads `carried` after that. A check that does not
    `exchange` sends nothing (a middle micro-batch whose calls need no comparing): a
    refused loss it is given waits for the step's next check that does.
    """

    def __init__(
        self,
        mesh: Mesh,
        carry: Callable[[], Sequence[int]] | None = None,
        *,
        micro: int = 1,
        exchange: bool = True,
        gate: bool = False,
        refused: list[BaseException] | None = None,
    ) -> None:
        """`carry`: called once, after the forward, for this rank's int64 words to send
        along (as many on every rank, on every check of a step that exchanges); None
        sends none. `micro`: the step's micro-batch count. `exchange`: whether this check
        exchanges even where it compares no calls; `gate`: whether the backward waits for
        it even then. `refused`: the step's refused losses not yet sent, shared by its
        checks (one that does not exchange keeps its own there for the next)."""
        self.mesh, self.carry, self.micro, self.exchanges = mesh, carry, micro, exchange
        self.gate, self.refused = gate, refused if refused is not None else []
        self.pending: Agreement | None = None
        self.gates = False  # the backward's collectives wait for the check
        self.flags: list[bool] | None = None  # OR-ed over the ranks, once checked
        self.words: list[list[int]] | None = None  # every rank's carried words, once checked

    def after_forward(
        self,
        called: list[str] | None,
        present: bool = True,
        flags: Sequence[bool] = (),
        error: BaseException | None = None,
    ) -> None:
        """Starts the exchange: this rank's unit calls (`called`, in call order; None when
        the step compares none), whether it had a batch (False: it followed last step's
        calls), per unit of the layout a flag to OR over the ranks, the carried words, and
        `error` if its loss returned something refused (raised on every rank when the
        check completes, or the next one that exchanges)."""
        if error is not None:
            self.refused.append(error)
        if called is None and not self.exchanges:
            return  # a refused loss travels with the next check that exchanges
        error = self.refused[0] if self.refused else None
        self.refused.clear()
        words = [] if self.carry is None else list(self.carry())
        self.pending = start_agreement(called, self.mesh, present, flags, words, self.micro, error)
        self.gates = called is not None or self.gate

    def before_collective(self) -> list[bool] | None:
        """Before a backward collective: waits for a check that gates it (raising on every
        rank if the ranks' calls differ or a loss was refused); returns the flags OR-ed
        over the ranks, or None if no check completed."""
        if self.gates:
            self.finish()
        return self.flags

    def finish(self) -> None:
        """Waits for the check, if one is pending (raising as it does)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.flags, self.words = pending.check(self.mesh)

    def peek(self) -> list[list[int]] | None:
        """Every rank's carried words, waiting for the exchange, if the check passes; None
        if it fails (`finish` raises then, after the backward) or sent nothing. It may run
        inside the backward, which a failing check must not cut short: it raises only what
        any wait does (a peer's failure, a timeout)."""
        if self.words is not None:
            return self.words
        if self.pending is None:
            return None
        everyone = self.pending.wait()
        if any(e[_ERROR] for e in everyone) or any(e[:2] != everyone[0][:2] for e in everyone):
            return None
        if len({e[_MICRO] for e in everyone}) > 1:
            return None
        return [e[len(e) - self.pending.carried :] for e in everyone]

    def carried(self) -> list[list[int]]:
        """Every rank's carried words, in rank order (raising as the check does)."""
        self.finish()
        assert self.words is not None, "CallCheck.carried: no words were sent"
        return self.words


def micro_batches_differ(counts: list[Any]) -> Exception:
    """The error, agreed, for ranks that stepped different numbers of micro-batches."""
    said = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    return _comm.agreed(
        ValueError(
            f"the ranks stepped different numbers of micro-batches ({said}). Every rank "
            "accumulates over the same number each step (their backwards reduce together): "
            "pad a short rank's list with None (a micro-batch without data)"
        )
    )
