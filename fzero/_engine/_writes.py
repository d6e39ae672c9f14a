"""Parameters a loss writes in place: refused, naming them, on every rank.

A step's parameters are read-only inside its loss. One process training with torch.optim
keeps a write to a weight (`nn.Embedding(max_norm=...)` renormalizes the rows a batch
looks up, in place, in its forward); fzero cannot: a replica written on one rank (stages
0-2) would keep what this rank's batch wrote and not the others', and a gathered copy
(stage 3) would drop the write when the unit is freed.

- A trainable leaf written in place is refused by autograd itself (it is one of several
  views of its unit's buffer), in words that name no parameter: `explained` names it.
- A frozen leaf enters without autograd, and nothing refuses its write: `Writes` watches
  its bucket's version counter, read when the forward ends.
"""

from __future__ import annotations

from types import TracebackType

import torch

from .._core import ShardLayout
from ._entry import Entry

_set_versions = torch._C._autograd._unsafe_set_version_counter  # FSDP2's, for the same end

# Autograd's words for an in-place write to one of several views of one buffer (eagerly
# "Output 0 of _Enter ...", in a compiled step's trace "Output 0 of View ...").
WRITTEN_VIEW = "is a view and its base or another view of its base has been modified inplace"


class Writes:
    """The buckets a forward entered that nothing else guards, watched for writes.

    Each is watched through an alias without memory (a detached alias emptied by
    `set_()`: it keeps the buffer's version counter, which a write to any view of it
    bumps, and none of its storage), so a gathered buffer is freed as soon as the
    forward is done with it and its writes are still seen at the end. `every`: watch
    trainable buckets too (a forward without gradients, where autograd refuses nothing).
    `replica`: the buckets are the state's own buffers (stages 0-2), which a write has
    changed already. Under `torch.inference_mode()` nothing is watched: its tensors keep
    no version counter.
    """

    def __init__(self, layout: ShardLayout, replica: bool) -> None:
        self.layout, self.replica, self.every = layout, replica, False
        self.watched: list[tuple[int, torch.Tensor, int]] = []  # bucket, alias, version

    def watch(self, entry: Entry, fulls: tuple[torch.Tensor, ...]) -> None:
        """`entry`'s full buckets, as the forward receives them."""
        for i, full in zip(entry.buckets, fulls):
            # An inference tensor (a forward under torch.inference_mode()) keeps no count.
            if (self.every or self.layout.buckets[i].frozen) and not full.is_inference():
                version, alias = full._version, full.detach()
                alias.set_()
                # `set_` counts as a write: put the counter back, or a unit entered twice
                # would see the second entry's alias as a write to the first.
                _set_versions((alias,), (version,))
                self.watched.append((i, alias, version))

    def found(self) -> list[str]:
        """The paths of the buckets written in place since they were watched; then
        forgets them."""
        written = dict.fromkeys(i for i, alias, v in self.watched if alias._version != v)
        self.watched.clear()
        return [s.path for i in written for s in self.layout.buckets[i].ordered]

    def named(self, exc: BaseException, buffers: list[tuple[int, torch.Tensor]]) -> str | None:
        """The leaf autograd refused a write to (`exc`), read off the tensors the failing
        frames hold: the one lying in one of the full `buffers` (by bucket)."""
        # A gathered buffer freed already has no memory (address 0): no leaf to name there.
        by_storage = {f.untyped_storage().data_ptr(): (i, f) for i, f in buffers}
        by_storage.pop(0, None)
        for t in _frame_tensors(exc.__traceback__):
            hit = by_storage.get(t.untyped_storage().data_ptr())
            if hit is None:
                continue
            i, full = hit
            at = t.storage_offset() - full.storage_offset()
            for slot in self.layout.buckets[i].slots:
                if slot.offset <= at < slot.offset + slot.numel:
                    return slot.path
        return None


def _frame_tensors(tb: TracebackType | None, depth: int = 8) -> list[torch.Tensor]:
    """The tensors held by the innermost `depth` frames of `tb`, innermost first."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return [
        v
        for frame in reversed(frames[-depth:])
        for v in frame.f_locals.values()
        if isinstance(v, torch.Tensor) and not v.is_meta
    ]


def explained(exc: BaseException, rank: int, path: str | None = None) -> ValueError | None:
    """`exc` in words that say what happened, if it is autograd refusing a write in place
    to a trainable parameter (None otherwise). `path`: the leaf, where known."""
    if WRITTEN_VIEW not in str(exc):
        return None
    if type(exc).__name__ == "InternalTorchDynamoError":
        # Raised while torch.compile traced the loss, not by a write of this step's: it met
        # a tensor an earlier step handed a loss, still held by a module, whose flat
        # buffer has been updated since.
        return ValueError(
            f"rank {rank}: torch.compile, tracing the loss, met a tensor an earlier step "
            f"handed it, which something still holds (autograd: {_first(exc)}). torch's "
            "functional_call leaves a submodule reached by two paths holding the tensors "
            "it was given (pytorch#164759): pass the model as sharded_step(module=...), "
            "and fzero puts its own parameters back after every call"
        )
    which = f"the trainable parameter {path!r}" if path else "a trainable parameter"
    return ValueError(
        f"rank {rank}: the loss wrote {which} in place (autograd: {_first(exc)}). {_READ_ONLY}"
    )


def _first(exc: BaseException) -> str:
    """The sentence of `exc`'s message that carries autograd's refusal."""
    said = str(exc)
    at = said.index(WRITTEN_VIEW)
    start = max(said.rfind("Output", 0, at), 0)
    return said[start : at + len(WRITTEN_VIEW)]


def frozen_written(paths: list[str], rank: int, writes: Writes) -> ValueError:
    """The error for the leaves a forward wrote in place that `writes` found."""
    kind = "" if writes.every else "frozen "
    which = (
        f"the {kind}parameter {paths[0]!r}"
        if len(paths) == 1
        else f"one or more of the {kind}parameters {', '.join(map(repr, paths))}"
    )
    kept = " This rank's copy is written already: go on from a state before it." * writes.replica
    buffer = (
        " A buffer (BatchNorm's running statistics) passed as a frozen parameter belongs "
        "in shard_state(buffers=), whose new values a step returns."
    )
    return ValueError(
        f"rank {rank}: the loss wrote {which} in place. {_READ_ONLY}.{kept}"
        + buffer * (not writes.every)
    )


_READ_ONLY = (
    "The parameters a step hands its loss are read-only: a replica written on one rank "
    "would keep what its own batch wrote and not the other ranks', and a stage-3 unit's "
    "gathered copy would drop the write. nn.Embedding(max_norm=...) writes its weight so "
    "(it renormalizes the rows a batch looks up): pass max_norm=None and renormalize "
    "out of place inside the loss, or write the state's parameters between steps"
)
