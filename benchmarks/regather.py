"""What resharding costs at stage 3, and how much of it the re-gathers' collectives alone cost.

    python benchmarks/regather.py [--launches 10] [--steps 20] [--quick]
                                  [--out benchmarks/RESULTS-regather.md]

Five configurations are built side by side in the same rank processes (the GPT of
run.py, world size 2, gloo on 127.0.0.1, one thread a rank) and stepped in turn, in
fresh processes per launch:
- `ddp`: torch DDP + Adam, as in run.py;
- `fzero3-keep`: fzero stage 3 keeping its units gathered from forward to backward;
- `fzero3`: fzero stage 3 resharding after the forward (its default);
- `ddp+regather` and `fzero3-keep+regather`: those steps plus only the collectives
  that fzero's stage 3 adds when it reshards (`regathers`). The backward gathers again
  every block but the last (fzero keeps the forward's last calls, the last block and
  the head, gathered into the backward), each one block ahead of the backward, with
  the same bytes and the same gloo broadcasts as fzero's gather: this rank's shard is
  copied into its slice, then one broadcast per rank. The buffers are kept across
  steps, as fzero's pool keeps them. Nothing else runs: no saved-tensor handles, no
  freeing, no bookkeeping. The gathered values are not used.

Per launch, each configuration's median step (the slowest rank's, after a barrier) is
divided by DDP's. What the re-gathers' collectives alone cost: `ddp+regather / ddp` (a
step with no other collective in its backward until DDP's last buckets) and
`fzero3-keep+regather / fzero3-keep` (beside stage 3's per-unit reduce-scatters, as in
fzero's own resharding). Against these, `fzero3 / fzero3-keep` is what fzero's
resharding costs, machinery included. The forward (up to the loss) and the CPU time
per step (all of a process's threads) are shown as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import configs  # noqa: E402
import models  # noqa: E402
from _worker import _free_port  # noqa: E402
from run import _git_state, machine  # noqa: E402

NAMES = ("ddp", "ddp+regather", "fzero3-keep", "fzero3-keep+regather", "fzero3")


def regathers(spec: models.Spec, net: nn.Module, rank: int, ws: int) -> list[int]:
    """Adds to `net`'s backward the collectives of stage 3's resharding, and nothing else
    (see the module docstring). Returns the list each gather appends its buffer's bytes to.
    """
    groups = spec.block_groups(net)
    blocks = [net.get_submodule(group[-1]) for group in groups]
    sizes = [
        sum(p.numel() for name in group for p in net.get_submodule(name).parameters())
        for group in groups
    ]
    again = len(blocks) - 1  # the last block stays gathered into the backward
    shards = [torch.randn(-(-n // ws)) for n in sizes[:again]]
    fulls = [torch.empty(s.numel() * ws) for s in shards]
    works: dict[int, list[Any]] = {}
    sent: list[int] = []

    def gather(k: int) -> None:
        n = shards[k].numel()
        fulls[k].narrow(0, rank * n, n).copy_(shards[k])
        works[k] = [
            dist.broadcast(fulls[k].narrow(0, r * n, n), src=r, async_op=True) for r in range(ws)
        ]
        sent.append(fulls[k].numel() * fulls[k].element_size())

    def backward_reaches(k: int) -> None:
        """Block `k`'s backward starts: its parameters must be in, the next gather starts."""
        if k < again:
            for work in works.pop(k):
                work.wait()
        if k > 0:
            gather(k - 1)

    def on_output(k: int) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda grad: backward_reaches(k))

        return hook

    for k, block in enumerate(blocks):
        block.register_forward_hook(on_output(k))
    return sent


def build(name: str, spec: models.Spec, rank: int, ws: int) -> tuple[Any, list[int]]:
    """Configuration `name`'s step, and the bytes log of its bare re-gathers (if any)."""
    net = models.build_model(spec)
    base = name.removesuffix("+regather")
    # The hooks go on the module before run.py's configuration wraps it (DDP, or fzero's
    # functional call of it): either runs the module's forward hooks.
    sent = regathers(spec, net, rank, ws) if base != name else []
    return configs.build(configs.BY_NAME[base], spec, net).step, sent


def _rank(rank: int, ws: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=datetime.timedelta(seconds=120),
    )
    marks: dict[str, float] = {}
    base = models.spec("gpt", args.quick, 1)

    def loss(*a: Any) -> torch.Tensor:
        out = base.loss(*a)
        marks["loss"] = time.perf_counter()
        return out

    spec = dataclasses.replace(base, loss=loss)
    steps = {name: build(name, spec, rank, ws)[0] for name in NAMES}
    rec: dict[str, list[list[float]]] = {n: [] for n in NAMES}
    for t in range(args.steps):
        batch = models.rank_batch(spec, t, rank, ws)
        for name, step in steps.items():
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            step(batch)
            t1 = time.perf_counter()
            rec[name].append([t1 - t0, marks["loss"] - t0, time.process_time() - c0])
    # Per step, each column's largest over the ranks: the slowest rank's wall time.
    got = {n: torch.tensor(v, dtype=torch.float64) for n, v in rec.items()}
    for v in got.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    warm = min(3, args.steps - 1)
    if rank == 0:
        queue.put(
            {n: [statistics.median(v[warm:, i].tolist()) for i in range(3)] for n, v in got.items()}
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="run.py's tiny GPT (a smoke test)")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS-regather.md")
    args = p.parse_args(argv)
    if args.launches < 1 or args.steps < 2:
        p.error("--launches must be at least 1 and --steps at least 2")
    ws, ctx = 2, mp.get_context("spawn")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    launches = []
    for k in range(args.launches):
        queue = ctx.SimpleQueue()
        mp.spawn(_rank, (ws, _free_port(), args, queue), nprocs=ws)
        launches.append(queue.get())
        ddp = launches[-1]["ddp"][0]
        print(
            f"launch {k}: " + "  ".join(f"{n} {v[0] / ddp:.3f}" for n, v in launches[-1].items()),
            flush=True,
        )
    lines = _markdown(args, launches, time.perf_counter() - t0, load0)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _markdown(
    args: argparse.Namespace, launches: list[dict[str, list[float]]], elapsed: float, load0: float
) -> list[str]:
    med = statistics.median
    by_ddp = {n: [run[n][0] / run["ddp"][0] for run in launches] for n in NAMES}
    by_keep = {
        n: [run[n][0] / run["fzero3-keep"][0] for run in launches]
        for n in ("fzero3-keep+regather", "fzero3")
    }
    cells = [
        by_ddp["ddp+regather"],
        by_ddp["fzero3-keep"],
        by_ddp["fzero3-keep+regather"],
        by_ddp["fzero3"],
        by_keep["fzero3-keep+regather"],
        by_keep["fzero3"],
    ]
    spec = models.spec("gpt", args.quick, 1)
    out = [
        "# Stage 3's resharding against its re-gathers' collectives alone",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {machine()}",
        f"- torch {torch.__version__}, fzero at `{_git_state()}`",
        f"- command: `python benchmarks/regather.py{' --quick' if args.quick else ''} "
        f"--launches {args.launches} --steps {args.steps}` ({elapsed:.0f} s; 1-minute "
        f"load {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)",
        f"- {spec.title}; world size 2, gloo on 127.0.0.1, 1 thread a rank; the "
        f"{len(NAMES)} configurations built in the same two processes and stepped in turn, "
        f"{args.steps} steps, median over steps {min(4, args.steps)}-{args.steps} of the "
        "slowest rank's time; each launch in fresh processes (see the script's docstring)",
        "",
        "| launch | DDP s/step | × DDP: DDP + re-gathers | stage 3 keep | keep + re-gathers "
        "| stage 3 reshard | ÷ keep: keep + re-gathers | reshard |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, run in enumerate(launches):
        out.append(
            f"| {k} | {run['ddp'][0]:.3f} | " + " | ".join(f"{c[k]:.3f}" for c in cells) + " |"
        )
    out += [
        f"| **median** | {med(r['ddp'][0] for r in launches):.3f} | "
        + " | ".join(f"**{med(c):.3f}**" for c in cells)
        + " |",
        "",
        "Medians over the launches, ms a step (the slowest rank's): the forward is the "
        "time to the loss, the rest is the backward, the reductions and the update.",
        "",
        "| configuration | step | forward | rest | CPU (all threads) |",
        "|---|---:|---:|---:|---:|",
    ]
    for n in NAMES:
        step, fwd, cpu = (med(r[n][i] for r in launches) * 1e3 for i in range(3))
        out.append(f"| {n} | {step:.1f} | {fwd:.1f} | {step - fwd:.1f} | {cpu:.1f} |")
    return out


if __name__ == "__main__":
    main()
