"""The state: what one rank keeps between steps, and how it is first made.

`ShardedState` and `shard_state` (`_shard_state`, the `init` of every stage), the
ranks' agreement on its layout (`_agree_layout`), deferred initialization from
initializers or files (`_deferred`, `_initializers`), mixed precision's masters and
casts (`_precision`), full-precision values made a mixed state (`_mixed`), offload's
placement off the device (`_offload`, `_spill`), the dynamic loss scaler
(`_loss_scale`) and the record of states a donating step consumed (`_donation`).

Contract: a state is an immutable pytree (`dataclasses.replace` makes the next one); the
functions here build, check and convert states but never step them. Imports
`fzero._core`, `fzero._comm`, `fzero.optim` and `fzero._engine` (to gather masters).
"""

from ._agree_layout import agree_layout as agree_layout
from ._construction import deferred as deferred
from ._construction import is_deferred as is_deferred
from ._donation import check_live as check_live
from ._donation import mark_consumed as mark_consumed
from ._frozen import frozen_leaves as frozen_leaves
from ._initializers import FileInit as FileInit
from ._initializers import Init as Init
from ._initializers import LeafInit as LeafInit
from ._initializers import ModuleInit as ModuleInit
from ._initializers import RecordedInit as RecordedInit
from ._initializers import ValuesInit as ValuesInit
from ._initializers import digest as digest
from ._loss_scale import DynamicLossScale as DynamicLossScale
from ._loss_scale import LossScaleState as LossScaleState
from ._loss_scale import unscale_ as unscale_
from ._mixed import full_precision_layout as full_precision_layout
from ._mixed import held_shards as held_shards
from ._mixed import meta_like as meta_like
from ._mixed import retyped as retyped
from ._mixed import to_mixed as to_mixed
from ._offload import Offload as Offload
from ._offload import Placement as Placement
from ._offload import check_offload as check_offload
from ._offload import compute_device as compute_device
from ._offload import offloaded_bytes as offloaded_bytes
from ._offload import offloaded_param_bytes as offloaded_param_bytes
from ._offload import params_apart as params_apart
from ._offload import piece_buckets as piece_buckets
from ._offload import place as place
from ._precision import Precision as Precision
from ._precision import cast_params as cast_params
from ._precision import gather_rounded as gather_rounded
from ._precision import gathered_masters as gathered_masters
from ._precision import master_params as master_params
from ._precision import update_dtypes as update_dtypes
from ._shard_state import ShardedState as ShardedState
from ._shard_state import init_optimizer as init_optimizer
from ._shard_state import replicate_buffers as replicate_buffers
from ._shard_state import shard_state as shard_state
