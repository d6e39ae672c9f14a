"""Compiled steps on the CPU (issue 50): fzero's step traced by torch.compile beside its
eager step, DDP, and DDP with its module compiled, stepped in turn.

    python benchmarks/compiled.py [--models deep,gpt] [--steps 10] [--quick]
                                  [--only REGEX] [--backend inductor] [--decay WD]
                                  [--out benchmarks/RESULTS-compiled.md]

Two simulated ranks (processes, gloo, one thread each) hold every configuration's model
and state and step them in turn on the same batches, so this 2-vCPU guest's drift is
seen by all alike; each row is the median step of the slowest rank after the first, and
the first step's time (the compilation, for compiled rows) is reported beside it. The
models are `benchmarks/models.py`'s: "deep" (100 blocks of width 64, 426K parameters in
400 leaves, where eager per-unit work dominates) and "gpt" (5.33M). fzero's units are one
a block; eager rows enter them by module hooks (as the other benchmarks do), compiled
rows before the forward, where the loss asks ("just in time": `fzero.gathered` per
unit), or where each block runs ("module hooks", traced); stage 3 recomputes a gather
entered inside the forward for the backward. Adam everywhere (torch's
single-tensor Adam for DDP, fzero's for fzero); every row's parameters after the steps
are compared with DDP's. A compiled fzero step runs fzero's Adam fused (a compiled
kernel per large piece of the shard, torch's fused list kernel for the small ones), so
DDP compiled is measured with torch's fused CPU Adam too. `--only` keeps the
configurations whose label matches (and DDP, the baseline):
`--only 'compiled$|eager'` leaves out the just-in-time rows, whose deep-model compile
takes some 1000 s here. `--decay WD` trains with AdamW instead, weight decay WD on the
matrices and none on biases and norms (the usual recipe: fzero's `mask=`, torch's two
parameter groups), so that every small unit's piece of a rank mixes the two.
`--backend aot_eager` traces without inductor's code generation: its first steps are
the trace alone (dynamo and AOTAutograd), fzero's part of a compile.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

from configs import LR
from models import build_model, rank_batch, spec

import fzero

CONFIGS = [  # (label, kind, stage, compile: False, True, "fused" (DDP), "jit", "hooks", bursts)
    ("DDP", "ddp", 0, False),
    ("DDP, module compiled", "ddp", 0, True),
    ("DDP, module compiled, fused Adam", "ddp", 0, "fused"),
    ("fzero stage 0, eager", "fzero", 0, False),
    ("fzero stage 0, compiled", "fzero", 0, True),
    ("fzero stage 2, eager", "fzero", 2, False),
    ("fzero stage 2, compiled", "fzero", 2, True),
    ("fzero stage 3, eager", "fzero", 3, False),
    ("fzero stage 3, compiled", "fzero", 3, True),
    ("fzero stage 3, compiled, 25 MiB bursts", "fzero", 3, 25 * 2**20),
    ("fzero stage 3, compiled, just in time", "fzero", 3, "jit"),
    ("fzero stage 3, compiled, module hooks", "fzero", 3, "hooks"),
]


def entered_forward(model: nn.Module, p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    """The benchmark models' forward with each unit entered where it runs
    (`fzero.gathered`, for `just_in_time=True`): the deep stack's blocks, or the GPT's
    embeddings, blocks and head (its final norm is the root's)."""
    if isinstance(model, nn.Sequential):
        for i, block in enumerate(model):
            x = functional_call(block, fzero.gathered(p, str(i)), (x,))
        return x
    pos = torch.arange(x.shape[1])
    h = functional_call(model.tok, fzero.gathered(p, "tok"), (x,))
    h = h + functional_call(model.pos, fzero.gathered(p, "pos"), (pos,))
    for i, block in enumerate(model.blocks):
        h = functional_call(block, fzero.gathered(p, f"blocks.{i}"), (h,))
    h = functional_call(model.ln, {"weight": p["ln.weight"], "bias": p["ln.bias"]}, (h,))
    return functional_call(model.head, fzero.gathered(p, "head"), (h,))


def make(
    mesh: fzero.Mesh,
    s: Any,
    kind: str,
    stage: int,
    compiled: bool | int | str,
    backend: str,
    decay: float = 0.0,
) -> Any:
    """A configuration's `(step(batch), params())` (`compiled` an int: compiled, in
    bursts of that many bytes instead of the default; "jit": compiled, units entered
    where the loss asks, `entered_forward`), compiled rows by torch.compile's `backend`;
    `decay` > 0: AdamW with that weight decay on the matrices alone."""
    model = build_model(s)
    matrices = {k for k, v in model.named_parameters() if v.dim() >= 2}
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        net = torch.compile(ddp, backend=backend) if compiled else ddp
        fused = {"fused": True} if compiled == "fused" else {"foreach": False}
        if decay:
            named = list(model.named_parameters())
            groups = [
                {"params": [v for k, v in named if k in matrices]},
                {"params": [v for k, v in named if k not in matrices], "weight_decay": 0.0},
            ]
            opt = torch.optim.AdamW(groups, lr=LR, weight_decay=decay, **fused)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=LR, **fused)

        def ddp_step(batch: Any) -> None:
            opt.zero_grad(set_to_none=True)
            s.loss(net(batch[0]), batch[1]).backward()
            opt.step()

        return ddp_step, lambda: {k: v.detach().clone() for k, v in model.named_parameters()}
    blocks = [g[0] if len(g) == 1 else tuple(g) for g in s.block_groups(model)]
    units = [*blocks, *s.extra_units]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if decay:
        opt = fzero.optim.adamw(lr=LR, weight_decay=decay, mask=lambda path: path in matrices)
    else:
        opt = fzero.optim.adam(lr=LR)
    box = [fzero.shard_state(params, opt, mesh, stage=stage, units=units)]

    def loss_fn(p: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
        if compiled == "jit":
            return s.loss(entered_forward(model, p, batch[0]), batch[1])
        return s.loss(functional_call(model, p, (batch[0],)), batch[1])

    kw: dict[str, Any] = {"compile": backend} if compiled else {"module": model}
    if compiled == "hooks":  # each unit entered where its submodule runs, hooks traced
        kw["module"] = model
    elif compiled == "jit":
        kw["just_in_time"] = True
    elif not isinstance(compiled, bool):
        kw["reduce_bucket_bytes"] = compiled
    train = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units, **kw)

    def fzero_step(batch: Any) -> None:
        box[0], _ = train(box[0], batch)

    return fzero_step, lambda: dict(fzero.gather_params(box[0].params, mesh))


def in_turn(
    mesh: fzero.Mesh,
    name: str,
    quick: bool,
    steps: int,
    configs: list,
    backend: str,
    decay: float = 0.0,
) -> Any:
    """Every configuration stepped in turn: per configuration the first step's time,
    the later steps' median, and (rank 0) the final parameters."""
    torch.set_num_threads(1)
    s = spec(name, quick)
    runs = [make(mesh, s, kind, stage, c, backend, decay) for _, kind, stage, c in configs]
    times: list[list[float]] = [[] for _ in runs]
    for t in range(steps + 1):
        batch = rank_batch(s, t, mesh.rank, mesh.size)
        for k, (step, _) in enumerate(runs):
            t0 = time.perf_counter()
            step(batch)
            times[k].append(time.perf_counter() - t0)
    finals = [params() for _, params in runs]
    return [(ts[0], statistics.median(ts[1:])) for ts in times], finals if mesh.rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="deep,gpt")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="tiny models (checks the script)")
    ap.add_argument("--only", default="", help="keep configurations matching this regex")
    ap.add_argument("--backend", default="inductor", help="torch.compile's, compiled rows")
    ap.add_argument("--decay", type=float, default=0.0, help="AdamW, decay on matrices")
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-compiled.md"))
    args = ap.parse_args()
    configs = [c for k, c in enumerate(CONFIGS) if k == 0 or re.search(args.only, c[0])]
    only = f" --only '{args.only}'" if args.only else ""
    if args.backend != "inductor":
        only += f" --backend {args.backend}"
    if args.decay:
        only += f" --decay {args.decay:g}"
    lines = [
        "# Compiled steps on the CPU (issue 50)\n",
        f"Measured {datetime.date.today()} on {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}: `python benchmarks/compiled.py --models {args.models} "
        f"--steps {args.steps}{' --quick' if args.quick else ''}{only}`. Two ranks, stepped in "
        "turn; the median of the steps after the first, the slowest rank's.\n",
    ]
    for name in args.models.split(","):
        out = fzero.Simulation(2, collective_timeout=120, timeout=3600).run(
            in_turn, name, args.quick, args.steps, configs, args.backend, args.decay
        )
        finals = out[0][1]
        rows = [
            (max(r[0][k][0] for r in out), max(r[0][k][1] for r in out))
            for k in range(len(configs))
        ]
        base = rows[0][1]
        lines += [
            f"\n## {spec(name, args.quick).title}\n",
            "| configuration | step (ms) | × DDP | first step (s) | max abs Δ vs DDP |",
            "|---|---:|---:|---:|---:|",
        ]
        for (label, *_), (first, med), params in zip(configs, rows, finals):
            delta = max((params[k] - finals[0][k]).abs().max().item() for k in finals[0])
            lines.append(
                f"| {label} | {med * 1e3:.1f} | {med / base:.2f} | {first:.1f} | {delta:.1e} |"
            )
            print(lines[-1], flush=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
