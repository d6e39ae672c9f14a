"""fzero: ZeRO data-parallel sharding for PyTorch as pure functions over parameter pytrees."""

from . import checkpoint as checkpoint
from . import init as init
from . import optim as optim
from . import testing as testing
from . import units as units
from ._comm import CommLedger as CommLedger
from ._comm import CommRecord as CommRecord
from ._comm import Mesh as Mesh
from ._comm import PeerError as PeerError
from ._comm import ProcessGroupMesh as ProcessGroupMesh
from ._comm import QuantizedComm as QuantizedComm
from ._comm import comm_ledger as comm_ledger
from ._core import ShardLayout as ShardLayout
from ._core import Shards as Shards
from ._core import assert_trees_close as assert_trees_close
from ._core import build_layout as build_layout
from ._core import tree_nbytes as tree_nbytes
from ._core import value_and_grad as value_and_grad
from ._engine import UnitLedger as UnitLedger
from ._engine import all_reduce_grads as all_reduce_grads
from ._engine import gather_params as gather_params
from ._engine import gathered as gathered
from ._engine import local_shard as local_shard
from ._engine import reduce_scatter_grads as reduce_scatter_grads
from ._engine import register_forward_method as register_forward_method
from ._engine import remat as remat
from ._state import DynamicLossScale as DynamicLossScale
from ._state import LossScaleState as LossScaleState
from ._state import Offload as Offload
from ._state import Precision as Precision
from ._state import ShardedState as ShardedState
from ._state import master_params as master_params
from ._state import shard_state as shard_state
from ._step import bind as bind
from ._step import sharded_forward as sharded_forward
from ._step import sharded_step as sharded_step
from ._step import sharded_update as sharded_update
from ._tools import MemoryEstimate as MemoryEstimate
from ._tools import MemoryReport as MemoryReport
from ._tools import RankFailure as RankFailure
from ._tools import Simulation as Simulation
from ._tools import estimate_memory as estimate_memory
from ._tools import memory_report as memory_report
from ._tools import simulate as simulate

__version__ = "0.1.0"
