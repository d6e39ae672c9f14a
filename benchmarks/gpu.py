"""fzero on one GPU beside an eager loop, DDP and FSDP2: step time, tokens/s, MFU, memory.

    python benchmarks/gpu.py [--steps 20] [--warmup 5] [--out benchmarks/RESULTS-gpu.md]
    python benchmarks/gpu.py --profile 'bf16 (eager|fzero stage 3)'   # add profiler tables
    python benchmarks/gpu.py --smoke        # a tiny model on the CPU: checks the script
    python benchmarks/gpu.py --only 'bf16 fzero' --ws2-stages 3   # a subset, for a short lease

A GPT-like decoder (163M parameters: 12 blocks of width 768, 1024 tokens, vocabulary 50304,
untied head) trains in float32 and in bfloat16 mixed precision, each configuration from
the same initial values on the same tokens, with torch's fused AdamW everywhere (fzero
through `fzero.optim.from_torch`, so the kernels are the same and the step around them
is what differs):

- eager: the model, `loss.backward()`, `optimizer.step()` (bf16: under torch.autocast);
- DDP, and FSDP2 (`fully_shard` per block, then the root; bf16: MixedPrecisionPolicy),
  resharding after the forward (the root too, or the root by FSDP2's default: kept) and
  keeping;
- fzero stages 0-3 (units per block, `module=` hooks; bf16: `fzero.Precision`), and
  stage 3 keeping its units (`reshard_after_forward=False`);
- issue 50's compiled rows: the eager loop with its module under `torch.compile`, FSDP2
  with each block compiled first (torchtitan's way), and fzero stages 0 and 3 with
  `compile=True` (units up front), and stage 3 with its module hooks traced (each block
  gathered in the graph where it runs, recomputed for the backward). Their warm-up
  steps pay the compilation, so give them `--warmup` of 2 or more.

All at world size 1 on NCCL; then stages 0-3 at world size 2 on the one GPU over gloo
(`fzero.Simulation(2, device="cuda")`), for correctness only. Each row reports the
median step time, tokens/s, MFU (6 N + 12 L T d FLOPs per token against the device's
dense peak), `torch.cuda.max_memory_allocated`, and max |delta| of the final
parameters against the eager loop (world size 2: against the eager loop on the
concatenated batch). `--profile PATTERN` adds torch.profiler's tables (by GPU time and
by host time) for the rows whose "precision label" the pattern matches; `--only PATTERN`
measures a subset (eager always, as the base).

Each row runs in a fresh process (`--row`, `gpu_rows.py`): a configuration's leftovers
(DDP's reducer outlives its module by a parameter copy) never count in another's peak.
Its steps' tokens are on the device before the timing starts. The results file is
rewritten after every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_rows as R

import fzero

# Dense peak FLOP/s by device name and compute dtype (NVIDIA's datasheets, SXM parts).
PEAKS = {"H100": {"bf16": 989e12, "fp32": 67e12}, "H200": {"bf16": 989e12, "fp32": 67e12}}
ROW_TIMEOUT = 900  # seconds for one row's process: a hang must not stall the whole run


def run_row(args: argparse.Namespace, device: torch.device, cfg: dict[str, int]) -> None:
    """`--row "PREC|LABEL"`: measure that one row in this process, save it to --row-out."""
    prec, label = args.row.split("|", 1)
    if args.smoke:
        R.COMPILE_BACKEND = "aot_eager"  # checks the script: see gpu_rows
    store = tempfile.mktemp(prefix="fzero-gpu-")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store, 1), rank=0, world_size=1)
    build = R.builders(cfg, prec, device)[label]
    data = R.batches(args.warmup + args.steps, cfg, device)
    row: dict[str, Any] = R.measure(build, data, args.warmup, device)
    if args.profile and re.search(args.profile, args.row.replace("|", " ")):
        try:
            row["profile"] = R.profile(build, data, device)
        except Exception as e:  # a profiler that fails must not lose the row
            row["profile"] = f"profiler failed: {type(e).__name__}: {e}"
    torch.save(row, args.row_out)
    dist.destroy_process_group()
    Path(store).unlink(missing_ok=True)


def row_in_a_process(args: argparse.Namespace, prec: str, label: str, out: Path) -> Any:
    """The row measured by a fresh process of this script, or the tail of its failure."""
    cmd = [sys.executable, __file__, "--row", f"{prec}|{label}", "--row-out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--smoke"] * args.smoke + (["--profile", args.profile] if args.profile else [])
    return R.in_a_process(cmd, out, ROW_TIMEOUT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/RESULTS-gpu.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (gloo)")
    ap.add_argument(
        "--profile", metavar="PATTERN", help="torch.profiler tables for rows matching PATTERN"
    )
    ap.add_argument("--ws2-steps", type=int, default=3, help="0: no world-size-2 section")
    ap.add_argument(
        "--ws2-stages", default="0123", help="the stages of the world-size-2 section (0123)"
    )
    ap.add_argument(
        "--only", metavar="PATTERN", help="measure only rows matching PATTERN (and eager)"
    )
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, in this process
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not set(args.ws2_stages) <= set("0123"):
        ap.error(f"--ws2-stages: digits 0-3, got {args.ws2_stages!r}")
    args.smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    cfg = R.SMOKE if args.smoke else R.GPT
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.row:
        return run_row(args, device, cfg)
    n_params = sum(p.numel() for p in R.new_model(cfg, torch.device("cpu")).parameters())
    flops_per_token = 6 * n_params + 12 * cfg["layers"] * cfg["block"] * cfg["d"]
    tokens = R.BATCH * cfg["block"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peaks = next((v for k, v in PEAKS.items() if k in name), None)
    flags = [f"--steps {args.steps} --warmup {args.warmup}"]
    flags += [f"--profile '{args.profile}'"] * bool(args.profile)
    flags += [f"--only '{args.only}'"] * bool(args.only)
    flags += [f"--ws2-steps {args.ws2_steps}"] * (args.ws2_steps != 3)
    flags += [f"--ws2-stages {args.ws2_stages}"] * (args.ws2_stages != "0123")
    lines = [
        f"# fzero on one GPU ({'smoke run, CPU' if args.smoke else name})\n",
        f"{datetime.date.today()}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"`python benchmarks/gpu.py {' '.join(flags)}`.\n",
        f"Model: {n_params / 1e6:.1f}M parameters ({cfg}), {R.BATCH} x {cfg['block']} tokens "
        f"per step, fused AdamW (lr {R.LR}). Median of {args.steps} steps after "
        f"{args.warmup} warm-up steps, each row in a fresh process; MFU = "
        f"{flops_per_token / 1e6:.0f} MFLOP/token x tokens/s / dense peak.\n",
    ]
    profiles: list[str] = []

    def flush() -> str:
        """Rewrite the results file with what has been measured so far."""
        text = "\n".join(lines) + "\n"
        if profiles:
            text += "\n# Profiles (3 steps: by GPU time, then by host time)\n\n"
            text += "\n".join(profiles)
        Path(args.out).write_text(text)
        return text

    scratch = Path(tempfile.mkdtemp(prefix="fzero-gpu-rows-"))
    for prec in ("fp32", "bf16"):
        lines += [
            f"\n## {prec}\n",
            "| configuration | step (ms) | × eager | tokens/s | MFU | peak alloc (MiB) "
            "| max abs Δ vs eager |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        base = None
        for i, label in enumerate(R.builders(cfg, prec, device)):
            if args.only and i and not re.search(args.only, f"{prec} {label}"):
                continue
            r = row_in_a_process(args, prec, label, scratch / f"{prec}-{i}.pt")
            if isinstance(r, str):  # the row failed: say so in its place, go on
                lines.append(f"| {label} | failed: {r.splitlines()[-1][:120]} | | | | | |")
                print(prec, label, "failed:\n", r, flush=True)
                flush()
                continue
            base = base or r
            tps = tokens / r["time"]
            mfu = f"{flops_per_token * tps / peaks[prec]:.1%}" if peaks else "n/a"
            peak = f"{r['peak'] / 2**20:,.0f}" if r["peak"] is not None else "n/a"
            delta = R.max_delta(r["params"], base["params"])
            lines.append(
                f"| {label} | {r['time'] * 1e3:.1f} | {r['time'] / base['time']:.3f} | "
                f"{tps:,.0f} | {mfu} | {peak} | {delta:.2e} |"
            )
            print(prec, lines[-1], flush=True)
            if "profile" in r:
                profiles.append(f"## {prec} {label}\n\n```\n{r['profile']}\n```\n")
            flush()
    if args.ws2_steps:
        world_size_two(args, cfg, device, lines, flush)
    print(flush())


def world_size_two(
    args: argparse.Namespace,
    cfg: dict[str, int],
    device: torch.device,
    lines: list[str],
    flush: Any,
) -> None:
    """Stages 0-3 on two ranks sharing the device over gloo, against the eager loop."""
    ref_model, ref_step, ref_final = R.eager(cfg, "fp32", device)
    for tokens in R.batches(args.ws2_steps, cfg, device):
        ref_step(tokens)
    want = {k: v.detach().cpu() for k, v in ref_final().items()}
    del ref_model, ref_step, ref_final
    sim = fzero.Simulation(2, device=None if args.smoke else "cuda", collective_timeout=300)
    lines += [
        "\n## World size 2 on one device over gloo (float32, correctness)\n",
        f"{args.ws2_steps} steps, {R.BATCH // 2} sequences per rank; max abs Δ of the gathered "
        "parameters against the eager loop on the 8 sequences.\n",
        "| stage | max abs Δ vs eager |",
        "|---|---:|",
    ]
    for s in sorted({int(c) for c in args.ws2_stages}):
        got = sim.run(R.world_two, cfg, s, args.ws2_steps)[0]
        lines.append(f"| {s} | {R.max_delta(got, want):.2e} |")
        print(f"ws2 stage {s}: {R.max_delta(got, want):.2e}", flush=True)
        flush()


if __name__ == "__main__":
    main()
