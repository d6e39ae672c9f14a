"""The core: what a sharded parameter tree *is*, before anything communicates.

Pytrees and their dotted leaf paths (`_tree`), flat buffers and the leaves in them
(`_flat`), the layout that says which rank owns which elements (`_layout`) and a rank's
part of it (`_shards`), what `units=` names (`_unitspec`, `_unit_policies`), the stage
table (`_stages`), pytree differentiation (`_autodiff`) and tensor files read and written
by range (`_tensorfile`).

Contract: pure data and functions of one process. Nothing here calls `torch.distributed`
or knows a rank other than by number. It imports no other part of fzero; every other
part may import it (through this face).
"""

from ._autodiff import LossFn as LossFn
from ._autodiff import bad_loss as bad_loss
from ._autodiff import check_differentiable as check_differentiable
from ._autodiff import check_loss as check_loss
from ._autodiff import differentiating as differentiating
from ._autodiff import grads_of as grads_of
from ._autodiff import is_bad_loss as is_bad_loss
from ._autodiff import sparse_gradient as sparse_gradient
from ._autodiff import value_and_grad as value_and_grad
from ._dcp import DcpFiles as DcpFiles
from ._flat import Bucket as Bucket
from ._flat import accumulator as accumulator
from ._flat import cut as cut
from ._flat import pack as pack
from ._flat import paste as paste
from ._layout import ShardLayout as ShardLayout
from ._layout import build_layout as build_layout
from ._leaves import check_distinct as check_distinct
from ._leaves import check_leaves as check_leaves
from ._leaves import unmatched_leaves as unmatched_leaves
from ._shards import Shards as Shards
from ._stages import STAGES as STAGES
from ._stages import Stage as Stage
from ._stages import gathers_to_compute as gathers_to_compute
from ._stages import stage_of as stage_of
from ._tensorfile import OffsetWriter as OffsetWriter
from ._tensorfile import TensorFile as TensorFile
from ._tensorfile import as_bytes as as_bytes
from ._tensorfile import fsync_dir as fsync_dir
from ._tensorfile import safetensors_writer as safetensors_writer
from ._tensorfile import torch_writer as torch_writer
from ._tensorfiles import TensorFiles as TensorFiles
from ._tensorfiles import open_tensors as open_tensors
from ._tree import NAMESPACE as NAMESPACE
from ._tree import PyTree as PyTree
from ._tree import assert_trees_close as assert_trees_close
from ._tree import device_of as device_of
from ._tree import leaf_paths as leaf_paths
from ._tree import max_abs_diff as max_abs_diff
from ._tree import subtree as subtree
from ._tree import subtree_of as subtree_of
from ._tree import tree_flatten as tree_flatten
from ._tree import tree_map as tree_map
from ._tree import tree_nbytes as tree_nbytes
from ._tree import tree_unflatten as tree_unflatten
from ._tree import unaliased as unaliased
from ._unit_policies import auto as auto
from ._unit_policies import by_module as by_module
from ._unit_policies import by_size as by_size
from ._unit_policies import grouped as grouped
from ._unitspec import UnitSpec as UnitSpec
from ._unitspec import covers as covers
from ._unitspec import members_of as members_of
from ._unitspec import name_of as name_of
from ._unitspec import spec_of as spec_of
