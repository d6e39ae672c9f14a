"""The call check's own cost: steps of a toy model with the check on and patched out.

    python benchmarks/call_check.py [--blocks 10] [--steps 100]

Each outermost call that sends anything opens with an all-gather of its name
(docs/design.md, [Note: the same call]). On a model whose step is a few milliseconds
that round trip is what is left to see: blocks of steps alternate with the exchange on
and replaced by a no-op, in one run on 2 simulated ranks, so the host's load falls on
both alike; the best block of each is printed, per stage.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import fzero
from fzero._comm import _calls

D = 16


def _timed(mesh: fzero.Mesh, stage: int, blocks: int, steps: int) -> tuple[float, float]:
    real = _calls._start
    params = {f"w{i}": torch.randn(D, D, dtype=torch.float64) for i in range(4)}
    opt = fzero.optim.sgd(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage)

    def loss_fn(p: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        return sum((x @ w).square().mean() for w in p.values())

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage)
    x = torch.ones(2, D, dtype=torch.float64)
    for _ in range(20):
        state, _ = step(state, x)
    on, off = [], []
    for k in range(blocks):
        checked = k % 2 == 0  # every rank alike: the check is on or off on all of them
        _calls._start = real if checked else (lambda *a: lambda: None)
        start = time.perf_counter()
        for _ in range(steps):
            state, _ = step(state, x)
        (on if checked else off).append((time.perf_counter() - start) / steps)
    _calls._start = real
    return min(on), min(off)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for stage in (0, 3):
        out = fzero.Simulation(2, collective_timeout=60, timeout=600).run(
            _timed, stage, args.blocks, args.steps
        )
        on, off = out[0]
        print(
            f"stage {stage}: {on * 1e3:.2f} ms a step checked, {off * 1e3:.2f} ms not: "
            f"{(on - off) * 1e6:.0f} us a call (rank 0)"
        )


if __name__ == "__main__":
    main()
