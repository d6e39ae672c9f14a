"""What global-norm clipping and a dynamic loss scaler add to an eager fzero step: the
benchmark GPT on 2 simulated ranks, each stage's step plain and with both, median ms of
the slowest rank. A/B two trees by running it with each on PYTHONPATH:

    PYTHONPATH=<tree> python benchmarks/clip_scale.py [--stages 0,2] [--steps 8] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call

import fzero

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import build_model, rank_batch, spec


def timed(mesh: fzero.Mesh, stage: int, checks: bool, steps: int, quick: bool) -> float:
    """Median ms of this rank's steps after the first two."""
    torch.set_num_threads(1)
    s = spec("gpt", quick)
    model = build_model(s)
    units = [g[0] if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    units += list(s.extra_units)
    opt = fzero.optim.adam(lr=1e-3)
    if checks:
        opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(1.0), opt)
    params = {k: v.detach() for k, v in model.named_parameters()}
    scaler = fzero.DynamicLossScale() if checks else None
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, loss_scale=scaler)
    step = fzero.sharded_step(
        lambda p, b: s.loss(functional_call(model, p, (b[0],)), b[1]),
        opt, mesh, stage=stage, units=units, module=model,
    )  # fmt: skip
    times = []
    for k in range(steps):
        batch = rank_batch(s, k, mesh.rank, mesh.size)
        start = time.perf_counter()
        state, loss = step(state, batch)
        loss.item()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="0,2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="the model's tiny version")
    args = ap.parse_args()
    print(f"{'stage':>5}  {'plain (ms)':>10}  {'clip + scaler (ms)':>18}  {'added (ms)':>10}")
    for stage in (int(x) for x in args.stages.split(",")):
        plain, checked = (
            max(fzero.simulate(2, timed, stage, checks, max(args.steps, 3), args.quick))
            for checks in (False, True)
        )
        print(f"{stage:>5}  {plain:>10.1f}  {checked:>18.1f}  {checked - plain:>10.1f}")


if __name__ == "__main__":
    main()
