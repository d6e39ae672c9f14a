"""One command: fzero stages 0-3 side by side with DDP, ZeroRedundancyOptimizer, FSDP2, FairScale.

python benchmarks/run.py [--quick] [--world-size 2] [--steps 20] [--models gpt,linear]
                         [--configs ddp,...] [--blocks-per-unit 1]
                         [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import configs  # noqa: E402
import report  # noqa: E402

# glibc keeps freed blocks below its (adaptive) mmap threshold on its heap, so RSS would
# not fall when a sharded configuration frees a gathered unit; 64 KiB makes every tensor
# buffer an mmap that goes back to the OS on free. Must be set before the process starts.
ALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return f"{os.cpu_count()} cores ({cpu}), {mem_kib / 2**20:.1f} GiB RAM, {platform.platform()}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny models, 4 steps, one pass (smoke test)"
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per configuration (default 20, or 4 with --quick); the first 3 are warm-up",
    )
    p.add_argument(
        "--launches",
        type=int,
        default=None,
        help="fresh process launches for "
        "the stepped-in-turn comparisons (default 3, or 1 with --quick)",
    )
    p.add_argument(
        "--models",
        default="gpt,linear",
        help="comma-separated subset of: "
        "gpt, linear, deep (hundreds of small leaves; not in the default run)",
    )
    p.add_argument(
        "--configs",
        default=",".join(c.name for c in configs.CONFIGS),
        help="comma-separated subset of: " + ", ".join(c.name for c in configs.CONFIGS),
    )
    p.add_argument(
        "--blocks-per-unit",
        type=int,
        default=1,
        help="consecutive blocks (or Linears) per unit, for fzero "
        "(fzero.units.grouped) and FSDP2 (fully_shard on the list) alike",
    )
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument(
        "--no-speed-pass",
        action="store_true",
        help="skip the second pass that times every configuration again with "
        "glibc's default allocator (about a third of the run time)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG path (default: memory_by_stage.png next to --out)",
    )
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    if args.quick:  # a smoke test: one pass keeps it under a minute
        args.no_speed_pass = True
    if args.launches is None:
        args.launches = 1 if args.quick else 3
    if args.launches < 1:
        p.error("--launches must be at least 1")
    if args.steps < 2:
        p.error("--steps must be at least 2")
    if args.blocks_per_unit < 1:
        p.error("--blocks-per-unit must be at least 1")
    unknown = set(args.configs.split(",")) - set(configs.BY_NAME)
    if unknown:
        p.error(f"unknown configurations: {sorted(unknown)}")
    return args


def _run_pass(args: argparse.Namespace, warmup: int, alloc_env: dict[str, str]) -> list[dict]:
    """One launcher run over every model and configuration; returns its records."""
    with tempfile.TemporaryDirectory(prefix="fzero-bench-") as tmp:
        plan = {
            "quick": args.quick,
            "world_size": args.world_size,
            "steps": args.steps,
            "launches": args.launches,
            "per_unit": args.blocks_per_unit,
            "models": args.models.split(","),
            "configs": args.configs.split(","),
            "warmup": warmup,
            "tmp": tmp,
            "results": str(Path(tmp) / "results.json"),
            "collective_timeout": 120,
            "config_timeout": 120 if args.quick else 600,
        }
        Path(tmp, "plan.json").write_text(json.dumps(plan))
        env = {**os.environ, "OMP_NUM_THREADS": "1", **alloc_env}
        for key in ALLOC_ENV:
            if key not in alloc_env:
                env.pop(key, None)
        subprocess.run(
            [sys.executable, str(HERE / "_worker.py"), str(Path(tmp, "plan.json"))],
            env=env,
            check=True,
            cwd=HERE,
        )
        out = json.loads(Path(plan["results"]).read_text())
    args.sources.append(out["fzero_source"])
    return out["records"]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    warmup = min(3, args.steps - 1)
    command = " ".join(
        ["python benchmarks/run.py", shlex.join(sys.argv[1:] if argv is None else argv)]
    ).strip()
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    args.sources = []
    print("== pass 1: memory and speed, MALLOC_MMAP_THRESHOLD_=65536", flush=True)
    rows, refs = report.aggregate(_run_pass(args, warmup, ALLOC_ENV), args.world_size, warmup)
    args.fast_refs = None
    if not args.no_speed_pass:
        print("== pass 2: speed with glibc's default allocator", flush=True)
        fast, args.fast_refs = report.aggregate(
            _run_pass(args, warmup, {}), args.world_size, warmup
        )
        report.attach_speed(rows, fast)
    elapsed = time.perf_counter() - t0
    args.loads = (load0, os.getloadavg()[0])
    lines = _markdown(args, rows, refs, command, warmup, elapsed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    png = args.plot or args.out.parent / "memory_by_stage.png"
    report.plot(rows, png)
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        print(f"\n{model}: speed\n" + "\n".join(report.speed_table(mine)))
        print(f"\n{model}: memory\n" + "\n".join(report.memory_table(mine)))
    print("\n" + "\n".join(report.bounds_table(rows)))
    print("\n" + "\n".join(report.targets(rows)))
    print("\n" + "\n".join(report.functional_cost(refs, args.fast_refs, warmup)))
    print("\n" + "\n".join(report.interleaved(refs, args.fast_refs, warmup, args.world_size)))
    print(f"\nwrote {args.out} and {png} ({elapsed:.0f} s)")


def _markdown(
    args: argparse.Namespace,
    rows: list[report.Row],
    refs: dict[str, dict],
    command: str,
    warmup: int,
    elapsed: float,
) -> list[str]:
    import torch
    from models import spec

    lines = [
        "# fzero benchmarks: side by side with DDP, ZeroRedundancyOptimizer, FSDP2, FairScale",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- machine: {machine()}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, fzero at "
        f"`{_git_state()}`, source hash {' / '.join(dict.fromkeys(args.sources))}"
        + (" (fzero changed between the passes!)" if len(set(args.sources)) > 1 else ""),
        f"- 1-minute load average {args.loads[0]:.1f} at the start, {args.loads[1]:.1f} at the "
        f"end (the ranks themselves make {args.world_size}; more means other processes "
        "competed for the cores: see the load column)",
        f"- command: `{command}` ({elapsed:.0f} s in all)",
        f"- world size {args.world_size}, gloo on 127.0.0.1, one process per rank forked "
        f"afresh per configuration, 1 thread each; Adam (lr 1e-3, torch defaults), float32; "
        f"{args.steps} steps, median step time over steps {warmup + 1}-{args.steps} (each "
        "step: the slowest rank's time, after a barrier)",
        "- two passes over every configuration: pass 1 with `MALLOC_MMAP_THRESHOLD_=65536` "
        "in the rank processes (RSS then tracks live tensors: all memory columns, max abs Δ, "
        "communication), pass 2 with glibc's default allocator (speed only; "
        + (
            "skipped in this run)"
            if args.no_speed_pass
            else "the speed columns marked 'default malloc')"
        ),
        "",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        s, ref = spec(model, args.quick, args.blocks_per_unit), refs[model]
        lines += [
            f"## {model}: {s.title}, {ref['psi']:,} parameters",
            "",
            f"Single-process reference (plain `torch.optim.Adam` on the concatenated "
            f"batch of {args.world_size} × {s.micro_batch}): "
            f"{sorted(ref['times'][warmup:])[len(ref['times'][warmup:]) // 2]:.3f} s/step, "
            f"final loss {ref['loss']:.4f}.",
            "",
        ]
        mine = [r for r in rows if r.model == model]
        lines += [
            "### Speed",
            "",
            *report.speed_table(mine),
            "",
            "### Memory (pass 1)",
            "",
            *report.memory_table(mine),
            "",
        ]
    lines += [
        "## fzero stages 2 and 3 against issue 3's bounds (UnitLedger peaks)",
        "",
        "Issue 3 asks for: stage 3, own shards of params, grads and optimizer state + 2 × "
        "the largest unit's full parameters + one unit's full gradients; stage 2, own "
        "gradient shard + one bucket. fzero runs with overlap_reduce=True (default), "
        "which keeps one burst's reduce-scatter in flight (a unit, or consecutive "
        "units no larger together than the largest) while the next unit "
        "differentiates: the gradient bound below is therefore two of the largest unit "
        "(one with overlap_reduce=False, checked in tests/engine/test_units.py), and "
        "stage 3's "
        "includes the root unit, gathered for the whole step. The ledger counts the "
        "full-unit buffers fzero itself holds, not activations or allocator slack; its "
        "params and grads peaks may come from different moments, so their sum "
        "over-states the peak.",
        "",
    ]
    lines += [*report.bounds_table(rows), ""]
    lines += [
        "## Targets (issue 7)",
        "",
        *report.targets(rows),
        "",
        "World size 1, the cost of being functional: a plain eager loop (module + "
        "`torch.optim.Adam`) and fzero stage 0 alternating step by step in one process "
        f"on the whole batch, in {args.launches} fresh launch(es).",
        "",
        *report.functional_cost(refs, args.fast_refs, warmup),
        "",
        "Stepped in turn: fzero stage 0 with DDP and fzero stage 1 with "
        "ZeroRedundancyOptimizer (issue 7), fzero stages 1-3 with DDP (issue 16: "
        "stages 1-2 ≤ 1.05 × DDP; stage 3, resharding, ≤ 1.10 × DDP at world size 2, "
        "≤ 1.25 × at 4), each pair built side by side in two rank processes of its "
        f"own, in {args.launches} fresh launch(es). The targets above time each "
        "configuration in its own processes, one after another, where run-to-run "
        "drift exceeds the few percent these targets are about; this table is the "
        "verdict for them.",
        "",
        "Why launches and page faults: on this machine a page fault costs ~3 µs, and "
        "whether glibc trims the freed top of the heap (so the next allocation there "
        "faults its pages back in) depends on where a process's allocations land, which "
        "changes from launch to launch. On the Linear stack at world size 1, the eager "
        "loop alone in a process, three launches: 0.9k, 9.7k and 58k faults per step "
        "(230, 243 and 356 ms), most of them torch.optim.Adam's two temporaries per "
        "leaf; fzero's Adam writes its denominators into one scratch buffer instead, "
        "one allocation per step. The verdict is the median of the launches' ratios; "
        "every launch's ratio is shown. (Pairs, not all four configurations in one "
        "process: there the others' allocations kept fzero stage 0's gradients at the "
        "heap top, ~10k faults per step on the Linear stack against 3 beside DDP "
        "alone.)",
        "",
        *report.interleaved(refs, args.fast_refs, warmup, args.world_size),
        "",
    ]
    lines += ["## How to read this", "", *_NOTES, ""]
    if args.blocks_per_unit > 1:
        lines += [
            f"**This run groups {args.blocks_per_unit} consecutive blocks (or Linears) "
            "into each unit**, for fzero (`fzero.units.grouped`) and FSDP2 (one "
            "`fully_shard` on the list) alike, where the notes above say one per "
            "block.",
            "",
        ]
    failed = [r for r in rows if r.error]
    if failed:
        lines += ["## Failures", ""]
        for r in failed:
            lines += [f"### {r.model} / {r.label}", "", "```", r.error[-3000:], "```", ""]
    return lines


def _git_state() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=HERE,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


_NOTES = [
    "- **Two allocator settings.** `MALLOC_MMAP_THRESHOLD_=65536` makes every buffer of 64 KiB "
    "or more its own mmap, returned to the OS on free: RSS then tracks live tensors, but "
    "every such allocation page-faults afresh, which slows configurations in proportion "
    "to how many large buffers they allocate per step (gathers, flat copies, new optimizer "
    "tensors) rather than to their work. Speed is therefore also measured with glibc's "
    "defaults (pass 2) — the setting users run with; memory only in pass 1.",
    "- **CPU s/step** is the rank process's CPU time per step (all its threads, gloo's "
    "included; slowest rank, median): less sensitive than wall time to other processes "
    "on the machine, blind to time spent waiting for a peer. **load** is the 1-minute load "
    "average when the configuration finished; ⚠ marks loads above the world size + 0.5: "
    "other processes shared the cores and that row's wall time is inflated.",
    "- **peak RSS** is the per-rank high-water mark (max of `VmHWM` and `ru_maxrss`), "
    "including the ~300 MiB every torch process maps; **peak − pre-step** is the rise over "
    "the RSS just before the first step (activations, gradients, transient buffers, and for "
    "torch's lazily built Adam its moments). The plot shows peak RSS above the RSS taken "
    "after the process group came up and before the model was built.",
    "- **model state** counts the tensors a rank holds after the last step, storages once: "
    "for torch configurations the parameters, `.grad`s and optimizer state (DTensors by "
    "their local shard); DDP's reducer buckets (a hidden second gradient copy) and "
    "FairScale's reduce buffers are not visible and not counted. For fzero it is "
    "`fzero.memory_report(state)` plus the gradient bytes of a step (see the fzero note "
    "below). The **formula** is ZeRO's "
    "per-rank model state for fp32 Adam (4 + 4 + 8 bytes per parameter) at the stage the "
    "configuration corresponds to (DDP 0, ZeroRedundancyOptimizer 1, FairScale 2, FSDP2 3).",
    "- **comm/step** is fzero's communication ledger (`fzero.comm_ledger()` around each "
    "step in the rank process): logical bytes, all-gather and reduce-scatter once per full buffer, "
    "all-reduce twice; Ψ = 4 × parameters bytes. A rank really sends (n-1)/n of a "
    "reduce-scatter's or all-gather's logical bytes (on gloo fzero runs them as "
    "point-to-point messages and broadcasts; gloo's own reduce-scatter would be an "
    "all-reduce, twice that). Torch configurations are not instrumented (n/a).",
    "- **max abs Δ** compares the final parameters with one process training on the "
    "concatenated batch from the same initialisation (seeded) and data; float32, so "
    "differences of 1e-6..1e-4 are reduction-order noise amplified by Adam's "
    "normalisation, not errors.",
    "- fzero units: one per block (`fzero.units.by_module`) plus the token/position "
    "embeddings and the head for the GPT, one per Linear for the stack; prefetch on; "
    "`sharded_step`'s defaults otherwise (the state is donated: updated in place). After "
    "`shard_state` the module is moved to the meta device: fzero's state holds the "
    "parameters and the module is only the program `functional_call` runs. fzero's "
    "gradient bytes: the full gradient at stages 0-1 (the bytes handed to its gradient "
    "collectives in a step), this rank's shard at stages 2-3 (the bytes they returned).",
    "- FSDP2: `fully_shard` on each block (or Linear) and on the root. FairScale: OSS + "
    "ShardedDataParallel with `zero_grad(set_to_none=False)` (with None its reduce buckets "
    "detach from `.grad` and it trains silently wrong); FairScale's FSDP is not run: it "
    "needs CUDA (`KeyError: 'all_gather'` on its CUDA stream table).",
]


if __name__ == "__main__":
    main()
