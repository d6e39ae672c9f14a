"""Offload on the CPU: a step with the optimizer state in memory, on the host tier, and on
disk (page cache warm, and cold), side by side, with each rank's peak resident memory.

    python benchmarks/offload.py [--world-sizes 1,2] [--steps 6] [--stages 1,3]
                                 [--directory DIR] [--out RESULTS-offload-cpu.md]

The benchmark GPT (`benchmarks/models.py`, 5.33M parameters, AdamW, float32) on each of
`--world-sizes` simulated ranks (processes, gloo, one thread each). At world size 1 on
this 2-core host the rank's compute thread and offload's host thread each have a core
(a GPU and its host, in miniature); at world size 2 the two ranks' compute threads take
both cores, and the host thread only competes with them. Offload steps its units during
the backward ("overlapped", the default) or after it (`Offload(overlap=False)`).

Times: one run holds every configuration's state and steps them in turn on the same
batches (the median step of each, the slowest rank's). Memory: a run per configuration,
whose parameters after the steps are compared with the in-memory run's (offload is
bitwise the same training). "disk, cold" evicts the offload file from the page cache
before every step
(`posix_fadvise(DONTNEED)` after writing it back), so each unit's state is read from the
disk itself; "warm" leaves the kernel's cache alone. Peak resident memory is each
rank's VmHWM over the timed steps, above its resident size before the state was made,
in a run of its own from a new interpreter (`measured_alone`);
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

# (label, tier, overlap): "cold" is the disk tier with its pages evicted before each step;
# overlap False steps every unit after the backward (`Offload(overlap=False)`).
CONFIGS = [
    ("in memory", None, True),
    ("host, after the backward", "host", False),
    ("host, overlapped", "host", True),
    ("disk warm, after the backward", "disk", False),
    ("disk warm, overlapped", "disk", True),
    ("disk cold, overlapped", "cold", True),
]


def make_offload(tier: str | None, overlap: bool, directory: str) -> fzero.Offload | None:
    if tier is None:
        return None
    if tier == "host":
        return fzero.Offload("host", overlap=overlap)
    return fzero.Offload("disk", 1.0, directory, overlap=overlap)


def _status() -> dict[str, int]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.startswith("Vm")}


def rank(
    mesh: fzero.Mesh, tier: str | None, overlap: bool, stage: int, steps: int, directory: str
) -> Any:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # RSS follows live tensors (tests/support.py)
    s = spec("gpt", quick=False)
    model = build_model(s)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    units = [".".join(g) if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    units = [u for u in units] + list(s.extra_units)
    opt = fzero.optim.adamw(lr=1e-3)
    offload = make_offload(tier, overlap, directory)
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
    for _, tier, overlap in CONFIGS:
        offload = make_offload(tier, overlap, directory)
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


def measured_alone(world: int, c: int, stage: int, steps: int, directory: str) -> Any:
    """Configuration c's memory run, from a new interpreter: ranks fork from their parent
    and inherit its heap, whose free chunks (this script's earlier results) would serve
    their allocations without their resident size rising."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.pt"
        cmd = [sys.executable, __file__, "--memory-run", f"{world},{c},{stage},{steps}"]
        cmd += ["--directory", directory, "--out", str(out)]
        subprocess.run(cmd, check=True, timeout=600)
        return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-sizes", default="1,2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stages", default="1,3")
    ap.add_argument("--directory", default=None, help="the disk tier's directory (a temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-offload-cpu.md"))
    ap.add_argument("--memory-run", help=argparse.SUPPRESS)  # internal: `measured_alone`
    args = ap.parse_args()
    directory = args.directory or tempfile.mkdtemp(prefix="fzero-offload-")
    if args.memory_run:
        world, c, stage, steps = (int(x) for x in args.memory_run.split(","))
        _, tier, overlap = CONFIGS[c]
        torch.save(fzero.simulate(world, rank, tier, overlap, stage, steps, directory), args.out)
        return
    fs = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    fs_line = " ".join(fs[-1].split()[:2]) if fs else "?"
    rows = []
    for world, stage in [
        (int(w), int(x)) for w in args.world_sizes.split(",") for x in args.stages.split(",")
    ]:
        base = None
        timed = fzero.simulate(world, interleaved, stage, args.steps, directory)
        for c, (label, _, _) in enumerate(CONFIGS):
            out = measured_alone(world, c, stage, args.steps, directory)
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
            rows.append((world, stage, label, ms, ms / ref_ms, sys_ms, peak, off, same))
            print(rows[-1], flush=True)
    lines = [
        "# Offload on the CPU (issue 49)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}: `python benchmarks/offload.py --world-sizes "
        f"{args.world_sizes} --steps {args.steps} --stages {args.stages}`. Offload directory "
        f"on `{fs_line}` (device, filesystem).",
        "",
        f"{spec('gpt', quick=False).title}, AdamW, float32, ranks as processes (gloo, one "
        f"compute thread each); median of {args.steps} steps after a first, "
        "stepped in turn; "
        "peak: the largest rank's VmHWM over those steps above its RSS before `shard_state`.",
        "",
        "| ranks | stage | optimizer state | step (ms) | × in memory | kernel time (ms/step) "
        "| peak RSS (MiB) | offloaded (MiB/rank) | bitwise in-memory's |",
        "|---:|---:|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for world, stage, label, ms, ratio, sys_ms, peak, off, same in rows:
        lines.append(
            f"| {world} | {stage} | {label} | {ms:.1f} | {ratio:.2f} | {sys_ms:.1f} | {peak:.1f} | "
            f"{off:.1f} | {same or '-'} |"
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
