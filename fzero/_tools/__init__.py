"""Tools around the library: simulation, accounting, the equivalence check, the command line.

`simulate` (`_simulate`: N real ranks from one call), `estimate_memory` and
`memory_report` (`_memory`), communication per step by axis (`_traffic`),
`assert_stages_equivalent` (`_equivalence`, behind `fzero.testing`), and the `fzero`
command line (`_cli`) with its demo (`_demo`) and number formats (`_numbers`).

Contract: users of the library, never used by it: nothing below imports this package.
Imports any of `fzero._core`, `fzero._comm`, `fzero.optim`, `fzero._engine`,
`fzero._state`, `fzero._step` and `fzero.checkpoint`.
"""

from ._cli import main as main
from ._equivalence import assert_stages_equivalent as assert_stages_equivalent
from ._memory import MemoryEstimate as MemoryEstimate
from ._memory import MemoryReport as MemoryReport
from ._memory import estimate_memory as estimate_memory
from ._memory import memory_report as memory_report
from ._simulate import RankFailure as RankFailure
from ._simulate import Simulation as Simulation
from ._simulate import simulate as simulate
