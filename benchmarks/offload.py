"""Offload on the CPU: a step with the optimizer state in memory, on the host tier, and on
disk (page cache warm, and cold), side by side, with each rank's peak resident memory.

    python benchmarks/offload.py [--world-size 2] [--steps 6] [--stages 1,3]
                                 [--directory DIR] [--out RESULTS-offload-cpu.md]

The benchmark GPT (`benchmarks/models.py`, 5.33M parameters, AdamW, float32) on
`--world-size` simulated ranks (processes, gloo, one thread each). Times: one run holds
every configuration's state and steps them in turn on the same batches (the median step
of each, the slowest rank's). Memory: a run per configuration, whose parameters after the
steps are compared with the in-memory run's (offload is bitwise the same training).
"disk, cold" evicts the offload file from the page cache before every step
(`posix_fadvise(DONTNEED)` after writing it back), so each unit's state is read from the
disk itself; "warm" leaves the kernel's cache alone. Peak resident memory is each
rank's VmHWM over the timed steps, above its resident size before the state was made;
kernel time is the rank's system CPU time per step (page faults, the mapping's writes
back, the gloo sockets).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build_model, rank_batch, spec

import fzero

CONFIGS = [("in memory", None), ("host", "host"), ("disk, warm", "disk"), ("disk, cold", "cold")]


def _status() -> dict[str, int]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.startswith("Vm")}


def rank(mesh: fzero.Mesh, tier: str | None, stage: int, steps: int, directory: str) -> Any:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # RSS follows live tensors (tests/support.py)
    s = spec("gpt", quick=False)
    model = build_model(s)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    units = [".".join(g) if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    units = [u for u in units] + list(s.extra_units)
    opt = fzero.optim.adamw(lr=1e-3)
    offload = None
    if tier is not None:
        offload = fzero.Offload("host") if tier == "host" else fzero.Offload("disk", 1.0, directory)
    start = _status()["VmRSS"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, offload=offload)

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return s.loss(torch.func.functional_call(model, p, (x,)), y)

    step = fzero.sharded_step(loss, opt, mesh, stage=stage, module=model, units=units)
    state, _ = step(state, rank_batch(s, 0, mesh.rank, mesh.size))  # builds the caches
    Path("/proc/self/clear_refs").write_text("5")
    times = []
    cpu0 = os.times()
    for t in range(1, steps + 1):
        if tier == "cold":
            state.offload.spill.drop_cache()
        t0 = time.perf_counter()
        state, _ = step(state, rank_batch(s, t, mesh.rank, mesh.size))
        times.append(time.perf_counter() - t0)
    cpu1 = os.times()
    peak = _status()["VmHWM"] - start
    report = fzero.memory_report(state)
    params_out = fzero.master_params(state, mesh) if state.master is not None else None
    if params_out is None:
        params_out = fzero.gather_params(state.params, mesh)
    return {
        "ms": statistics.median(times) * 1e3,
        "sys": (cpu1.system - cpu0.system) / steps * 1e3,
        "peak": peak,
        "off": report.host + report.disk,
        "params": params_out if mesh.rank == 0 else None,
    }


def interleaved(mesh: fzero.Mesh, stage: int, steps: int, directory: str) -> Any:
    """Every configuration's state in one process, stepped in turn on the same batches:
    each step's time and kernel time per configuration (this guest's speed drifts
    between runs; in turn, every configuration sees the same drift)."""
    s = spec("gpt", quick=False)
    model = build_model(s)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    units = [".".join(g) if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    units = [*units, *s.extra_units]
    opt = fzero.optim.adamw(lr=1e-3)

    def loss(p: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return s.loss(torch.func.functional_call(model, p, (x,)), y)

    runs = []
    for _, tier in CONFIGS:
        offload = None
        if tier is not None:
            offload = (
                fzero.Offload("host") if tier == "host" else fzero.Offload("disk", 1.0, directory)
            )
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=units, offload=offload)
        step = fzero.sharded_step(loss, opt, mesh, stage=stage, module=model, units=units)
        state, _ = step(state, rank_batch(s, 0, mesh.rank, mesh.size))
        runs.append([tier, state, step, [], 0.0])
    for t in range(1, steps + 1):
        for run in runs:
            tier, state, step = run[:3]
            if tier == "cold":
                state.offload.spill.drop_cache()
            cpu0, t0 = os.times(), time.perf_counter()
            run[1], _ = step(state, rank_batch(s, t, mesh.rank, mesh.size))
            run[3].append(time.perf_counter() - t0)
            run[4] += os.times().system - cpu0.system
    return [(statistics.median(r[3]) * 1e3, r[4] / steps * 1e3) for r in runs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--directory", default=None, help="the disk tier's directory (a temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-offload-cpu.md"))
    args = ap.parse_args()
    directory = args.directory or tempfile.mkdtemp(prefix="fzero-offload-")
    fs = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    fs_line = " ".join(fs[-1].split()[:2]) if fs else "?"
    rows = []
    for stage in [int(x) for x in args.stages.split(",")]:
        base = None
        timed = fzero.simulate(args.world_size, interleaved, stage, args.steps, directory)
        for c, (label, tier) in enumerate(CONFIGS):
            out = fzero.simulate(args.world_size, rank, tier, stage, args.steps, directory)
            same = (
                ""
                if base is None
                else (
                    "yes"
                    if all(
                        torch.equal(a, b) for a, b in zip(out[0]["params"].values(), base.values())
                    )
                    else "NO"
                )
            )
            if base is None:
                base = out[0]["params"]
                ref_ms = max(r[0][0] for r in timed)
            ms = max(r[c][0] for r in timed)
            peak = max(o["peak"] for o in out) / 2**20
            off = out[0]["off"] / 2**20
            sys_ms = max(r[c][1] for r in timed)
            rows.append((stage, label, ms, ms / ref_ms, sys_ms, peak, off, same))
            print(rows[-1], flush=True)
    lines = [
        "# Offload on the CPU (issue 49)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}: `python benchmarks/offload.py --world-size "
        f"{args.world_size} --steps {args.steps} --stages {args.stages}`. Offload directory "
        f"on `{fs_line}` (device, filesystem).",
        "",
        f"{spec('gpt', quick=False).title}, AdamW, float32, {args.world_size} ranks "
        f"(processes, gloo, one thread each); median of {args.steps} steps after a first, "
        "stepped in turn; "
        "peak: the largest rank's VmHWM over those steps above its RSS before `shard_state`.",
        "",
        "| stage | optimizer state | step (ms) | × in memory | kernel time (ms/step) "
        "| peak RSS (MiB) | offloaded (MiB/rank) | bitwise in-memory's |",
        "|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for stage, label, ms, ratio, sys_ms, peak, off, same in rows:
        lines.append(
            f"| {stage} | {label} | {ms:.1f} | {ratio:.2f} | {sys_ms:.1f} | {peak:.1f} | "
            f"{off:.1f} | {same or '-'} |"
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
