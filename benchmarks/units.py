"""Per-unit memory and speed of a pure loss (fzero.gathered) against module hooks.

    .venv/bin/python benchmarks/units.py [--steps 12] [--launches 3] [--out PATH]

The model of issue 16: an MLP of 16 x Linear(1024) with tanh, float32, Adam, 2 ranks over
gloo (`fzero.simulate`: forked processes, real process groups on 127.0.0.1), one unit per
layer. Three ways for the units to enter the loss:

- up front: `loss_fn` calls `functional_call(model, params)`, no `module=` (every unit is
  gathered before the forward);
- module: the same loss with `module=model` (forward hooks);
- gathered: a pure function over the dict of parameters, asking for each layer with
  `fzero.gathered`, `just_in_time=True`; no nn.Module in the step at all.

Memory: each configuration in fresh rank processes that start with
`mallopt(M_MMAP_THRESHOLD, 64 KiB)` (freed tensors go back to the OS, so the resident set
follows live tensors); the peak resident set while training (all steps, the first
included) above the resident set after the process group started and before the model
was built, in units of B = the model's float32 bytes. `shard_state`'s own peak (it packs
and broadcasts the full model) is reported apart: issue 17 is about that one.

Speed: the module and the pure step functions stepped in turn on one state in the same
two processes (machine drift slows both alike), per launch the median over steps of the
ratio pure / module.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import fzero

WIDTH, DEPTH, BATCH = 1024, 16, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def pure_loss(params: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
    """The MLP as a function of its parameter dict: each layer asked for where it is used."""
    x, y = batch
    for i in range(DEPTH):
        layer = fzero.gathered(params, f"layers.{i}")
        x = torch.tanh(nn.functional.linear(x, layer["weight"], layer["bias"]))
    return ((x - y) ** 2).mean()


def _rss() -> dict[str, int]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.startswith("Vm")}


def _setup(mesh: fzero.Mesh, stage: int) -> tuple[Any, Any, Any, Any, int]:
    torch.manual_seed(0)
    model = MLP()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    model_bytes = sum(v.numel() * 4 for v in params.values())
    opt = fzero.optim.adam(lr=1e-3)
    units = [f"layers.{i}" for i in range(DEPTH)]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
    for p in model.parameters():  # the module is only the loss's code now
        p.data = torch.empty(0)
    del params

    def module_loss(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    g = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
    return model, module_loss, state, batch, model_bytes


def memory(mesh: fzero.Mesh, stage: int, entry: str, steps: int) -> dict[str, float]:
    """Peak resident set above the pre-model baseline, in B, over set-up and `steps`."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss()["VmRSS"]
    model, module_loss, state, batch, model_bytes = _setup(mesh, stage)
    opt = fzero.optim.adam(lr=1e-3)
    step = fzero.sharded_step(
        pure_loss if entry == "gathered" else module_loss,
        opt,
        mesh,
        stage=stage,
        module=model if entry == "module" else None,
        just_in_time=entry == "gathered",
    )
    setup = _rss()["VmHWM"] - base
    Path("/proc/self/clear_refs").write_text("5")  # from here on, training only
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, loss = step(state, batch)
        times.append(time.perf_counter() - t)
    return {
        "peak_b": (_rss()["VmHWM"] - base) / model_bytes,
        "setup_b": setup / model_bytes,
        "step_s": statistics.median(times[2:]),
        "loss": float(loss),
    }


def in_turn(mesh: fzero.Mesh, stage: int, steps: int) -> list[float]:
    """Per step pair, (pure step time) / (module step time), one state for both."""
    model, module_loss, state, batch, _ = _setup(mesh, stage)
    opt = fzero.optim.adam(lr=1e-3)
    by_module = fzero.sharded_step(module_loss, opt, mesh, stage=stage, module=model)
    pure = fzero.sharded_step(pure_loss, opt, mesh, stage=stage, just_in_time=True)
    ratios = []
    for k in range(steps):
        pair = []
        for step in (by_module, pure) if k % 2 else (pure, by_module):
            t = time.perf_counter()
            state, _ = step(state, batch)
            pair.append((step is pure, time.perf_counter() - t))
        times = dict(pair)
        if k >= 2:  # warm-up: the first steps set up prefetch order and allocator pools
            ratios.append(times[True] / times[False])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("RESULTS-units.md")))
    args = parser.parse_args()
    torch.set_num_threads(1)
    sim = fzero.Simulation(2, collective_timeout=120, timeout=1800)
    rows = []
    for stage in (2, 3):
        for entry in ("upfront", "module", "gathered"):
            got = sim.run(memory, stage, entry, args.steps)
            peak, setup = max(r["peak_b"] for r in got), max(r["setup_b"] for r in got)
            rows.append((stage, entry, peak, setup, got[0]["step_s"]))
            print(f"stage {stage} {entry:9s} peak {peak:.2f} B (set-up {setup:.2f} B)")
    speed = []
    for stage in (2, 3):
        per_launch = []
        for _ in range(args.launches):
            ratios = sim.run(in_turn, stage, args.steps)[0]
            per_launch.append(statistics.median(ratios))
        speed.append((stage, per_launch))
        print(f"stage {stage} pure / module, per launch: {per_launch}")
    _write(args, rows, speed)


def _write(args: Any, rows: list, speed: list) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    load = os.getloadavg()[0]
    out = [
        "# Per-unit memory and speed: a pure loss (fzero.gathered) against module hooks",
        "",
        f"{datetime.date.today()}, commit {commit}, {platform.machine()} Linux, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, load {load:.1f} at the end. "
        f"Command: `python benchmarks/units.py --steps {args.steps} --launches {args.launches}`"
        " (see its docstring for the method).",
        "",
        f"MLP of {DEPTH} x Linear({WIDTH}) with tanh, float32, Adam, micro-batch {BATCH}, "
        "2 ranks over gloo, one unit per layer. B = the model's float32 bytes (67.2 MB).",
        "",
        "| stage | units enter | peak RSS per rank above baseline, training "
        "| shard_state's peak | step time (median, timed alone) |",
        "|---|---|---:|---:|---:|",
    ]
    names = {"upfront": "up front", "module": "module hooks", "gathered": "fzero.gathered"}
    for stage, entry, peak, setup, step_s in rows:
        out.append(
            f"| {stage} | {names[entry]} | {peak:.2f} B | {setup:.2f} B | {step_s * 1000:.0f} ms |"
        )
    out += [
        "",
        "Step time of the pure loss over the module's, stepped in turn on one state "
        "(median over steps per launch; the verdict is the median of the launches):",
        "",
        "| stage | launches | median |",
        "|---|---|---:|",
    ]
    for stage, per_launch in speed:
        text = " / ".join(f"{r:.3f}" for r in per_launch)
        out.append(f"| {stage} | {text} | {statistics.median(per_launch):.3f} |")
    Path(args.out).write_text("\n".join(out) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
