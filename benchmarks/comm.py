"""What a collective costs on this machine while the ranks compute, and how many a step makes.

    python benchmarks/comm.py [--world-size 2] [--iters 60] [--steps 30] [--out PATH]

Part 1 runs a fixed compute loop (matmuls) on every rank and, between its two halves,
one collective of a given size, and reports the wall time the collective adds to an
iteration over the loop alone: on a machine whose cores the ranks' compute already fills,
that is the cost a step pays for it, CPU of gloo's threads included. Three kinds, each
as fzero or DDP issues it: fzero's all-gather (on gloo one broadcast per rank, straight
into place), fzero's reduce-scatter (an all-to-all up to 8 MiB, point-to-point messages
beyond) and gloo's all-reduce (DDP's buckets). The smallest buffer gives a kind's cost
per call, a least-squares line over the large ones its cost per MiB.

Part 2 counts the torch.distributed calls one training step makes, and the MiB they
move, for DDP and fzero stages 0-3 on the benchmark GPT (`models.py`): fzero's calls
DDP's too, by registering its default all-reduce as a comm hook (its reducer otherwise
calls C++ directly). Together they say where a stage's communication overhead comes
from on this machine: the number of calls, or the bytes.

Part 3 steps DDP and stage 3 with resharding in turn, with the GPT's 8 blocks as 8, 4
and 2 units: the lever the first two parts point to, fewer and larger collectives.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _worker import _free_port, _run_group  # noqa: E402  (benchmarks/ is on the path now)

# Full-buffer bytes (float32): a near-empty call, then around the GPT's units and past them.
SIZES = (4 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 24 << 20)
GROUPS = (1, 2, 4)  # blocks per unit in part 3 (the GPT has 8)
KINDS = ("all-gather (fzero)", "reduce-scatter (fzero)", "all-reduce (gloo, DDP)")
CALLS = (
    "broadcast",
    "all_reduce",
    "all_to_all_single",
    "isend",
    "irecv",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "barrier",
)


def _launch(kind: str, buf: torch.Tensor, mesh: Any) -> Any:
    """Starts one collective of `kind` over the full buffer `buf`; returns what to wait on."""
    from fzero import _comm

    if kind.startswith("all-gather"):
        n = buf.numel() // mesh.size
        shard = buf.narrow(0, mesh.rank * n, n)
        return _comm.all_gather_async(shard, mesh, out=buf)[1]
    if kind.startswith("reduce-scatter"):
        return _comm.reduce_scatter_async(buf, mesh)[1]
    return dist.all_reduce(buf, async_op=True)


def _costs(rank: int, mesh: Any, iters: int) -> dict[tuple[str, int], float]:
    """Median wall ms each collective adds to an iteration of the compute loop."""
    torch.manual_seed(rank)
    a = torch.randn(384, 384)

    def iteration(kind: str | None, buf: torch.Tensor) -> float:
        start = time.perf_counter()
        for _ in range(4):
            a @ a
        work = _launch(kind, buf, mesh) if kind else None
        for _ in range(4):
            a @ a
        if work is not None:
            work.wait()
        return (time.perf_counter() - start) * 1e3

    added: dict[tuple[str, int], float] = {}
    for size in SIZES:
        buf = torch.ones(size // 4)
        times: dict[str | None, list[float]] = {k: [] for k in (None, *KINDS)}
        dist.barrier()
        # Kinds take turns iteration by iteration, so the host's drift (other processes,
        # frequency) weighs on each alike; the first two rounds warm buffers and threads.
        for i in range(iters + 2):
            for kind in times:
                t = iteration(kind, buf)
                if i >= 2:
                    times[kind].append(t)
        base = statistics.median(times[None])
        for kind in KINDS:
            added[(kind, size)] = statistics.median(times[kind]) - base
    return added


def _counted_step(name: str, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Calls and MiB per step of configuration `name` on the GPT, by torch.distributed call."""
    import configs
    import models

    spec = models.spec("gpt", False)
    counts: dict[str, float] = {}
    mib: dict[str, float] = {}

    def note(call: str, tensors: list[torch.Tensor]) -> None:
        counts[call] = counts.get(call, 0) + 1
        mib[call] = mib.get(call, 0) + sum(t.numel() * t.element_size() for t in tensors) / 2**20

    # Looked up on `dist` at each call by fzero's gloo paths and DDP's hook, so replacing the
    # attributes sees them (the *_single aliases `fzero._comm` binds at import serve NCCL).
    real = {c: getattr(dist, c) for c in CALLS if hasattr(dist, c)}

    def wrap(call: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            note(call, [t for t in args[:2] if isinstance(t, torch.Tensor)][:1])
            return real[call](*args, **kwargs)

        return counted

    runner = configs.build(configs.BY_NAME[name], spec, models.build_model(spec))
    if name == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # DDP's reducer all-reduces in C++, out of the wrappers' sight; its default hook,
        # registered, does the same through dist.all_reduce, which the wrapper counts.
        # Unannotated on purpose: DDP rejects a hook whose `bucket` annotation (a string,
        # under `from __future__ import annotations`) is not dist.GradBucket itself.
        def hook(state, bucket):
            return allreduce_hook(state, bucket)

        # configs' DDP runner is an eager step over the DDP module: find it in the closure.
        cells = [c.cell_contents for c in runner.step.__closure__ or ()]
        ddp = next(c for c in cells if isinstance(c, torch.nn.parallel.DistributedDataParallel))
        ddp.register_comm_hook(None, hook)
    for t in range(2):  # warm-up: the first steps agree on units, build buffers
        runner.step(models.rank_batch(spec, t, dist.get_rank(), dist.get_world_size()))
    counts.clear()
    mib.clear()
    for c in real:
        setattr(dist, c, wrap(c))
    try:
        for t in range(steps):
            runner.step(models.rank_batch(spec, 2 + t, dist.get_rank(), dist.get_world_size()))
    finally:
        for c, f in real.items():
            setattr(dist, c, f)
    return {k: v / steps for k, v in counts.items()}, {k: v / steps for k, v in mib.items()}


def _granularity(steps: int) -> dict[str, float]:
    """Median step ms of DDP and of stage 3 with resharding at 1, 2 and 4 blocks per unit,
    stepped in turn in these processes (each step: this rank's time after a barrier)."""
    import configs
    import models

    names = ("ddp", *(f"fzero3, {k} block{'s' * (k > 1)} per unit" for k in GROUPS))
    spec = models.spec("gpt", False)
    steppers = [configs.build(configs.BY_NAME["ddp"], spec, models.build_model(spec)).step]
    for k in GROUPS:
        grouped = models.spec("gpt", False, per_unit=k)  # fzero.units.grouped
        steppers.append(
            configs.build(configs.BY_NAME["fzero3"], grouped, models.build_model(grouped)).step
        )
    spec = models.spec("gpt", False)
    times: list[list[float]] = [[] for _ in names]
    for t in range(steps):
        batch = models.rank_batch(spec, t, dist.get_rank(), dist.get_world_size())
        for i, step in enumerate(steppers):
            dist.barrier()
            start = time.perf_counter()
            step(batch)
            if t >= 3:  # warm-up: units agreed, buffers built
                times[i].append((time.perf_counter() - start) * 1e3)
    return {n: statistics.median(v) for n, v in zip(names, times, strict=True)}


def _rank(rank: int, ws: int, port: int, iters: int, steps: int) -> dict[str, Any]:
    """One rank's three parts, as JSON for `_worker._run_group` (which forks it)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=120),
    )
    import fzero

    costs = _costs(rank, fzero.ProcessGroupMesh(), iters)
    counted = {n: _counted_step(n, 4) for n in ("ddp", "fzero0", "fzero1", "fzero2", "fzero3")}
    return {
        "costs": [[kind, size, ms] for (kind, size), ms in costs.items()],
        "counted": counted,
        "grain": _granularity(steps),
    }


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def _report(ws: int, iters: int, steps: int, rank0: dict[str, Any], seconds: float) -> str:
    from run import machine

    costs = {(kind, size): ms for kind, size, ms in rank0["costs"]}
    counted, grain = rank0["counted"], rank0["grain"]
    lines = [
        "# What a collective costs here, and how many a step makes",
        "",
        f"`python benchmarks/comm.py --world-size {ws} --iters {iters} --steps {steps}`, "
        f"{datetime.date.today()}, {machine()}, torch {torch.__version__}, "
        f"{seconds:.0f} s. Rank 0's numbers.",
        "",
        "## Wall ms a collective adds to an iteration of a compute loop (medians)",
        "",
        "| full buffer | " + " | ".join(KINDS) + " |",
        "|---|" + "---:|" * len(KINDS),
    ]
    for size in SIZES:
        cells = [f"{costs[(k, size)]:.2f}" for k in KINDS]
        lines.append(f"| {size / 2**20:.3g} MiB | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Cost ≈ a + b × MiB of full buffer: a is the smallest buffer's cost (a call "
        "that moves next to nothing), b the least-squares slope over the buffers of "
        "2 MiB and more:",
        "",
        "| kind | a: ms per call | b: ms per MiB |",
        "|---|---:|---:|",
    ]
    for k in KINDS:
        b = _slope([(s / 2**20, costs[(k, s)]) for s in SIZES if s >= 2 << 20])
        lines.append(f"| {k} | {costs[(k, SIZES[0])]:.3f} | {b:.3f} |")
    lines += [
        "",
        "## torch.distributed calls per training step (GPT, after 2 warm-up steps)",
        "",
        "| configuration | calls | MiB passed | by call |",
        "|---|---:|---:|---|",
    ]
    for name, (counts, mib) in counted.items():
        by = ", ".join(f"{c} {n:.1f} ({mib[c]:.1f} MiB)" for c, n in sorted(counts.items()))
        lines.append(f"| {name} | {sum(counts.values()):.1f} | {sum(mib.values()):.1f} | {by} |")
    lines += [
        "",
        "MiB passed: the tensor handed to each call (a broadcast's slice, an "
        "all-to-all's or all-reduce's whole buffer, a message), not what gloo sends.",
        "",
        f"## Stage 3 with resharding by unit size (GPT, stepped in turn, median of steps "
        f"4-{steps})",
        "",
        "| configuration | step ms | × DDP |",
        "|---|---:|---:|",
    ]
    for name, ms in grain.items():
        lines.append(f"| {name} | {ms:.1f} | {ms / grain['ddp']:.2f} |")
    lines += [
        "",
        "Units of k blocks: k consecutive blocks as one unit (`fzero.units.grouped`), "
        "the model and its parameter names unchanged, the embeddings and head as before.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--steps", type=int, default=30, help="training steps for part 3")
    p.add_argument("--out", default=str(HERE / "RESULTS-comm.md"))
    args = p.parse_args()
    start = time.monotonic()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(args.world_size)]
        targets = [
            (_rank, (r, args.world_size, port, args.iters, args.steps))
            for r in range(args.world_size)
        ]
        # Forked; a rank that fails has its peers killed 10 s later instead of a hang.
        results = _run_group(targets, outs, timeout=900)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"comm.py: a rank failed:\n{errors[0]}")
    text = _report(args.world_size, args.iters, args.steps, results[0], time.monotonic() - start)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
