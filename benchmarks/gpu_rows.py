"""The rows of benchmarks/gpu.py: each configuration built, stepped, timed and profiled.

Every row runs alone in a fresh process (`gpu.py --row`), so nothing one configuration
leaves behind (DDP's reducer outlives its module; the caching allocator's blocks; cuDNN's
plans) counts in another's peak memory or time.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fzero
from fzero._tools._demo import Block, TinyGPT

GPT = dict(vocab=50304, block=1024, d=768, layers=12, heads=12)
SMOKE = dict(vocab=64, block=16, d=32, layers=2, heads=2)
BATCH = 8  # sequences per rank per step
# The compiled rows' backend. gpu.py's --smoke run (the CPU, checking the script) sets
# "aot_eager": the same graphs without inductor's code generation, which cost the CPU
# check a minute and is not what a GPU runs anyway (tests/step/test_compiled.py tests
# inductor on the CPU).
COMPILE_BACKEND = "inductor"
LR = 3e-4


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
) -> tuple[TinyGPT, Any, fzero.ShardedState]:
    """The model on the meta device, its units (one per block), and fzero's state
    initialised from it, bitwise the values `new_model` makes (`fzero.init.from_module`):
    no second copy of the parameters in the nn.Module, as FSDP2's `fully_shard` keeps none."""
    with torch.device("meta"):
        model = TinyGPT(**cfg)
    units = fzero.units.by_module(model, Block)
    init = fzero.init.from_module(model, seed=0, device=mesh.device)
    params = dict(model.named_parameters())
    state = fzero.shard_state(params, opt, mesh, units=units, init=init, **kw)
    return model, units, state


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(n: int, cfg: dict[str, int], device: torch.device) -> list[torch.Tensor]:
    """Steps 0..n-1's tokens, already on `device`: copying them from pageable host memory
    inside the timed step would make the host wait for the GPU's queue every step (a
    data loader pins its memory for this)."""
    return [batch(t, BATCH, cfg, device) for t in range(n)]


def timed(
    step: Callable[[torch.Tensor], None],
    data: list[torch.Tensor],
    warmup: int,
    device: torch.device,
) -> list[float]:
    times = []
    for t, tokens in enumerate(data):
        sync(device)
        t0 = time.perf_counter()
        step(tokens)
        sync(device)
        if t >= warmup:
            times.append(time.perf_counter() - t0)
        # Progress on stderr: a row cut by its time limit still says how far it got.
        print(f"step {t}: {time.perf_counter() - t0:.3f} s", file=sys.stderr, flush=True)
    return times


def torch_step(
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    autocast: bool,
    device: torch.device,
) -> Callable[[torch.Tensor], None]:
    """A plain torch training step on a step's tokens (bf16 autocast if asked)."""

    def step(tokens: torch.Tensor) -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = loss_of(forward(tokens[:, :-1]), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def eager(cfg: dict[str, int], prec: str, device: torch.device, compiled: bool = False) -> Any:
    """The plain loop; `compiled`: its module under `torch.compile` (issue 50's base)."""
    model = new_model(cfg, device)
    forward = torch.compile(model, backend=COMPILE_BACKEND) if compiled else model
    step = torch_step(forward, adamw(model.parameters(), device), prec == "bf16", device)
    return model, step, lambda: dict(model.named_parameters())


def ddp(cfg: dict[str, int], prec: str, device: torch.device) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    model = new_model(cfg, device)
    wrapped = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    step = torch_step(wrapped, adamw(wrapped.parameters(), device), prec == "bf16", device)
    return wrapped, step, lambda: dict(model.named_parameters())


def fsdp2(
    cfg: dict[str, int],
    prec: str,
    device: torch.device,
    reshard: bool = True,
    root_reshard: bool | None = True,
    compiled: bool = False,
) -> Any:
    """FSDP2 per block, then the root; `root_reshard=None` is FSDP2's own default for the
    root (kept gathered after the forward, as the backward needs it first); `compiled`:
    each block compiled first, as torchtitan does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = new_model(cfg, device)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if prec == "bf16" else None
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    kw.update({"mp_policy": mp} if mp else {})
    for blk in model.blocks:
        if compiled:
            blk.compile(backend=COMPILE_BACKEND)
        fully_shard(blk, **kw)
    fully_shard(model, **(kw | {"reshard_after_forward": root_reshard if reshard else False}))
    # No autocast: FSDP2's policy casts the parameters, as fzero's Precision does.
    step = torch_step(model, adamw(model.parameters(), device), False, device)
    return model, step, lambda: {k: v.full_tensor() for k, v in model.named_parameters()}


def fzero_run(
    cfg: dict[str, int],
    prec: str,
    device: torch.device,
    stage: int,
    reshard: bool = True,
    compiled: bool = False,
    hooks: bool = False,
) -> Any:
    """fzero at `stage`, units entering by module hooks, or (`compiled`) in a step traced
    by torch.compile, up front or (`hooks`) by the module hooks, traced."""
    mesh = fzero.ProcessGroupMesh()
    assert mesh.device == device, (mesh.device, device)
    bf16 = prec == "bf16"
    precision = fzero.Precision(torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    opt = fzero_adamw(device)
    model, units, state = sharded_model(cfg, mesh, opt, stage=stage, precision=precision)
    box = [state]
    del state

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return loss_of(functional_call(model, p, (tokens[:, :-1],)), tokens)

    train = fzero.sharded_step(
        loss_fn,
        opt,
        mesh,
        stage=stage,
        units=units,
        module=model if hooks or not compiled else None,
        reshard_after_forward=reshard,
        compile=COMPILE_BACKEND if compiled else False,
    )

    def step(tokens: torch.Tensor) -> None:
        box[0], _ = train(box[0], tokens)

    def final() -> dict[str, torch.Tensor]:
        s = box[0]
        if s.master is not None:
            return fzero.master_params(s, mesh)
        return fzero.gather_params(s.params, mesh)

    return box, step, final


def in_a_process(cmd: list[str], out: Path, timeout: float) -> Any:
    """What a fresh process running `cmd` saved to `out`, or the tail of its failure."""
    import subprocess

    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        said = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        last = said.strip().splitlines()[-1:] or ["nothing on stderr"]
        return f"timed out after {timeout:.0f} s (last: {last[0][:100]})"
    if done.returncode != 0:
        return (done.stdout + done.stderr)[-2000:]
    return torch.load(out)


def max_delta(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def measure(
    build: Callable[[], Any], data: list[torch.Tensor], warmup: int, device: torch.device
) -> dict[str, Any]:
    """One row, alone in its process: median step time, peak allocated, final params."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    held, step, final = build()
    sync(device)
    print(f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    times = timed(step, data, warmup, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    # On the host: earlier rows' parameters must not count in later rows' peaks.
    params = {k: v.detach().to("cpu", copy=True) for k, v in final().items()}
    del held, step, final
    return {"time": statistics.median(times), "peak": peak, "params": params}


def profile(
    build: Callable[[], Any], data: list[torch.Tensor], device: torch.device, rows: int = 12
) -> str:
    """torch.profiler's tables over steps 3-5 of a fresh build: by GPU time, by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    _, step, _ = build()
    for tokens in data[:3]:
        step(tokens)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with run_profile(activities=acts) as prof:
        for tokens in data[3:6]:
            step(tokens)
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
    opt = fzero_adamw(device)
    model, units, state = sharded_model(cfg, mesh, opt, stage=stage)

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        return loss_of(functional_call(model, p, (tokens[:, :-1],)), tokens)

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units, module=model)
    for t in range(steps):
        half = BATCH // 2  # the eager loop's batch, split between the two ranks
        state, _ = step(state, batch(t, BATCH, cfg, device)[mesh.rank * half :][:half])
    return {k: v.cpu() for k, v in fzero.gather_params(state.params, mesh).items()}


def builders(cfg: dict[str, int], prec: str, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Every row of a precision's table, by label, in table order (eager first)."""
    rows: dict[str, Callable[[], Any]] = {
        "eager (fused AdamW)": lambda: eager(cfg, prec, device),
        "DDP": lambda: ddp(cfg, prec, device),
        "FSDP2 (per block, reshard)": lambda: fsdp2(cfg, prec, device),
        "FSDP2 (per block, reshard; root by default)": lambda: fsdp2(
            cfg, prec, device, root_reshard=None
        ),
        "FSDP2 (per block, keep)": lambda: fsdp2(cfg, prec, device, reshard=False),
    }
    for s in range(4):
        rows[f"fzero stage {s}"] = lambda s=s: fzero_run(cfg, prec, device, s)
    rows["fzero stage 3 (keep)"] = lambda: fzero_run(cfg, prec, device, 3, False)
    # Issue 50's rows: the first step of each pays its compilation (in the warm-up).
    rows["eager, compiled"] = lambda: eager(cfg, prec, device, compiled=True)
    rows["FSDP2 (per block, reshard), blocks compiled"] = lambda: fsdp2(
        cfg, prec, device, compiled=True
    )
    for s in (0, 3):
        rows[f"fzero stage {s}, compiled"] = lambda s=s: fzero_run(
            cfg, prec, device, s, compiled=True
        )
    rows["fzero stage 3, compiled, module hooks"] = lambda: fzero_run(
        cfg, prec, device, 3, compiled=True, hooks=True
    )
    return rows
