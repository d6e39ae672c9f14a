"""The host time of one rank's optimizer update over a benchmark model's pieces.

    python benchmarks/update_time.py [--models deep,gpt] [--steps 60]
                                     [--out benchmarks/RESULTS-update-time.md]

A compiled step spends little on its forward and backward where units are small; what
is left is host work per piece, and the update is some of it. This times
`fzero.optim.adamw(...).update_` over rank 0's pieces of a benchmark model
(`benchmarks/models.py`, flat shards at world size 2, a unit a block: the deep model's
100 units of 4 leaves, 2,144 elements a piece; the GPT's blocks, 10^5-10^6), as
`sharded_update` runs it (under the shard's context), in one process and one thread:

- fused, as a compiled step runs it (`optim._fused.compiled_updates`: a compiled kernel a
  large piece, torch's fused list kernel for the small ones) and unfused (torch's list
  ops, bitwise torch.optim);
- without a mask (weight decay everywhere) and with the usual one (decay on the matrices,
  not on biases and norms: every piece then mixes the two).

Each row is the median of the steps after the first ten (the first compiles).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import build_model, spec

import fzero
from fzero.optim._context import ShardContext, shard_context
from fzero.optim._fused import compiled_updates


def median_update(name: str, fused: bool, masked: bool, steps: int) -> float:
    """The median seconds of rank 0's update of model `name`'s pieces."""
    s = spec(name, False)
    model = build_model(s)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    matrices = {k for k, v in params.items() if v.dim() >= 2}
    units = [g[0] if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    layout = fzero.build_layout(params, 2, units=[*units, *s.extra_units])
    pieces = layout.pieces(layout.shard(params, 0), 0)
    mask = (lambda path: path in matrices) if masked else None
    opt = fzero.optim.adamw(lr=1e-3, weight_decay=0.1, mask=mask)
    state = opt.init(pieces)
    grads = tuple(torch.randn_like(p) * 1e-3 for p in pieces)
    ctx = ShardContext(None, True, layout.piece_segments(0))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fusing = compiled_updates("inductor") if fused else contextlib.nullcontext()
        with fusing, shard_context(ctx):
            _, state = opt.update_(grads, state, pieces)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[10:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="deep,gpt")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-update-time.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [
        "# One rank's optimizer update, piece by piece\n",
        f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, one thread: `python benchmarks/update_time.py "
        f"--models {args.models} --steps {args.steps}`. Median of the steps after the "
        "first ten.\n",
        "| model | update | decay everywhere (ms) | decay on matrices alone (ms) |",
        "|---|---|---:|---:|",
    ]
    for name in args.models.split(","):
        for label, fused in (("fused (a compiled step's)", True), ("unfused (eager)", False)):
            plain, masked = (median_update(name, fused, m, args.steps) * 1e3 for m in (False, True))
            lines.append(f"| {name} | {label} | {plain:.2f} | {masked:.2f} |")
            print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
