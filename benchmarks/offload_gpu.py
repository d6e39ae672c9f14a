"""Offload on one GPU (issue 49): offloaded against on-device steps, a model that fits only
offloaded, and FSDP2's CPUOffloadPolicy beside both.

    python benchmarks/offload_gpu.py [--steps 4] [--warmup 2] [--only PATTERN] [--batch-a 8]
                                     [--out benchmarks/RESULTS-offload.md]
    python benchmarks/offload_gpu.py --smoke     # tiny models on the CPU: checks the script

Two GPT-like decoders (`fzero._tools._demo.TinyGPT`, 1024 tokens, vocabulary 50304,
untied head), bf16 mixed precision (fp32 masters, fp32 gradient reduction), AdamW, world
size 1 on NCCL, one unit per block:

- **A** (d 2048, 24 blocks: 1.41B parameters, 8 sequences a step) fits on an 80 GB GPU
  both ways: fzero stage 3 on the GPU, offloaded to the host (overlapped with the
  backward, and after it), half of it offloaded; FSDP2 with `CPUOffloadPolicy`.
- **B** (d 4096, 26 blocks: 5.65B parameters, 4 sequences a step) does not fit with its
  state on an 80 GB GPU (12 bytes a parameter of masters and moments: 68 GB, before
  activations): the on-device row shows the out-of-memory; then fzero offloaded, and
  FSDP2 with `CPUOffloadPolicy`. (On a 141 GB H200 it fits: the row then says so. Its
  host needs ~70 GB of pinned memory.)

fzero runs `fzero.optim.adamw` (the same arithmetic on the GPU and on the host: the
offloaded rows are bitwise the on-device one), and in the "fused AdamW" rows
`adamw(fused=True)` on the host (each large piece one compiled kernel, threaded: the fast host
optimizer, to a few ulps); FSDP2 runs `torch.optim.AdamW` on its
CPU-resident parameters (torch's default implementation there). Each row runs in a fresh
process; the median of `--steps` steps after `--warmup` (the first step of an offloaded
state runs its update after the backward: it shows the optimizer never asks for the
global norm). Reported: step time, tokens/s, TFLOPS (6 N + 12 L T d FLOPs a token), peak
GPU memory (`max_memory_allocated`), peak host RSS, and for model A the final parameters'
max |delta| against fzero on the GPU. `--profile PATTERN` adds torch.profiler's tables.
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
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_rows as R

import fzero

MODELS = {
    "A": (dict(vocab=50304, block=1024, d=2048, layers=24, heads=16), 8),
    "B": (dict(vocab=50304, block=1024, d=4096, layers=26, heads=32), 4),
}
SMOKE = {
    "A": (dict(vocab=64, block=16, d=32, layers=2, heads=2), 4),
    "B": (dict(vocab=64, block=16, d=64, layers=3, heads=2), 2),
}
ROWS = [  # (model, label, builder name, offload keywords)
    ("A", "fzero stage 3, on the GPU", "fzero", None),
    ("A", "fzero stage 3, offload host, overlapped", "fzero", {}),
    ("A", "fzero stage 3, offload host, after the backward", "fzero", {"overlap": False}),
    ("A", "fzero stage 3, offload host 0.5, overlapped", "fzero", {"fraction": 0.5}),
    ("A", "fzero stage 3, offload host, fused AdamW, overlapped", "fzero", {"fused": True}),
    (
        "A",
        "fzero stage 3, offload host, fused AdamW, after the backward",
        "fzero",
        {"fused": True, "overlap": False},
    ),
    ("A", "FSDP2, CPUOffloadPolicy", "fsdp2", None),
    ("B", "fzero stage 3, on the GPU", "fzero", None),
    ("B", "fzero stage 3, offload host, overlapped", "fzero", {}),
    ("B", "fzero stage 3, offload host, fused AdamW, overlapped", "fzero", {"fused": True}),
    ("B", "FSDP2, CPUOffloadPolicy", "fsdp2", None),
]


def fzero_offloaded(cfg: dict[str, int], device: torch.device, offload: Any) -> Any:
    """fzero stage 3, bf16, on the GPU (`offload` None) or offloaded (`fused`: the host's
    AdamW as one compiled kernel a large piece, `adamw(fused=True)`)."""
    mesh = fzero.ProcessGroupMesh()
    precision = fzero.Precision(torch.bfloat16, reduce_dtype=torch.float32)
    offload = None if offload is None else dict(offload)
    fused = offload is not None and offload.pop("fused", False)
    opt = fzero.optim.adamw(lr=R.LR, fused=True if fused else None)
    kw: dict[str, Any] = {"stage": 3, "precision": precision}
    if offload is not None:
        kw["offload"] = fzero.Offload("host", **offload)
    model, units, state = R.sharded_model(cfg, mesh, opt, **kw)
    box = [state]
    del state

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return R.loss_of(functional_call(model, p, (tokens[:, :-1],)), tokens)

    train = fzero.sharded_step(loss_fn, opt, mesh, stage=3, units=units, module=model)

    def step(tokens: torch.Tensor) -> None:
        box[0], _ = train(box[0], tokens)

    return box, step, lambda: fzero.master_params(box[0], mesh)


def fsdp2_offloaded(cfg: dict[str, int], device: torch.device) -> Any:
    """FSDP2 per block, then the root, bf16 (`MixedPrecisionPolicy`), parameters and
    optimizer on the CPU (`CPUOffloadPolicy`), `torch.optim.AdamW` stepping there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = R.new_model(cfg, torch.device("cpu"))
    mesh = init_device_mesh(device.type, (1,))
    kw: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
    }
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=R.LR)
    step = R.torch_step(model, opt, False, device)
    return model, step, lambda: {k: v.full_tensor() for k, v in model.named_parameters()}


def host_peak() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_row(args: argparse.Namespace, device: torch.device) -> None:
    """`--row K`: measure ROWS[K] in this process, save it to --row-out."""
    name, _, kind, offload = ROWS[int(args.row)]
    cfg, per_step = sequences(args, name)
    R.BATCH = per_step  # `R.batches` reads it
    store = tempfile.mktemp(prefix="fzero-offload-gpu-")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store, 1), rank=0, world_size=1)
    warmup, steps = (args.warmup_b, args.steps_b) if name == "B" else (args.warmup, args.steps)
    data = R.batches(warmup + steps, cfg, device)

    def build() -> Any:
        """The row's (held, step, final), `final` cut to a sample of the parameters (the
        first two blocks and the final norm; none for model B): a whole copy of the
        parameters on the host, per row, would cost more than the steps."""
        made = (
            fzero_offloaded(cfg, device, offload)
            if kind == "fzero"
            else fsdp2_offloaded(cfg, device)
        )
        held, step, final = made
        if name == "B":
            return held, step, dict
        keep = ("blocks.0.", "blocks.1.", "ln.")
        return held, step, lambda: {k: v for k, v in final().items() if k.startswith(keep)}

    try:
        row: dict[str, Any] = R.measure(build, data, warmup, device)
    except torch.cuda.OutOfMemoryError as e:
        row = {"oom": str(e).splitlines()[0][:160]}
    row["host_peak"] = host_peak()
    if args.profile and re.search(args.profile, f"{name} {ROWS[int(args.row)][1]}"):
        try:
            row["profile"] = R.profile(build, data, device)
        except Exception as e:  # a profiler that fails must not lose the row
            row["profile"] = f"profiler failed: {type(e).__name__}: {e}"
    torch.save(row, args.row_out)
    dist.destroy_process_group()
    Path(store).unlink(missing_ok=True)


def sequences(args: argparse.Namespace, name: str) -> tuple[dict[str, int], int]:
    """Model `name`'s configuration and sequences a step (`--batch-a` for model A)."""
    cfg, per_step = (SMOKE if args.smoke else MODELS)[name]
    return cfg, (args.batch_a or per_step) if name == "A" else per_step


def row_in_a_process(args: argparse.Namespace, k: int, out: Path) -> Any:
    """Row k measured by a fresh process of this script, or the tail of its failure."""
    cmd = [sys.executable, __file__, "--row", str(k), "--row-out", str(out)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--steps-b", str(args.steps_b), "--warmup-b", str(args.warmup_b)]
    cmd += ["--batch-a", str(args.batch_a)] if args.batch_a else []
    cmd += ["--smoke"] * args.smoke + (["--profile", args.profile] if args.profile else [])
    return R.in_a_process(cmd, out, args.row_timeout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps-b", type=int, default=2, help="model B's steps (slower)")
    ap.add_argument("--warmup-b", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/RESULTS-offload.md")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (gloo)")
    ap.add_argument("--only", metavar="PATTERN", help="only the rows matching PATTERN")
    ap.add_argument("--profile", metavar="PATTERN", help="profiles of rows matching PATTERN")
    ap.add_argument(
        "--batch-a", type=int, help="model A's sequences a step (8): the GPU's work per step"
    )
    ap.add_argument("--row-timeout", type=float, default=600, help="seconds a row may take")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row, in this process
    ap.add_argument("--row-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.row is not None:
        return run_row(args, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "smoke run, CPU"
    lines = [
        f"# Offload on one GPU ({gpu})\n",
        f"{datetime.date.today()}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"`python benchmarks/offload_gpu.py --steps {args.steps} --warmup {args.warmup} "
        f"--steps-b {args.steps_b} --warmup-b {args.warmup_b}"
        f"{f' --batch-a {args.batch_a}' if args.batch_a else ''}"
        f"{f' --only {args.only!r}' if args.only else ''}`. Median of the steps after the "
        "warm-up ones, each row in a fresh process (see the script's docstring).\n",
    ]
    scratch = Path(tempfile.mkdtemp(prefix="fzero-offload-rows-"))
    base: dict[str, Any] = {}
    for name in MODELS:
        cfg, per_step = sequences(args, name)
        n = sum(p.numel() for p in R.new_model(cfg, torch.device("meta")).parameters())
        flops = 6 * n + 12 * cfg["layers"] * cfg["block"] * cfg["d"]
        tokens = per_step * cfg["block"]
        lines += [
            f"\n## Model {name}: {n / 1e9:.2f}B parameters, {per_step} x {cfg['block']} "
            "tokens a step\n",
            "| configuration | step (s) | × on the GPU | tokens/s | TFLOPS | peak GPU (GiB) "
            "| peak host RSS (GiB) | max abs Δ vs on the GPU |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for k, (model, label, _, _) in enumerate(ROWS):
            if model != name or (args.only and not re.search(args.only, f"{name} {label}")):
                continue
            r = row_in_a_process(args, k, scratch / f"{k}.pt")
            if isinstance(r, str) or "oom" in r:
                why = (
                    r.splitlines()[-1][:160] if isinstance(r, str) else f"out of memory: {r['oom']}"
                )
                lines.append(f"| {label} | {why} | | | | | | |")
            else:
                if "on the GPU" in label:
                    base[name] = r
                ref = base.get(name)
                peak = f"{r['peak'] / 2**30:.1f}" if r["peak"] is not None else "n/a"
                ratio = f"{r['time'] / ref['time']:.2f}" if ref else "-"
                delta = "-"
                if ref and r["params"] and ref["params"]:
                    delta = f"{R.max_delta(r['params'], ref['params']):.2e}"
                lines.append(
                    f"| {label} | {r['time']:.3f} | {ratio} | "
                    f"{tokens / r['time']:,.0f} | {flops * tokens / r['time'] / 1e12:.1f} | "
                    f"{peak} | {r['host_peak'] / 2**30:.1f} | {delta} |"
                )
                if "profile" in r:
                    lines.append(f"\n```\n{r['profile']}\n```\n")
            print(lines[-1], flush=True)
            Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
