"""One configuration's step, timed per rank: wall and CPU time, for A/B runs of two trees.

    PYTHONPATH=path/to/checkout python benchmarks/step_time.py [--model deep] [--config fzero3]
                                                               [--steps 30] [--warmup 5]

Imports whichever fzero `PYTHONPATH` names, so that alternating launches over two
checkouts compare them on one host (benchmarks/RESULTS-house.md). Each launch prints one
line: per rank, CPU and wall seconds per step after the warm-up, on 2 simulated ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import configs  # noqa: E402
import models  # noqa: E402
import torch  # noqa: E402

import fzero  # noqa: E402


def _timed(mesh: fzero.Mesh, args: argparse.Namespace) -> tuple[float, float]:
    spec = models.spec(args.model, args.quick)
    torch.manual_seed(0)
    runner = configs.build(configs.BY_NAME[args.config], spec, models.build_model(spec))
    for t in range(args.warmup):
        runner.step(models.rank_batch(spec, t, mesh.rank, mesh.size))
    cpu, wall = time.process_time(), time.perf_counter()
    for t in range(args.warmup, args.warmup + args.steps):
        runner.step(models.rank_batch(spec, t, mesh.rank, mesh.size))
    return (time.process_time() - cpu) / args.steps, (time.perf_counter() - wall) / args.steps


def main(argv: list[str] | None = None) -> list[Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deep", choices=["gpt", "linear", "deep"])
    p.add_argument("--config", default="fzero3", choices=sorted(configs.BY_NAME))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the model's tiny version")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = fzero.Simulation(2, collective_timeout=60, timeout=600).run(_timed, args)
    source = Path(fzero.__file__).parent.parent
    print(source, " ".join(f"cpu {c * 1e3:.1f} ms wall {w * 1e3:.1f} ms" for c, w in out))
    return out


if __name__ == "__main__":
    main()
