"""Context: what the parts of one rank's engine share, fixed while the layout is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .._comm import Mesh
from .._core import ShardLayout
from ._param_hooks import Hooks, Trained
from ._placeholder import Placeholder, placeholders_for
from ._pool import Pool
from ._schedule import Schedule
from ._unit_ledger import UnitLedger


@dataclass(frozen=True)
class Context:
    """The policy, the layout and the mesh a micro-batch's units run under, and the step
    function's own buffers and ledger. The engine, its parameter source and its
    reductions read it; none of them writes it.

    Attributes:
      schedule: when units enter and how their gradients leave (`plan`).
      layout: the state's layout.
      mesh: the mesh.
      pool: where host buffers come from (a step function's, kept across its calls; a
        forward's, made afresh each call).
      ledger: where live full-unit bytes are recorded, or None.
      placeholders: per just-in-time unit, its leaves' index and `Placeholder` (they hold
        no data, so the same ones serve every step; `placeholders_for`).
      grad_hooks: per leaf path, the gradient hooks of `module=`'s parameter there, run
        on the tensors the loss is handed (`_param_hooks`).
      own: `module=`'s trainable parameters, by path: the tensors the loss is handed
        stand in for them, and a gradient reaching one is refused (`grads_of`).
    """

    schedule: Schedule
    layout: ShardLayout
    mesh: Mesh
    pool: Pool
    ledger: UnitLedger | None
    placeholders: Mapping[str, tuple[tuple[int, Placeholder], ...]]
    grad_hooks: Hooks
    own: Trained = ()


def context(
    schedule: Schedule,
    layout: ShardLayout,
    mesh: Mesh,
    pool: Pool,
    ledger: UnitLedger | None,
    grad_hooks: Hooks | None = None,
    own: Trained = (),
) -> Context:
    """The context of a schedule over a layout, with its just-in-time units' placeholders."""
    placeholders = placeholders_for(layout, schedule.jit, mesh.rank)
    return Context(schedule, layout, mesh, pool, ledger, placeholders, grad_hooks or {}, own)
