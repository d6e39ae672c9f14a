"""Communication: the only package that calls `torch.distributed`.

Meshes (`_mesh`, `_axis`: who the ranks are and which process group carries what),
process groups (`_groups`: set-up, tear-down, a peer's failure), the collectives
(`_collectives`: what each moves along which axis, recorded in the ledger `_ledger`;
`_control`: a few host values per rank),
gloo's fast paths (`_gloo`), an error on one rank raised on every rank (`_failure`),
what `wait()` finishes once a collective is done (`_pending`) and int8 quantization
(`_quant`, ZeRO++'s qwZ and qgZ).

Contract: every collective fzero issues goes through a function of this face, called as
`_comm.name(...)` (tests count them by replacing the face's attribute). A collective
takes a `Mesh` or an `Axis` and returns its result, or `(result, work)` for the
asynchronous ones (`work` None when already done). Imports only `fzero._core`.
"""

from ._axis import Axis as Axis
from ._calls import call as call
from ._calls import collective as collective
from ._collectives import all_gather as all_gather
from ._collectives import all_gather_async as all_gather_async
from ._collectives import all_gather_many_async as all_gather_many_async
from ._collectives import all_reduce_async as all_reduce_async
from ._collectives import all_reduce_mean as all_reduce_mean
from ._collectives import all_reduce_sum as all_reduce_sum
from ._collectives import all_reduce_sum_async as all_reduce_sum_async
from ._collectives import broadcast_ as broadcast_
from ._collectives import reduce_scatter_async as reduce_scatter_async
from ._collectives import reduce_scatter_mean as reduce_scatter_mean
from ._control import all_gather_ints_async as all_gather_ints_async
from ._control import all_gather_object as all_gather_object
from ._control import barrier as barrier
from ._control import pack_flags as pack_flags
from ._control import unpack_flags as unpack_flags
from ._failure import PeerError as PeerError
from ._failure import agreed as agreed
from ._failure import check_alive as check_alive
from ._failure import is_agreed as is_agreed
from ._failure import published as published
from ._failure import raise_if_failed as raise_if_failed
from ._failure import together as together
from ._gloo import ALL_TO_ALL_MAX_BYTES as ALL_TO_ALL_MAX_BYTES
from ._groups import backend_for as backend_for
from ._groups import destroy_process_group as destroy_process_group
from ._groups import init_process_group as init_process_group
from ._groups import is_initialized as is_initialized
from ._groups import is_peer_failure as is_peer_failure
from ._ledger import CommLedger as CommLedger
from ._ledger import CommRecord as CommRecord
from ._ledger import comm_ledger as comm_ledger
from ._ledger import graph_ran as graph_ran
from ._mesh import Mesh as Mesh
from ._mesh import ProcessGroupMesh as ProcessGroupMesh
from ._quant import QuantizedComm as QuantizedComm
from ._quant import dequantize as dequantize
from ._quant import quantize as quantize
