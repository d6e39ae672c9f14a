"""fzero on one GPU beside an eager loop, DDP and FSDP2: step time, tokens/s, MFU, memory.

    python benchmarks/gpu.py [--steps 20] [--warmup 5] [--out benchmarks/RESULTS-gpu.md]
    python benchmarks/gpu.py --profile 'bf16 (eager|fzero stage 3)'   # add profiler tables
    python benchmarks/gpu.py --smoke        # a tiny model on the CPU: checks the script

A GPT-like decoder (124M-class: 12 blocks of width 768, 1024 tokens, vocabulary 50304,
untied head) trains in float32 and in bfloat16 mixed precision, each configuration from
the same initial values on the same tokens, with torch's fused AdamW everywhere (fzero
through `fzero.optim.from_torch`, so the kernels are the same and the step around them
is what differs):

- eager: the model, `loss.backward()`, `optimizer.step()` (bf16: under torch.autocast);
- DDP, and FSDP2 (`fully_shard` per block, then the root; bf16: MixedPrecisionPolicy),
  resharding after the forward and keeping;
- fzero stages 0-3 (units per block, `module=` hooks; bf16: `fzero.Precision`), and
  stage 3 keeping its units (`reshard_after_forward=False`).

All at world size 1 on NCCL; then stages 0-3 at world size 2 on the one GPU over gloo
(`fzero.Simulation(2, device="cuda")`), for correctness only. Each row reports the
median step time, tokens/s, MFU (6 N + 12 L T d FLOPs per token against the device's
dense peak), `torch.cuda.max_memory_allocated`, and max |delta| of the final
parameters against the eager loop (world size 2: against the eager loop on the
concatenated batch). `--profile PATTERN` adds torch.profiler's top CUDA kernels for
the rows whose "precision label" the pattern matches. The results file is rewritten
after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fzero
from fzero._demo import Block, TinyGPT

GPT = dict(vocab=50304, block=1024, d=768, layers=12, heads=12)
SMOKE = dict(vocab=64, block=16, d=32, layers=2, heads=2)
BATCH = 8  # sequences per rank per step
LR = 3e-4
# Dense peak FLOP/s by device name and compute dtype (NVIDIA's datasheets, SXM parts).
PEAKS = {"H100": {"bf16": 989e12, "fp32": 67e12}, "H200": {"bf16": 989e12, "fp32": 67e12}}


def batch(step: int, n: int, cfg: dict[str, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(cfg["vocab"], (n, cfg["block"] + 1), generator=g).to(device)


def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def adamw(params: Any, device: torch.device) -> torch.optim.Optimizer:
    if device.type == "cuda":
        return torch.optim.AdamW(params, lr=LR, fused=True)
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def fzero_adamw(device: torch.device) -> fzero.optim.Optimizer:
    if device.type == "cuda":
        return fzero.optim.from_torch(torch.optim.AdamW, lr=LR, fused=True)
    return fzero.optim.from_torch(torch.optim.AdamW, lr=LR, foreach=False)


def new_model(cfg: dict[str, int], device: torch.device) -> TinyGPT:
    """The model built eagerly on `device` after `torch.manual_seed(0)`."""
    torch.manual_seed(0)
    with device:
        return TinyGPT(**cfg)


def sharded_model(
    cfg: dict[str, int], mesh: fzero.Mesh, opt: fzero.optim.Optimizer, **kw: Any
) -> tuple[TinyGPT, fzero.TrainState]:
    """The model on the meta device and fzero's state initialised from it, bitwise the
    values `new_model` makes (`fzero.init.from_module`): no second copy of the parameters
    in the nn.Module, as FSDP2's `fully_shard` keeps none."""
    with torch.device("meta"):
        model = TinyGPT(**cfg)
    init = fzero.init.from_module(model, seed=0, device=mesh.device)
    state = fzero.shard_state(dict(model.named_parameters()), opt, mesh, init=init, **kw)
    return model, state


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    step: Callable[[int], None], steps: int, warmup: int, device: torch.device
) -> list[float]:
    times = []
    for t in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        step(t)
        sync(device)
        if t >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def torch_step(
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    cfg: dict[str, int],
    autocast: bool,
    device: torch.device,
) -> Callable[[int], None]:
    """A plain torch training step on step t's tokens (bf16 autocast if asked)."""

    def step(t: int) -> None:
        tokens = batch(t, BATCH, cfg, device)
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = loss_of(forward(tokens[:, :-1]), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def eager(cfg: dict[str, int], prec: str, device: torch.device) -> Any:
    model = new_model(cfg, device)
    step = torch_step(model, adamw(model.parameters(), device), cfg, prec == "bf16", device)
    return model, step, lambda: dict(model.named_parameters())


def ddp(cfg: dict[str, int], prec: str, device: torch.device) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    model = new_model(cfg, device)
    wrapped = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    step = torch_step(wrapped, adamw(wrapped.parameters(), device), cfg, prec == "bf16", device)
    return wrapped, step, lambda: dict(model.named_parameters())


def fsdp2(cfg: dict[str, int], prec: str, device: torch.device, reshard: bool = True) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = new_model(cfg, device)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if prec == "bf16" else None
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    kw.update({"mp_policy": mp} if mp else {})
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    # No autocast: FSDP2's policy casts the parameters, as fzero's Precision does.
    step = torch_step(model, adamw(model.parameters(), device), cfg, False, device)
    return model, step, lambda: {k: v.full_tensor() for k, v in model.named_parameters()}


def fzero_run(
    cfg: dict[str, int], prec: str, device: torch.device, stage: int, reshard: bool = True
) -> Any:
    mesh = fzero.ProcessGroupMesh()
    assert mesh.device == device, (mesh.device, device)
    units = fzero.units.by_module(new_model(cfg, torch.device("meta")), Block)
    bf16 = prec == "bf16"
    precision = fzero.Precision(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    opt = fzero_adamw(device)
    model, state = sharded_model(cfg, mesh, opt, stage=stage, units=units, precision=precision)
    box = [state]
    del state

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return loss_of(functional_call(model, p, (tokens[:, :-1],)), tokens)

    train = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=units, module=model, reshard_after_forward=reshard
    )

    def step(t: int) -> None:
        box[0], _ = train(box[0], batch(t, BATCH, cfg, device))

    def final() -> dict[str, torch.Tensor]:
        s = box[0]
        if s.master is not None:
            return fzero.master_params(s, mesh)
        return fzero.gather_params(s.params, mesh)

    return box, step, final


def max_delta(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def measure(
    name: str, build: Callable[[], Any], steps: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    gc.collect()  # a model whose hooks refer back to it lives in a cycle: not in this row
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    held, step, final = build()
    times = timed(step, steps, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # On the host: earlier rows' parameters must not count in later rows' peaks.
    params = {k: v.detach().to("cpu", copy=True) for k, v in final().items()}
    del held, step, final
    return {"name": name, "time": statistics.median(times), "peak": peak, "params": params}


def profile(build: Callable[[], Any], device: torch.device, rows: int = 12) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    _, step, _ = build()
    for t in range(3):
        step(t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with run_profile(activities=acts) as prof:
        for t in range(3, 6):
            step(t)
        sync(device)
    # Device kernels show what the GPU did; self CPU time shows what the host spent
    # launching it (fzero's own overhead at world size 1 is host time, if anything).
    avg = prof.key_averages()
    tables = [avg.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if device.type == "cuda":
        tables.insert(0, avg.table(sort_by="cuda_time_total", row_limit=rows))
    return "\n".join(tables)


def world_two(mesh: fzero.Mesh, cfg: dict[str, int], stage: int, steps: int) -> Any:
    """One of two ranks sharing the GPU over gloo: stage `stage`, float32."""
    device = mesh.device
    units = fzero.units.by_module(new_model(cfg, torch.device("meta")), Block)
    opt = fzero_adamw(device)
    model, state = sharded_model(cfg, mesh, opt, stage=stage, units=units)

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return loss_of(functional_call(model, p, (tokens[:, :-1],)), tokens)

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units, module=model)
    for t in range(steps):
        half = BATCH // 2  # the eager loop's batch, split between the two ranks
        state, _ = step(state, batch(t, BATCH, cfg, device)[mesh.rank * half :][:half])
    return {k: v.cpu() for k, v in fzero.gather_params(state.params, mesh).items()}


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
        "--only", metavar="PATTERN", help="measure only rows matching PATTERN (and eager)"
    )
    args = ap.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    cfg = SMOKE if smoke else GPT
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.mktemp(prefix="fzero-gpu-")
    dist.init_process_group(
        "gloo" if smoke else "nccl", store=dist.FileStore(store, 1), rank=0, world_size=1
    )
    n_params = sum(p.numel() for p in new_model(cfg, torch.device("cpu")).parameters())
    flops_per_token = 6 * n_params + 12 * cfg["layers"] * cfg["block"] * cfg["d"]
    tokens = BATCH * cfg["block"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peaks = next((v for k, v in PEAKS.items() if k in name), None)
    lines = [
        f"# fzero on one GPU ({'smoke run, CPU' if smoke else name})\n",
        f"{datetime.date.today()}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"`python benchmarks/gpu.py --steps {args.steps} --warmup {args.warmup}"
        + (f" --profile '{args.profile}'" if args.profile else "")
        + (f" --only '{args.only}'" if args.only else "")
        + (f" --ws2-steps {args.ws2_steps}" if args.ws2_steps != 3 else "")
        + "`.\n",
        f"Model: {n_params / 1e6:.1f}M parameters ({cfg}), {BATCH} x {cfg['block']} tokens "
        f"per step, fused AdamW (lr {LR}). Median of {args.steps} steps after "
        f"{args.warmup} warm-up steps; MFU = {flops_per_token / 1e6:.0f} MFLOP/token x "
        "tokens/s / dense peak.\n",
    ]
    profiles: list[str] = []

    def flush() -> str:
        """Rewrite the results file with what has been measured so far."""
        text = "\n".join(lines) + "\n"
        if profiles:
            text += "\n# Profiles (top kernels by time, 3 steps)\n\n" + "\n".join(profiles)
        Path(args.out).write_text(text)
        return text

    for prec in ("fp32", "bf16"):
        configs: dict[str, Callable[[], Any]] = {
            "eager (fused AdamW)": lambda p=prec: eager(cfg, p, device),
            "DDP": lambda p=prec: ddp(cfg, p, device),
            "FSDP2 (per block, reshard)": lambda p=prec: fsdp2(cfg, p, device),
            "FSDP2 (per block, keep)": lambda p=prec: fsdp2(cfg, p, device, reshard=False),
        }
        for s in range(4):
            configs[f"fzero stage {s}"] = lambda p=prec, s=s: fzero_run(cfg, p, device, s)
        configs["fzero stage 3 (keep)"] = lambda p=prec: fzero_run(cfg, p, device, 3, False)
        lines += [
            f"\n## {prec}\n",
            "| configuration | step (ms) | × eager | tokens/s | MFU | peak alloc (MiB) "
            "| max abs Δ vs eager |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        base = None
        for label, build in configs.items():
            if args.only and base and not re.search(args.only, f"{prec} {label}"):
                continue
            r = measure(label, build, args.steps, args.warmup, device)
            base = base or r
            tps = tokens / r["time"]
            mfu = f"{flops_per_token * tps / peaks[prec]:.1%}" if peaks else "n/a"
            peak = f"{r['peak'] / 2**20:,.0f}" if r["peak"] is not None else "n/a"
            lines.append(
                f"| {r['name']} | {r['time'] * 1e3:.1f} | {r['time'] / base['time']:.3f} | "
                f"{tps:,.0f} | {mfu} | {peak} | {max_delta(r['params'], base['params']):.2e} |"
            )
            print(prec, lines[-1], flush=True)
            if args.profile and re.search(args.profile, f"{prec} {label}"):
                try:
                    table = profile(build, device)
                except Exception as e:  # a profiler that fails must not lose the run
                    table = f"profiler failed: {type(e).__name__}: {e}"
                profiles.append(f"## {prec} {label}\n\n```\n{table}\n```\n")
            flush()
    dist.destroy_process_group()
    if not args.ws2_steps:
        print(flush())
        return
    # World size 2 on the one device over gloo: correctness beside the eager loop.
    ref_model, ref_step, ref_final = eager(cfg, "fp32", device)
    for t in range(args.ws2_steps):
        ref_step(t)
    want_cpu = {k: v.detach().cpu() for k, v in ref_final().items()}
    del ref_model, ref_step, ref_final
    sim = fzero.Simulation(2, device=None if smoke else "cuda", collective_timeout=300)
    lines += [
        "\n## World size 2 on one device over gloo (float32, correctness)\n",
        f"{args.ws2_steps} steps, {BATCH // 2} sequences per rank; max abs Δ of the gathered "
        "parameters against the eager loop on the 8 sequences.\n",
        "| stage | max abs Δ vs eager |",
        "|---|---:|",
    ]
    for s in range(4):
        got = sim.run(world_two, cfg, s, args.ws2_steps)[0]
        lines.append(f"| {s} | {max_delta(got, want_cpu):.2e} |")
        print(f"ws2 stage {s}: {max_delta(got, want_cpu):.2e}", flush=True)
        flush()
    print(flush())
    if os.path.exists(store):
        os.unlink(store)


if __name__ == "__main__":
    main()
