"""Command line: `python -m fzero demo` trains a small GPT at every ZeRO stage, simulated."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m fzero` and the `fzero` console script."""
    parser = argparse.ArgumentParser(prog="fzero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="train a small GPT at every stage and compare with one process"
    )
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--micro-batch", type=int, default=4)
    demo.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        action="append",
        help="stage(s) to run (default: all)",
    )
    demo.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float64 (default) shows exactness; float32 shows Adam amplifying "
        "round-off where gradients are near zero",
    )
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1 or args.micro_batch < 1:
        parser.error("--world-size, --steps and --micro-batch must be positive")
    import torch

    from ._demo import run_demo

    torch.set_num_threads(1)  # ranks are processes; one thread each on a small machine
    dtype = getattr(torch, args.dtype)
    rows = run_demo(
        args.world_size,
        args.steps,
        args.micro_batch,
        tuple(args.stage or (0, 1, 2, 3)),
        dtype=dtype,
    )
    worst = max(r["max_delta"] for r in rows)
    if worst > (1e-9 if dtype == torch.float64 else 1e-2):
        print(f"FAILED: a stage differs from the single-process reference by {worst:.2e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
