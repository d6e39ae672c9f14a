"""AdamW on a flat host shard: parameters per second, against this machine's memory bandwidth.

    python benchmarks/host_adam.py [--params 50e6] [--steps 5] [--out RESULTS-host-adam.md]

Offloading the optimizer to the host (issue 49) is worth what the host's AdamW can do:
it reads the parameter, gradient and both moments and writes the parameter and both
moments back, 28 bytes a parameter in fp32, so its ceiling is the memory bandwidth / 28.
This measures, on one flat fp32 shard of `--params` elements (the shape an fzero unit's
shard has), the median step of

- `fzero.optim.adamw(...).update_` (in place, as `sharded_step` runs it);
- the update of an offloaded state (`shard_state(offload=fzero.Offload())`), which runs
  that same `update_` on the shard a cache-sized block at a time (`fzero._step._streamed`);
- both with `adamw(fused=True)`: the update one compiled kernel (`fzero.optim._fused`;
  the first step compiles it, and is not in the median), over the whole shard in both
  (an offloaded state blocks only unfused updates);
- `torch.optim.AdamW(foreach=True)`, `(foreach=False)` (the single-tensor loop) and
  `(fused=True)` (torch's fused CPU kernel);

beside a copy loop's bandwidth (`dst.copy_(src)`: reads and writes each byte once), and
whether each one's parameters after the steps are bitwise fzero's.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fzero

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def bandwidth(n: int, repeats: int = 7) -> tuple[float, float]:
    """Bytes per second over n fp32 elements of `dst.copy_(src)` (a read and a write per
    element) and of `torch.add(a, b, out=c)` (two reads and a write)."""
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)

    def rate(fn: object, nbytes: int) -> float:
        fn()  # type: ignore[operator]
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times)

    return rate(lambda: c.copy_(a), 8 * n), rate(lambda: torch.add(a, b, out=c), 12 * n)


def run_torch(
    p0: torch.Tensor, grads: list[torch.Tensor], **kw: object
) -> tuple[float, torch.Tensor]:
    p = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([p], **HYPER, **kw)
    times = []
    for g in grads:
        p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), p.detach()


def run_fzero(
    p0: torch.Tensor, grads: list[torch.Tensor], fused: bool = False
) -> tuple[float, torch.Tensor]:
    opt = fzero.optim.adamw(**HYPER, fused=fused)
    params = {"w": p0.clone()}
    state = opt.init(params)
    times = []
    for g in grads:
        t0 = time.perf_counter()
        params, state = opt.update_({"w": g}, state, params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times), params["w"]


def run_offloaded(
    p0: torch.Tensor, grads: list[torch.Tensor], fused: bool = False
) -> tuple[float, torch.Tensor]:
    """The update an offloaded state's step runs (`fzero._step._streamed`): in place, the
    shard in cache-sized blocks (unfused) or whole (fused). One rank; the state built by
    `shard_state(offload=)`."""
    from fzero._core import Shards
    from fzero._step._streamed import streamed_update

    def on_rank(mesh: fzero.Mesh) -> tuple[float, torch.Tensor]:
        opt = fzero.optim.adamw(**HYPER, fused=fused)
        state = fzero.shard_state({"w": p0}, opt, mesh, stage=1, offload=fzero.Offload())
        master, opt_state, times = state.master, state.opt_state, []
        for g in grads:
            shards = Shards((g,), master.layout, master.rank)
            t0 = time.perf_counter()
            master, opt_state, _ = streamed_update(
                opt, master, shards, opt_state, mesh, True, state.offload, lambda k, m: m
            )
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:] or times), master.buffers[0][: p0.numel()].clone()

    import torch.distributed as dist

    if not dist.is_initialized():  # one rank in this process: the parent's threads stay
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29431", rank=0, world_size=1)
    return on_rank(fzero.ProcessGroupMesh())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-host-adam.md"))
    args = ap.parse_args()
    n = int(args.params)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(args.steps)]
    copy_bw, add_bw = bandwidth(n)
    bw = max(copy_bw, add_bw)
    ceiling = bw / 28
    t_fzero, ref = run_fzero(p0, grads)
    rows = [("fzero.optim.adamw update_ (in place)", t_fzero, True, 0.0)]
    t, p = run_offloaded(p0, grads)
    rows.append(
        (
            "fzero offload: the same update_ in blocks of 2^20",
            t,
            torch.equal(p, ref),
            (p - ref).abs().max().item(),
        )
    )
    for label, run in [
        ("fzero.optim.adamw(fused=True): one compiled kernel (inductor)", run_fzero),
        ("fzero offload, adamw(fused=True): one kernel over the shard", run_offloaded),
    ]:
        t, p = run(p0, grads, fused=True)
        rows.append((label, t, torch.equal(p, ref), (p - ref).abs().max().item()))
    for label, kw in [
        ("torch AdamW foreach=True", {"foreach": True}),
        ("torch AdamW foreach=False (single-tensor)", {"foreach": False}),
        ("torch AdamW fused=True", {"fused": True}),
    ]:
        t, p = run_torch(p0, grads, **kw)
        rows.append((label, t, torch.equal(p, ref), (p - ref).abs().max().item()))
    lines = [
        "# AdamW on a flat host shard (issue 49)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}: `python "
        f"benchmarks/host_adam.py --params {args.params:g} --steps {args.steps}`.",
        "",
        f"One fp32 shard of {n / 1e6:.0f}M parameters; median of {args.steps - 1} steps after "
        f"the first. Memory bandwidth: `dst.copy_(src)` {copy_bw / 1e9:.1f} GB/s, "
        f"`torch.add(a, b, out=c)` {add_bw / 1e9:.1f} GB/s (bytes read + written); at the "
        f"larger, AdamW's 28 bytes a parameter give **{ceiling / 1e9:.2f} G params/s**.",
        "",
        "| AdamW | step (ms) | G params/s | x the bandwidth's rate | bitwise fzero's | max abs Δ |",
        "|---|---:|---:|---:|:---:|---:|",
    ]
    for label, t, same, delta in rows:
        rate = n / t
        lines.append(
            f"| {label} | {t * 1e3:.1f} | {rate / 1e9:.3f} | {rate / ceiling:.2f} | "
            f"{'yes' if same else 'no'} | {delta:.2e} |"
        )
    lines.append("")
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
