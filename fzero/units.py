"""Unit policies: which parameter-path prefixes are gathered and reduced as one buffer.

`units=` of `fzero.shard_state` takes what these return: one unit per block, found
(`auto`: Hugging Face's `_no_split_modules`, or a model's repeated layers) or named
(`by_module`, FSDP2's `fully_shard` per block), units of a size (`by_size`, FairScale's
`auto_wrap`), and several consecutive units as one (`grouped`, `fully_shard([...])`).
"""

from ._core import auto as auto
from ._core import by_module as by_module
from ._core import by_size as by_size
from ._core import grouped as grouped
