"""The `fzero` command line: `demo`, `estimate` and `bench`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ._memory import estimate_memory
from ._numbers import (
    UNITS,
    format_count,
    human_bytes,
    int_list,
    nonnegative_float,
    parse_count,
    positive_int,
)
from ._traffic import estimate_comm

# What the ZeRO paper calls each stage (arXiv 1910.02054, Table 1: P_os, P_os+g, P_os+g+p).
STAGE_NAMES = {0: "DDP", 1: "+optim", 2: "+grads", 3: "+params"}


class UsageError(ValueError):
    """A flag's value is wrong: reported as one `fzero: error:` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line naming the command, not usage + error."""

    def error(self, message: str) -> NoReturn:
        fail(message, hint=f"see '{self.prog} --help'")


def fail(message: str, code: int = 2, hint: str = "") -> NoReturn:
    """Prints `fzero: error: message` as one line on stderr and exits with `code`."""
    print(f"fzero: error: {message}" + (f" ({hint})" if hint else ""), file=sys.stderr)
    raise SystemExit(code)


def estimate_table(
    num_params: int,
    world_sizes: Sequence[int],
    stages: Sequence[int],
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optim_bytes: float = 12,
    unit: str = "auto",
    offload: str | None = None,
    fraction: float = 1.0,
    params_offload: bool = False,
    shard_size: int | None = None,
) -> list[str]:
    """The ZeRO paper's Table 1 for one model: model-state memory per rank.

    Args:
      num_params: Ψ, the number of parameters.
      world_sizes: N, one row each.
      stages: one column each.
      param_bytes: bytes per parameter (2 for fp16/bf16 compute copies).
      grad_bytes: bytes per gradient element.
      optim_bytes: optimizer-state bytes per parameter (12: fp32 master weights and Adam's
        two moments).
      unit: see `human_bytes`.
      offload, fraction: as `estimate_memory`'s; each cell is then "device + offloaded"
        (stage 0, which cannot offload: "-").
      params_offload: the stage-3 column with the parameter shards' share on the host too.
      shard_size: a 2-D mesh's group size S: the state is sharded over S ranks, not N (a
        world size S does not divide: "-").

    Returns:
      The table's lines.
    """

    def cell(n: int, s: int) -> str:
        if (offload is not None and s == 0) or (shard_size and n % shard_size):
            return "-"
        e = estimate_memory(
            num_params,
            min(n, shard_size or n),  # what the state is sharded over
            s,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optim_bytes=optim_bytes,
            offload=offload,
            fraction=fraction,
            params_offload=params_offload and s == 3,
        )
        device = human_bytes(e.total, unit)
        return device if offload is None else f"{device} + {human_bytes(e.host + e.disk, unit)}"

    cells = [[cell(n, s) for s in stages] for n in world_sizes]
    heads = [f"stage {s} ({STAGE_NAMES[s]})" for s in stages]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    lines = ["world size  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths))]
    for n, row in zip(world_sizes, cells):
        lines.append(f"{n:>10,}  " + "  ".join(c.rjust(w) for c, w in zip(row, widths)))
    return lines


def comm_table(args: argparse.Namespace) -> list[str]:
    """Communication per rank per step, inside / across groups, by world size and stage."""
    shape = (
        f"groups of {args.shard_size} shard, the groups replicate"
        if args.shard_size
        else "sharded over all ranks"
    ) + (f", hpZ groups of {args.hpz}" if args.hpz else "")
    quant = [name for name, on in (("qwZ", args.qwz), ("qgZ", args.qgz)) if on]
    out = [
        f"Communication per rank per step, inside / across groups ({shape}"
        f"{'; ' + ' + '.join(quant) + ' int8' if quant else ''}; "
        f"{args.comm_bytes:g} bytes per element otherwise):",
    ]
    heads = [f"stage {s}" for s in args.stages]
    rows = []
    for n in args.world_sizes:
        if (args.shard_size and n % args.shard_size) or (args.hpz and n % args.hpz):
            continue
        cells = []
        for s in args.stages:
            t = estimate_comm(
                args.params,
                n,
                s,
                shard_size=args.shard_size,
                hpz=args.hpz if s == 3 else None,
                qwz=args.qwz,
                qgz=args.qgz,
                elem_bytes=args.comm_bytes,
            )
            cells.append(f"{human_bytes(t.inside, args.unit)} / {human_bytes(t.across, args.unit)}")
        rows.append((n, cells))
    widths = (
        [max(len(h), *(len(c[i]) for _, c in rows)) for i, h in enumerate(heads)] if rows else []
    )
    out.append("world size  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    out += [f"{n:>10,}  " + "  ".join(c.rjust(w) for c, w in zip(cs, widths)) for n, cs in rows]
    out.append(
        "ZeRO++ (arXiv 2306.10209): HSDP sends 2Ψ/S across groups; ZeRO-3 over every rank 3Ψ, "
        "hpZ 2Ψ (its backward gathers stay inside), qwZ and qgZ carry 1 + 4/256 bytes an element."
    )
    return out


def _estimate(args: argparse.Namespace) -> int:
    def b(x: float) -> str:
        return f"{x:g}"

    if args.offload_fraction is not None and not args.offload:
        raise UsageError("--offload-fraction needs --offload (host or disk)")
    fraction = 1.0 if args.offload_fraction is None else args.offload_fraction
    comm = args.shard_size or args.hpz or args.qwz or args.qgz or args.comm_bytes is not None
    args.comm_bytes = 2.0 if args.comm_bytes is None else args.comm_bytes
    try:  # estimate_memory validates stages and sizes: its ValueErrors are usage errors
        lines = estimate_table(
            args.params,
            args.world_sizes,
            args.stages,
            param_bytes=args.param_bytes,
            grad_bytes=args.grad_bytes,
            optim_bytes=args.optim_bytes,
            unit=args.unit,
            offload=args.offload,
            fraction=fraction,
            params_offload=args.offload_params,
            shard_size=args.shard_size,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    per = f"{b(args.param_bytes)} + {b(args.grad_bytes)} + {b(args.optim_bytes)}"
    adam = (args.param_bytes, args.grad_bytes, args.optim_bytes) == (2, 2, 12)
    over = f", sharded over groups of {args.shard_size} ranks" if args.shard_size else ""
    print(
        f"Model-state memory per rank: {format_count(args.params)} parameters x ({per}) bytes\n"
        f"(params + grads + optimizer state{': mixed-precision Adam' if adam else ''}{over})\n"
    )
    if args.offload:
        share = "" if fraction == 1 else f"{fraction:g} of "
        print(
            f"Offload (ZeRO-Offload / ZeRO-Infinity): {share}the optimizer state, fp32 masters "
            f"included, on the {args.offload}"
            f"{' (stage 3: the parameter shards on the host too)' if args.offload_params else ''}"
            f"; each cell is device + offloaded.\n"
        )
    print("\n".join(lines))
    if comm:  # the mesh shape, or what travels, was asked about
        print("\n".join(["", *comm_table(args)]))
    print(
        "\nZeRO (arXiv 1910.02054, section 5): stage 1 shards the optimizer state, stage 2 also "
        "the\ngradients, stage 3 also the parameters. Activations and buffers are not counted."
    )
    if adam and not args.offload:
        print(
            "fzero's stage 3 holds 2 bytes a parameter less (its bf16 shards are the fp32 "
            "masters,\ncast as they are gathered): --param-bytes 0 for its column."
        )
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from ._demo import check_demo_args, run_demo

    try:
        check_demo_args(args.world_size, args.steps, args.micro_batch, args.launcher)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.launcher == "simulate":
        # Ranks are processes; one thread each keeps a small machine responsive.
        torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    rows = run_demo(
        world_size=args.world_size,
        steps=args.steps,
        micro_batch=args.micro_batch,
        stages=tuple(args.stage or (0, 1, 2, 3)),
        dtype=dtype,
        launcher=args.launcher,
        progress=args.progress,
    )
    worst = max(r["max_delta"] for r in rows)
    if worst > (1e-9 if dtype == torch.float64 else 1e-2):
        print(f"FAILED: a stage differs from the single-process reference by {worst:.2e}")
        return 1
    return 0


def find_benchmarks() -> Path:
    """`benchmarks/run.py` of the source checkout fzero was installed from (`pip install -e`)."""
    run = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"  # fzero/_tools/_cli.py
    if not run.is_file():
        fail(
            f"the benchmarks are not installed: {run} does not exist; they ship with a source "
            "checkout (git clone, then pip install -e . and run fzero bench from it)",
            code=1,
        )
    return run


def _bench(forwarded: list[str]) -> int:
    run = find_benchmarks()
    if not {"-h", "--help"} & set(forwarded):
        _check_bench_flags(run, forwarded)
    return subprocess.run([sys.executable, str(run), *forwarded], check=False).returncode


def _check_bench_flags(run: Path, forwarded: list[str]) -> None:
    """Parses the flags with benchmarks/run.py's own parser first: bad flags fail in one line."""
    # In a child: run.py puts benchmarks/ first on sys.path and imports its modules.
    code = "import sys; sys.path.insert(0, sys.argv[1]); import run; run.parse(sys.argv[2:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(run.parent), *forwarded],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["bad flags"])[-1]
        fail(last.split("error: ", 1)[-1], hint="see 'fzero bench --help'")


def build_parser() -> argparse.ArgumentParser:
    """The `fzero` argument parser (its subcommands: demo, estimate, bench)."""
    parser = _Parser(prog="fzero", description="ZeRO data-parallel sharding for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,estimate,bench}")
    demo = sub.add_parser(
        "demo", help="train a small GPT at every stage and compare with one process"
    )
    demo.add_argument(
        "--world-size", type=positive_int, default=None, help="ranks (default 4 simulated)"
    )
    demo.add_argument("--steps", type=positive_int, default=30)
    demo.add_argument("--micro-batch", type=positive_int, default=4)
    demo.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        action="append",
        help="stage(s) to run, repeatable (default: all)",
    )
    demo.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="float64 (default) shows exactness; float32 shows Adam amplifying "
        "round-off where gradients are near zero",
    )
    demo.add_argument(
        "--launcher",
        choices=["simulate", "torchrun"],
        default="simulate",
        help="simulate: fork the ranks here (default); torchrun: this process is one rank "
        "(torchrun --nproc-per-node 4 -m fzero demo --launcher torchrun)",
    )
    demo.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    est = sub.add_parser(
        "estimate", help="model-state memory per rank by world size and stage (ZeRO Table 1)"
    )
    est.add_argument(
        "--params", type=parse_count, default=parse_count("7.5B"), help="7.5B (default), 1.3e9"
    )
    est.add_argument(
        "--world-sizes", type=int_list(1), default=[1, 4, 16, 64, 256, 1024], metavar="N,..."
    )
    est.add_argument("--stages", type=int_list(0, 3), default=[0, 1, 2, 3], metavar="S,...")
    est.add_argument("--param-bytes", type=nonnegative_float, default=2.0)
    est.add_argument("--grad-bytes", type=nonnegative_float, default=2.0)
    est.add_argument(
        "--optim-bytes", type=nonnegative_float, default=12.0, help="12: fp32 master + Adam"
    )
    est.add_argument("--unit", choices=["auto", *UNITS], default="auto")
    est.add_argument(
        "--offload",
        choices=["host", "disk"],
        default=None,
        help="the optimizer state (masters included) off the device: shard_state(offload=)",
    )
    est.add_argument(
        "--offload-fraction", type=float, default=None, metavar="F", help="its share, in (0, 1]"
    )
    est.add_argument(
        "--offload-params",
        action="store_true",
        help="stage 3: the parameter shards on the host too: Offload(params=True)",
    )
    est.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="S",
        help="a 2-D mesh: groups of S ranks shard, the groups replicate (HSDP)",
    )
    est.add_argument(
        "--hpz",
        type=int,
        default=None,
        metavar="K",
        help="stage 3's backward gathers from a copy inside groups of K (hpZ)",
    )
    est.add_argument("--qwz", action="store_true", help="int8 parameter gathers (stage 3)")
    est.add_argument("--qgz", action="store_true", help="int8 gradient reduce-scatters")
    est.add_argument(
        "--comm-bytes",
        type=nonnegative_float,
        default=None,
        help="bytes per element communicated (2: bf16); prints the communication table",
    )
    sub.add_parser(
        "bench",
        add_help=False,  # --help goes to benchmarks/run.py, which owns the flags
        help="run benchmarks/run.py (source checkout); flags such as --quick, --configs, "
        "--steps are passed on",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m fzero` and the `fzero` console script.

    Args:
      argv: the arguments (default: sys.argv[1:]).

    Returns:
      The exit status: 0 on success, 1 when a run fails its check; usage errors exit 2
      with one `fzero: error:` line (SystemExit).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(extra)
    if extra:
        fail(
            f"unrecognized arguments: {' '.join(extra)}", hint=f"see 'fzero {args.command} --help'"
        )
    command = {"demo": _demo, "estimate": _estimate}[args.command]
    try:
        return command(args)
    except UsageError as exc:
        fail(str(exc), hint=f"see 'fzero {args.command} --help'")
