"""Functional optimizers (pure ``init``/``update`` over optree pytrees of tensors)."""

from ._adam import AdamState as AdamState
from ._adam import adam as adam
from ._adam import adamw as adamw
from ._base import Grads as Grads
from ._base import Optimizer as Optimizer
from ._base import OptState as OptState
from ._base import Params as Params
from ._base import ScalarOrSchedule as ScalarOrSchedule
from ._base import Schedule as Schedule
from ._groups import param_groups as param_groups
from ._schedules import from_torch_scheduler as from_torch_scheduler
from ._schedules import lambda_lr as lambda_lr
from ._sgd import SgdState as SgdState
from ._sgd import sgd as sgd
from ._torch import from_torch as from_torch
from ._transforms import ClipState as ClipState
from ._transforms import GradientTransformation as GradientTransformation
from ._transforms import chain as chain
from ._transforms import clip_by_global_norm as clip_by_global_norm
