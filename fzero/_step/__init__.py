"""The step: every ZeRO stage as one composition of the engine's per-unit primitive.

`sharded_step` (`_sharded_step`) checks its options once (`_options`) and wraps one
step's body (`_body`), which reads as the stage table: enter and differentiate
(`_gradient`, over `_micro_batches`), weigh (`_loss_weights`, agreed by `_sync`), update
this rank's part (`_update`, whose `sharded_update` is the optimizer on a shard), and
what follows the update. `_loss` holds the loss wrappers (buffers threaded through, loss
scaling), `_casts` the forward casts of a mixed-precision `module=`; `_cache` what a
step function carries from one call to the next;
`sharded_forward` (`_sharded_forward`) is the forward half, without gradients.

Contract: a step is `step(state, batch) -> (state, loss)`, a function of its arguments
and of the step function's cache alone. Imports everything below it: `fzero._core`,
`fzero._comm`, `fzero.optim`, `fzero._engine`, `fzero._state`.
"""

from ._bind import bind as bind
from ._sharded_forward import sharded_forward as sharded_forward
from ._sharded_step import sharded_step as sharded_step
from ._update import sharded_update as sharded_update
