"""fzero: ZeRO data-parallel sharding for PyTorch as pure functions over parameter pytrees."""

from . import checkpoint as checkpoint
from . import init as init
from . import optim as optim
from . import testing as testing
from . import units as units
from ._autodiff import value_and_grad as value_and_grad
from ._forward import sharded_forward as sharded_forward
from ._gather import gather_params as gather_params
from ._gather import master_params as master_params
from ._gathered import gathered as gathered
from ._grads import all_reduce_grads as all_reduce_grads
from ._grads import local_shard as local_shard
from ._grads import reduce_scatter_grads as reduce_scatter_grads
from ._layout import ShardLayout as ShardLayout
from ._layout import build_layout as build_layout
from ._ledger import CommLedger as CommLedger
from ._ledger import CommRecord as CommRecord
from ._ledger import comm_ledger as comm_ledger
from ._memory import MemoryEstimate as MemoryEstimate
from ._memory import MemoryReport as MemoryReport
from ._memory import estimate_memory as estimate_memory
from ._memory import memory_report as memory_report
from ._mesh import Mesh as Mesh
from ._mesh import ProcessGroupMesh as ProcessGroupMesh
from ._precision import Precision as Precision
from ._quant import QuantizedComm as QuantizedComm
from ._remat import remat as remat
from ._scale import DynamicLossScale as DynamicLossScale
from ._scale import LossScaleState as LossScaleState
from ._shards import Shards as Shards
from ._simulate import RankFailure as RankFailure
from ._simulate import Simulation as Simulation
from ._simulate import simulate as simulate
from ._state import ShardedState as ShardedState
from ._state import shard_state as shard_state
from ._step import sharded_step as sharded_step
from ._tree import assert_trees_close as assert_trees_close
from ._tree import tree_nbytes as tree_nbytes
from ._unit_ledger import UnitLedger as UnitLedger
from ._update import sharded_update as sharded_update

__version__ = "0.1.0"
