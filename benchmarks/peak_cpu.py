"""Peak live tensor bytes of gpu.py's rows, measured on the CPU as CUDA's allocator counts.

`torch.cuda.max_memory_allocated` is the running sum of live tensor allocations at its
highest. On the CPU, torch.profiler records every tensor allocation and free with its
size, so the same sum can be taken over a few steps, with no GPU. Two things differ from
a GPU run, and this script makes them as on a GPU:
- fzero's host pool keeps gathered buffers and gradient bursts across steps on the CPU
  (`fzero/_engine/_pool.py`); on a device it hands out fresh tensors and leaves reuse to the
  caching allocator. Here the pool hands out fresh tensors, as on a device.
- CPU AdamW is not fused: torch's and fzero's rows both use the `foreach=False` loop.

Each row runs in a fresh process, at world size 1 on gloo, on a smaller GPT than gpu.py's
(the configuration is printed). The ranking of rows, not their absolute MiB, carries
over to the GPU: activations scale differently there.

Usage: python benchmarks/peak_cpu.py [--prec bf16] [--only PATTERN] [--steps 4] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_rows as G

from fzero._tools._memory import profiled_bytes

CFG = dict(vocab=8192, block=256, d=256, layers=4, heads=4)
MiB = 2**20


def row(name: str, cfg: dict[str, int], prec: str, steps: int) -> dict[str, int]:
    """One row's peak and final live bytes over `steps` steps, from building it on."""
    import fzero._engine._pool as pool

    # As on a device: a fresh tensor for every buffer (see the module docstring).
    pool.Pool.take = lambda self, numel, dtype, device: torch.empty(
        numel, dtype=dtype, device=device
    )
    pool.Pool.pools = lambda self, buf: False
    dist.init_process_group(
        "gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1
    )
    device = torch.device("cpu")
    build = G.builders(cfg, prec, device)[name]
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        held, step, _ = build()
        for t in range(steps):
            step(G.batch(t, G.BATCH, cfg, device))
    peak, now = profiled_bytes(prof)
    del held, step
    dist.destroy_process_group()
    return {"peak": peak, "end": now}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prec", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--only", default="FSDP2|fzero stage 3", help="rows matching PATTERN")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="gpu.py's tiny GPT (a test's)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # the child's one row
    args = ap.parse_args()
    cfg = G.SMOKE if args.smoke else CFG
    if args.row:
        print(json.dumps(row(args.row, cfg, args.prec, args.steps)))
        return
    torch.manual_seed(0)
    psi = sum(p.numel() for p in G.new_model(cfg, torch.device("cpu")).parameters())
    print(f"GPT {cfg}: {psi:,} parameters ({psi * 4 / MiB:.1f} MiB in fp32), {args.prec},")
    print(f"{args.steps} steps of {G.BATCH} x {cfg['block']} tokens, world size 1\n")
    print("| row | peak MiB | live after the steps MiB |\n|---|---|---|")
    rows = G.builders(cfg, args.prec, torch.device("cpu"))
    names = [n for n in rows if re.search(args.only, n)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for name in names:
        argv = [sys.executable, __file__, "--row", name, "--prec", args.prec]
        argv += ["--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        got = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {got['peak'] / MiB:.1f} | {got['end'] / MiB:.1f} |", flush=True)


if __name__ == "__main__":
    main()
