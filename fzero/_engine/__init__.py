"""The engine: a unit's parameters entering the loss, and its gradient leaving it.

Every stage is one program (see `_engine.Engine`): each unit enters the loss through one
autograd node (`_entry.enter`), whose forward gives the unit's full parameters and whose
backward reduces the unit's gradient over the ranks. Where the full parameters come from
is a `ParamSource` (`_source`: the rank's replica at stages 0-2, `_gatherer`: the
all-gather of every rank's shard at stage 3); how gradients are reduced is
`_reductions` (with `_bursts` of several units); *when* either happens is a `Schedule`
(`_schedule`), chosen once per step. Units enter before the forward, through module
hooks (`_hooks`, around registered `_forward_methods` too) or when a pure loss asks
(`_gathered`); until then they are `_placeholder`s. `_callcheck` checks that ranks
called the same units; `_writes` refuses a loss's writes to its parameters; `_pool`
keeps host buffers across steps; `_remat` recomputes with the forward's parameters;
`_by_hand` runs the same node synchronously (`gather_params`, `reduce_scatter_grads`).

Contract: the engine works on one micro-batch of one rank, on flat buffers and a layout;
it knows nothing of optimizers, states or steps. Imports `fzero._core` and
`fzero._comm`.
"""

from ._bindings import restored as restored
from ._bindings import shared_slots as shared_slots
from ._by_hand import all_reduce_grads as all_reduce_grads
from ._by_hand import gather_params as gather_params
from ._by_hand import gather_params_into as gather_params_into
from ._by_hand import local_shard as local_shard
from ._by_hand import reduce_scatter_grads as reduce_scatter_grads
from ._callcheck import CallCheck as CallCheck
from ._callcheck import micro_batches_differ as micro_batches_differ
from ._checkpoints import checkpoints_rebound as checkpoints_rebound
from ._context import Context as Context
from ._context import context as context
from ._engine import Engine as Engine
from ._engine import stand_in as stand_in
from ._forward_methods import AsForward as AsForward
from ._forward_methods import forward_methods as forward_methods
from ._forward_methods import register_forward_method as register_forward_method
from ._gathered import gathered as gathered
from ._hooks import Members as Members
from ._hooks import ModuleHooks as ModuleHooks
from ._hooks import hookable_units as hookable_units
from ._param_hooks import Trained as Trained
from ._param_hooks import gradient_hooks as gradient_hooks
from ._param_hooks import hooks_for as hooks_for
from ._param_hooks import run_hooks as run_hooks
from ._param_hooks import trained_parameters as trained_parameters
from ._placeholder import Unentered as Unentered
from ._pool import Pool as Pool
from ._reductions import LocalSums as LocalSums
from ._reductions import Watch as Watch
from ._remat import remat as remat
from ._schedule import Schedule as Schedule
from ._schedule import differentiates_by_leaf as differentiates_by_leaf
from ._schedule import plan as plan
from ._source import full_buckets as full_buckets
from ._source import own_slices as own_slices
from ._unit_ledger import UnitLedger as UnitLedger
from ._writes import explained as explained
