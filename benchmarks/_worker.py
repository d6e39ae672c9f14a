"""Launcher run by run.py: forks fresh rank processes per configuration and measures them.

run.py starts this file as a subprocess with `MALLOC_MMAP_THRESHOLD_=65536` already in its
environment, so glibc returns freed tensor buffers to the OS and RSS tracks live tensors;
forked rank processes inherit that allocator setting. The launcher itself only imports
torch (no parallel op ran), so forked children are safe once they drop to one thread.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import configs
import models
import torch
import torch.distributed as dist


def _preimport() -> None:
    """Imports what any configuration imports lazily, once, before forking.

    DDP pulls in torch._dynamo (seconds per process) on construction; imported here, every
    forked rank starts from the same mapped libraries, so absolute RSS compares across
    configurations and the step timings don't include imports.
    """
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.optim
    import torch.nn.parallel  # noqa: F401

    try:
        import fairscale.nn.data_parallel
        import fairscale.optim.oss  # noqa: F401
    except ImportError:
        pass


def rss_kib() -> dict[str, int]:
    """Current (VmRSS) and peak (max of VmHWM and ru_maxrss) resident set, in KiB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    peak = max(fields["VmHWM"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {"rss": fields["VmRSS"], "peak": peak}


def reset_peak() -> bool:
    """Resets the high-water mark to the current RSS (Linux >= 4.0; ru_maxrss follows).

    The setup builds the full model on every rank before sharding it; without a reset
    that transient would be every sharded configuration's peak.
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _reference(plan: dict[str, Any], model_name: str, path: Path) -> dict[str, Any]:
    """Plain torch.optim.Adam on one process over the concatenated batch."""
    torch.set_num_threads(1)
    spec = models.spec(model_name, plan["quick"], plan.get("per_unit", 1))
    net = models.build_model(spec)
    opt = torch.optim.Adam(net.parameters(), lr=configs.LR)
    times, loss = [], 0.0
    for t in range(plan["steps"]):
        x, y = spec.make_batch(t, spec.micro_batch * plan["world_size"])
        t0 = time.perf_counter()
        opt.zero_grad()
        out = spec.loss(net(x), y)
        out.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        loss = out.item()
    torch.save({k: v.detach().clone() for k, v in net.named_parameters()}, path)
    return {"times": times, "loss": loss, "psi": sum(p.numel() for p in net.parameters())}


def _functional_cost(plan: dict[str, Any], model_name: str, port: int) -> dict[str, Any]:
    """World size 1: a plain eager loop (module + torch.optim.Adam) against fzero stage 0.

    Issue 7's "cost of being functional". The two alternate step by step in one process
    on the same (whole) batches, so a busy machine slows both alike.
    """
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    spec = models.spec(model_name, plan["quick"], plan.get("per_unit", 1))
    net = models.build_model(spec)
    eager = configs.eager_step(spec, net, torch.optim.Adam(net.parameters(), lr=configs.LR))
    functional = configs.build(configs.BY_NAME["fzero0"], spec, models.build_model(spec)).step
    steps = {"eager": eager, "fzero0": functional}
    times: dict[str, list[float]] = {c: [] for c in steps}
    faults: dict[str, list[int]] = {c: [] for c in steps}
    for t in range(plan["steps"]):
        batch = spec.make_batch(t, spec.micro_batch * plan["world_size"])
        for name, step in steps.items():
            _timed(step, batch, times[name], faults[name])
    return {"times": times, "faults": faults}


def _timed(step: Any, batch: Any, times: list[float], faults: list[int]) -> None:
    """One step: its wall time and the page faults the process took during it."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    step(batch)
    times.append(time.perf_counter() - t0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)


def _interleaved(
    plan: dict[str, Any], model_name: str, names: tuple[str, ...], rank: int, port: int
) -> dict[str, Any]:
    """Configurations (a reference and the fzero stage held to it) built side by side in the
    same rank processes and stepped in turn, so a busy or drifting machine slows both alike.

    Issue 7's stage 0 and stage 1 targets compare ratios a few percent apart; configurations
    timed one after another in fresh processes differ by more than that from run to run.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=plan["world_size"],
        timeout=datetime.timedelta(seconds=plan["collective_timeout"]),
    )
    spec = models.spec(model_name, plan["quick"], plan.get("per_unit", 1))
    steps = {
        c: configs.build(configs.BY_NAME[c], spec, models.build_model(spec)).step for c in names
    }
    times: dict[str, list[float]] = {c: [] for c in names}
    faults: dict[str, list[int]] = {c: [] for c in names}
    for t in range(plan["steps"]):
        batch = models.rank_batch(spec, t, rank, plan["world_size"])
        for c in names:
            dist.barrier()
            _timed(steps[c], batch, times[c], faults[c])
    return {"times": times, "faults": faults}


def _rank(
    plan: dict[str, Any], model_name: str, cfg_name: str, rank: int, port: int, ref_path: Path
) -> dict[str, Any]:
    torch.set_num_threads(1)  # before any op: GNU OpenMP is not fork-safe
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")  # FairScale's
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=plan["world_size"],
        timeout=datetime.timedelta(seconds=plan["collective_timeout"]),
    )
    cfg = configs.BY_NAME[cfg_name]
    spec = models.spec(model_name, plan["quick"], plan.get("per_unit", 1))
    ws, steps = plan["world_size"], plan["steps"]
    base = rss_kib()["rss"]
    batches = [models.rank_batch(spec, t, rank, ws) for t in range(steps)]
    net = models.build_model(spec)
    runner = configs.build(cfg, spec, net)
    gc.collect()
    setup_peak = rss_kib()["peak"]
    reset = reset_peak()
    before = rss_kib()["rss"]
    warm_peak, rest = before, before
    times, cpu, losses = [], [], []
    for t, batch in enumerate(batches):
        if t == plan["warmup"]:  # from here on every configuration has built all its state
            warm_peak = rss_kib()["peak"]
            reset = reset_peak() and reset
            rest = rss_kib()["rss"]
        dist.barrier()  # every rank starts a step together: times are per step, not skew
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(runner.step(batch))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # all threads, gloo's included
    held = runner.state_bytes()
    steady_peak = rss_kib()["peak"]  # before anything below allocates full copies
    extras = runner.extras()
    full = runner.full_params()
    ref = torch.load(ref_path)
    delta = max((full[k].float() - ref[k].float()).abs().max().item() for k in ref)
    missing = sorted(set(ref) ^ set(full))
    return {
        "rank": rank,
        "times": times,
        "cpu": cpu,
        "loss": losses[-1],
        "rss_base_kib": base,
        "rss_setup_peak_kib": setup_peak,
        "rss_before_kib": before,
        "rss_peak_kib": max(warm_peak, steady_peak),
        "rss_rest_kib": rest,
        "rss_steady_peak_kib": steady_peak,
        "hwm_reset": reset,
        "state": held,
        "max_delta": delta,
        "missing": missing,
        **extras,
    }


def _child(fn: Any, out: str, *args: Any) -> None:
    try:
        result = fn(*args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    # Leave without tearing down the process group, neither by destroy_process_group nor
    # at interpreter exit: ProcessGroupGloo's destructor joins its worker threads while
    # holding the GIL, and a worker still releasing a finished collective's Python-owned
    # tensors waits for the GIL: a deadlock (seen with gdb in a rank of the interleaved
    # run, both threads in futex waits, after its peer had finished).
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_group(
    targets: list[tuple[Any, tuple[Any, ...]]], outs: list[Path], timeout: float
) -> list[dict[str, Any]]:
    """Runs one forked process per target; kills the rest if one fails or time runs out."""
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(target=_child, args=(fn, str(o), *args)) for (fn, args), o in zip(targets, outs)
    ]
    for p in procs:
        p.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.is_alive() for p in procs):
        time.sleep(0.05)
        now = time.monotonic()
        if failed_at is None and any(not p.is_alive() and _failed(o) for p, o in zip(procs, outs)):
            failed_at = now  # a peer may be stuck in a collective: give it a moment
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            for p in procs:
                if p.is_alive():
                    p.kill()  # only the processes started here, by their handle
    for p in procs:
        p.join()
    results = []
    for o, p in zip(outs, procs):
        if o.exists():
            results.append(json.loads(o.read_text()))
        else:
            why = "timed out" if p.exitcode in (-9, None) else f"exit code {p.exitcode}"
            results.append({"error": f"rank process ended without a result ({why})"})
    return results


def _source_hash() -> str:
    """A short hash of the fzero sources this launcher imported (others edit them live)."""
    import fzero

    h = hashlib.sha1()
    for f in sorted(Path(fzero.__file__).parent.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def _failed(out: Path) -> bool:
    return not out.exists() or "error" in json.loads(out.read_text())


def _fairscale_missing() -> str | None:
    try:
        import fairscale  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc}); pip install --no-deps fairscale==0.4.13"
    return None


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    _preimport()
    tmp = Path(plan["tmp"])
    records: list[dict[str, Any]] = []
    for model_name in plan["models"]:
        ref_path = tmp / f"ref-{model_name}.pt"
        out = tmp / f"{model_name}-reference.json"
        ref = _run_group(
            [(_reference, (plan, model_name, ref_path))], [out], plan["config_timeout"]
        )[0]
        records.append({"model": model_name, "config": "reference", "ranks": [ref]})
        print(
            f"[{model_name}] reference: {statistics.median(ref.get('times', [0])):.3f} s/step"
            if "error" not in ref
            else f"[{model_name}] reference FAILED",
            flush=True,
        )
        if "error" in ref:
            print(ref["error"], file=sys.stderr, flush=True)
            continue
        # The stepped-in-turn comparisons, each in `launches` fresh processes: how often
        # glibc trims the heap top (and the next step page-faults it back) depends on where
        # a process's allocations happen to land, which differs from launch to launch.
        if "fzero0" in plan["configs"]:
            launches = []
            for k in range(plan["launches"]):
                out = tmp / f"{model_name}-ws1-{k}.json"
                launches.append(
                    _run_group(
                        [(_functional_cost, (plan, model_name, _free_port()))],
                        [out],
                        plan["config_timeout"],
                    )
                )
            records.append({"model": model_name, "config": "ws1", "launches": launches})
        for ref_cfg, fz_cfg, _ in configs.INTERLEAVED_PAIRS:
            if not {ref_cfg, fz_cfg} <= set(plan["configs"]):
                continue
            launches, ws, pair = [], plan["world_size"], (ref_cfg, fz_cfg)
            for k in range(plan["launches"]):
                port = _free_port()
                outs = [tmp / f"{model_name}-{ref_cfg}+{fz_cfg}-{k}-{r}.json" for r in range(ws)]
                launches.append(
                    _run_group(
                        [(_interleaved, (plan, model_name, pair, r, port)) for r in range(ws)],
                        outs,
                        plan["config_timeout"],
                    )
                )
            records.append(
                {
                    "model": model_name,
                    "config": f"interleaved:{ref_cfg}+{fz_cfg}",
                    "launches": launches,
                }
            )
        for cfg_name in plan["configs"]:
            skip = _fairscale_missing() if cfg_name.startswith("fairscale") else None
            if skip:
                ranks: list[dict[str, Any]] = [{"error": skip}]
            else:
                port, ws = _free_port(), plan["world_size"]
                outs = [tmp / f"{model_name}-{cfg_name}-{r}.json" for r in range(ws)]
                targets = [
                    (_rank, (plan, model_name, cfg_name, r, port, ref_path)) for r in range(ws)
                ]
                ranks = _run_group(targets, outs, plan["config_timeout"])
            load = os.getloadavg()[0]  # > world size: other processes competed for the cores
            records.append({"model": model_name, "config": cfg_name, "ranks": ranks, "load": load})
            errors = [r["error"] for r in ranks if "error" in r]
            if errors:
                print(
                    f"[{model_name}] {cfg_name}: FAILED: {errors[0].strip().splitlines()[-1]}",
                    flush=True,
                )
            else:
                step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks)))
                print(f"[{model_name}] {cfg_name}: {step:.3f} s/step (all steps)", flush=True)
    out = {"fzero_source": _source_hash(), "records": records}
    Path(plan["results"]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
