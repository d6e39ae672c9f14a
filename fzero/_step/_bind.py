"""bind: a module's own methods (`generate`, an evaluation loop) run on a sharded state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from .. import _comm
from .._comm import Mesh
from .._core import gathers_to_compute, leaf_paths, tree_flatten
from .._engine import restored
from .._state import ShardedState
from ._bound import bound
from ._casts import forward_casts
from ._loss import copied
from ._sharded_forward import Forwarder
from ._sharded_step import collector_paused
from ._stalls import said_stalled


@contextlib.contextmanager
def bind(
    model: nn.Module, state: ShardedState, mesh: Mesh, *, prefetch: bool = True
) -> Iterator[nn.Module]:
    """`model` holding `state`'s parameters and buffers for the duration of the block.

    Collective. Inside the block, any code may call the model: `model.generate(...)`, an
    evaluation loop, several forwards. At stage 3 each unit is gathered as its submodule
    starts (module hooks, as `sharded_step(module=)` does) and freed once it is done, as
    often as the code calls it, so no rank holds the model; at stages 0-2 the model runs
    on the replicas, without communication. Nothing is differentiated (`torch.no_grad()`)
    and the state is not changed. On leaving, the model holds what it held before (its
    meta tensors, say).

    Every rank must make the same unit calls in the same order (checked when the block
    ends, as a forward's): where ranks would stop at different points, e.g. generating
    until each one's sequences end, keep them in step the way Hugging Face's
    `generate(..., synced_gpus=True)` does (a rank that has finished goes on running
    the model until all have). An error inside the block on any rank raises on every
    rank (`fzero.PeerError` on the others). A `sharded_step` over the bound model or
    state is refused inside the block, as is one without `module=` (what its loss runs
    cannot be told); one with `module=` another model (a student beside a bound teacher)
    steps as anywhere.

    Args:
      model: the module whose `named_parameters()` / `named_buffers()` the state was
        built from (`dict(model.named_parameters())`, `buffers=dict(model.named_buffers())`).
      state: this rank's ShardedState.
      mesh: the mesh the state was sharded over.
      prefetch: stage 3: start gathering the unit that came next as a unit enters.

    Yields:
      `model`, bound.
    """
    with _comm.call(mesh, "bind", sends=gathers_to_compute(getattr(state, "stage", None))):
        forwarder = Forwarder(mesh, model, False, prefetch, None)  # inside: its errors too
        engine = forwarder.engine(state)
        casts = forward_casts(model, forwarder.hooked(state), state.precision)
        kept = restored(
            forwarder.cache.shared_slots(model, state.buffers)
        )  # torch's reparametrization's
        stalls = said_stalled("bind", mesh.rank)  # the block's gathers, and its end's check
        with (
            collector_paused(),
            casts,
            kept,
            bound(model, state),
            stalls,
            engine.session() as params,
        ):
            tensors = _named(params, model, "params")
            if state.buffers is not None:
                tensors.update(_named(copied(state.buffers), model, "buffers"))
            with _reparametrize_module(model, tensors, tie_weights=True):
                yield model


def _named(tree: object, model: nn.Module, what: str) -> dict:
    """The tree's leaves by path, checked to name the model's own tensors."""
    paths, leaves = leaf_paths(tree), tree_flatten(tree)[0]
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    own.update(n for n, _ in model.named_buffers(remove_duplicate=False))
    strange = [p for p in paths if p not in own]
    if strange:
        raise ValueError(
            f"fzero.bind: the state's {what} leaf {strange[0]!r} is not a parameter or buffer "
            f"of the {type(model).__name__} ({len(strange)} such leaves): bind the model the "
            "state was built from (dict(model.named_parameters()))"
        )
    return dict(zip(paths, leaves, strict=True))
