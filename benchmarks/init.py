"""Setup memory of a model larger than one rank: deferred init, loads and exports, vs FSDP2.

    python benchmarks/init.py [--world-size 4] [--out benchmarks/RESULTS-init.md]

Each of `--world-size` simulated ranks (gloo) measures its peak resident set above its
level before the operation (VmHWM after a reset, with glibc's mmap threshold at 64 KiB so
freed tensors leave the resident set; MALLOC_MMAP_THRESHOLD_=65536 does the same), after
running the operation once unmeasured so code pages and lazy runtime state are not
counted. The model is a GPT-like decoder whose fp32 parameters are larger than one
rank's final state at stage 3 with Adam (parameter and moment shards).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fzero
from fzero._tools._demo import TinyGPT

CONFIG = dict(vocab=8192, block=256, d=1024, layers=6, heads=16)
MB = 2**20


def build() -> TinyGPT:
    return TinyGPT(**CONFIG)


def units() -> list[str]:
    return ["tok", "pos", *(f"blocks.{i}" for i in range(CONFIG["layers"])), "ln", "head"]


def peak(fn: Any) -> tuple[int, Any]:
    """(peak resident rise in bytes, result) of `fn()`."""
    status = Path("/proc/self/status")

    def vm(key: str) -> int:
        line = next(ln for ln in status.read_text().splitlines() if ln.startswith(key))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = vm("VmRSS")
    out = fn()
    return vm("VmHWM") - before, out


def rank(mesh: fzero.Mesh, work: str) -> dict[str, Any]:
    if ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt failed")
    with torch.device("meta"):
        meta = build()
    file, ckpt = f"{work}/model.safetensors", f"{work}/ckpt"
    adam = fzero.optim.adam(1e-3)

    def deferred(init: Any) -> Any:
        return lambda: fzero.shard_state(
            dict(meta.named_parameters()), adam, mesh, stage=3, units=units(), init=init
        )

    def eager() -> Any:
        torch.manual_seed(0)
        model = build()
        return fzero.shard_state(dict(model.named_parameters()), adam, mesh, stage=3, units=units())

    out: dict[str, Any] = {}

    def measure(name: str, fn: Any) -> Any:
        fn()  # warm
        t0 = time.perf_counter()
        rise, result = peak(fn)
        out[name] = (rise, time.perf_counter() - t0)
        return result

    sgd = fzero.optim.sgd(1e-3)
    measure(
        "from_module, parameters only (plain SGD: no optimizer state)",
        lambda: fzero.shard_state(
            dict(meta.named_parameters()), sgd, mesh, stage=3, units=units(),
            init=fzero.init.from_module(meta, seed=0),
        ),
    )  # fmt: skip
    state = measure("from_module", deferred(fzero.init.from_module(meta, seed=0)))
    measure("export_safetensors", lambda: fzero.checkpoint.export_safetensors(state, file, mesh))
    measure("from_file (safetensors)", deferred(fzero.init.from_file(file)))
    fzero.checkpoint.save(state, ckpt, mesh)
    params_like = dict(meta.named_parameters())
    measure(
        "checkpoint.load (meta params_like)",
        lambda: fzero.checkpoint.load(ckpt, mesh, adam, params_like, stage=3),
    )
    measure(
        "export_torch (file)", lambda: fzero.checkpoint.export_torch(state, f"{work}/m.pt", mesh)
    )
    # Bitwise against eager construction, leaf by leaf (after the measurements).
    gathered = fzero.gather_params(state.params, mesh)
    torch.manual_seed(0)
    ref = dict(build().named_parameters())
    out["max_delta"] = max((gathered[k] - ref[k].detach()).abs().max().item() for k in ref)
    del gathered, ref
    out["shards"] = fzero.memory_report(state).params + fzero.memory_report(state).opt_state
    state = None
    measure("eager build, then shard_state (today's path)", eager)
    out.update(fsdp2(mesh))
    return out


def fsdp2(mesh: fzero.Mesh) -> dict[str, Any]:
    """FSDP2's meta-device recipe: fully_shard per block and the root, to_empty, then each
    module's reset_parameters on the DTensor shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dmesh = init_device_mesh("cpu", (mesh.size,))

    def make() -> Any:
        with torch.device("meta"):
            model = build()
        for blk in model.blocks:
            fully_shard(blk, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)) and m is not model:
                m.reset_parameters()
        return model

    make()
    t0 = time.perf_counter()
    rise, model = peak(make)
    seconds = time.perf_counter() - t0
    torch.manual_seed(0)
    ref = dict(build().named_parameters())
    delta = max(
        (p.full_tensor() - ref[k].detach()).abs().max().item() for k, p in model.named_parameters()
    )
    return {"FSDP2 meta + to_empty + reset_parameters": (rise, seconds), "fsdp2_delta": delta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-init.md"))
    args = ap.parse_args()
    n = args.world_size
    model = build()
    psi = sum(p.numel() for p in model.parameters())
    full = 4 * psi
    largest = max(
        sum(p.numel() for n_, p in model.named_parameters() if n_.startswith(u + ".")) * 4
        for u in units()
    )
    del model
    with tempfile.TemporaryDirectory() as work:
        results = fzero.simulate(n, rank, work)
    shards = max(r["shards"] for r in results)
    bound = shards + 2 * largest
    rows = [k for k, v in results[0].items() if isinstance(v, tuple)]
    lines = [
        "# Setup memory of a model larger than one rank (issue 17)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}"
        f" ({torch.get_num_threads()} threads), torch {torch.__version__}, "
        f"`python benchmarks/init.py --world-size {n}`.",
        "",
        f"Model: TinyGPT {CONFIG}: **{psi / 1e6:.1f}M parameters, {full / MB:.0f} MiB fp32**. "
        f"Stage 3, world size {n}, Adam, units = embeddings, each block, norm, head.",
        f"A rank's final state (parameter + Adam moment shards): {shards / MB:.0f} MiB; "
        f"largest unit {largest / MB:.0f} MiB; "
        f"**bound = state + 2 x largest unit = {bound / MB:.0f} MiB** "
        f"({bound / full:.2f} x the fp32 model).",
        "",
        "Peak resident rise per rank (max over ranks; exports: rank 0, which writes):",
        "",
        "| operation | peak rise (MiB) | x fp32 model | within bound | seconds |",
        "|---|---:|---:|:---:|---:|",
    ]
    for k in rows:
        rise = max(r[k][0] for r in results) if "export" not in k else results[0][k][0]
        secs = max(r[k][1] for r in results)
        ok = "yes" if rise <= bound else "**no**"
        lines.append(f"| {k} | {rise / MB:.0f} | {rise / full:.2f} | {ok} | {secs:.2f} |")
    lines += [
        "",
        f"Values vs eager `torch.manual_seed(0); TinyGPT(...)`: fzero from_module max |delta| = "
        f"{max(r['max_delta'] for r in results):.3g}; FSDP2's recipe max |delta| = "
        f"{max(r['fsdp2_delta'] for r in results):.3g}.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
