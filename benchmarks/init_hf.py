"""Setup memory of a Hugging Face model (Llama, ~100M parameters), deferred, beside FSDP2.

    python benchmarks/init_hf.py [--world-size 4] [--out benchmarks/RESULTS-init-hf.md]

Each of `--world-size` simulated ranks (gloo) measures its peak resident rise (VmHWM
after a reset; glibc's mmap threshold at 64 KiB so freed tensors leave the resident set)
while it builds its stage-3 state, after one unmeasured run of the same operation:

- fzero: `fzero.init.deferred(AutoModelForCausalLM.from_config, cfg)` (the construction
  recorded on fake tensors), then `shard_state(..., init=fzero.init.from_module(model))`
  with Adam: every leaf replayed alone, this rank keeping its slice;
- eager: `from_config` on every rank, then `shard_state` of its parameters;
- FSDP2's recipe for a Hugging Face model: built on the meta device, `fully_shard` per
  decoder layer and the root, `to_empty`, then the model's own `init_weights()` on the
  DTensor shards (and RoPE's `inv_freq`, left as garbage by `to_empty`, recomputed).

The values are compared, leaf by leaf, with the eager `torch.manual_seed(0); from_config`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from init import peak
from transformers import AutoModelForCausalLM, LlamaConfig

import fzero

MB = 2**20
CONFIG = dict(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
    num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
)  # fmt: skip


def config() -> LlamaConfig:
    return LlamaConfig(**CONFIG)


def eager_values() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config())
    return {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def rank(mesh: fzero.Mesh) -> dict[str, Any]:
    if ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt failed")
    adam = fzero.optim.adam(1e-3)
    out: dict[str, Any] = {}

    def measure(name: str, fn: Any) -> Any:
        fn()  # warm
        gc.collect()
        t0 = time.perf_counter()
        rise, result = peak(fn)
        out[name] = (rise, time.perf_counter() - t0)
        return result

    def deferred() -> Any:
        model = fzero.init.deferred(AutoModelForCausalLM.from_config, config(), seed=0)
        state = fzero.shard_state(
            dict(model.named_parameters()), adam, mesh, stage=3,
            units=fzero.units.auto(model), buffers=dict(model.named_buffers()),
            init=fzero.init.from_module(model),
        )  # fmt: skip
        return model, state

    def eager() -> Any:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config())
        return fzero.shard_state(
            dict(model.named_parameters()), adam, mesh, stage=3, units=fzero.units.auto(model),
            buffers=dict(model.named_buffers()),
        )  # fmt: skip

    model, state = measure("fzero deferred + from_module (Adam)", deferred)
    want = eager_values()
    got = fzero.gather_params(state.params, mesh)
    got.update(state.buffers)
    out["fzero_delta"] = max((got[k] - want[k]).abs().max().item() for k in want)
    report = fzero.memory_report(state)
    out["shards"] = report.params + report.opt_state
    sizes = {  # every unit's parameter bytes, the root's (what no block holds) included
        u: sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n.startswith(u + "."))
        for u in fzero.units.auto(model)
    }  # fmt: skip
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    out["largest_unit"] = max([*sizes.values(), total - sum(sizes.values())])
    del got, state
    measure("eager from_config, then shard_state (Adam)", eager)
    rise, seconds, delta = fsdp2(mesh, want)
    out["FSDP2 meta + fully_shard + to_empty + init_weights"] = (rise, seconds)
    out["fsdp2_delta"] = delta
    return out


def fsdp2(mesh: fzero.Mesh, want: dict[str, torch.Tensor]) -> tuple[int, float, float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dmesh = init_device_mesh("cpu", (mesh.size,))

    def make() -> Any:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config())
        for layer in model.model.layers:
            fully_shard(layer, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights()
            rotary = model.model.rotary_emb  # to_empty left garbage: recompute it
            inv_freq, _ = rotary.compute_default_rope_parameters(rotary.config, device="cpu")
            rotary.inv_freq.copy_(inv_freq)
            rotary.original_inv_freq = inv_freq
        return model

    make()
    gc.collect()  # FSDP2's modules hold reference cycles: the warm-up's must go first
    t0 = time.perf_counter()
    rise, model = peak(make)
    seconds = time.perf_counter() - t0
    got = {k: v.full_tensor() for k, v in model.named_parameters()}
    got.update(dict(model.named_buffers()))
    delta = max((got[k] - want[k]).abs().max().item() for k in want)
    return rise, seconds, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "RESULTS-init-hf.md"))
    args = ap.parse_args()
    n = args.world_size
    with torch.device("meta"):
        psi = sum(p.numel() for p in AutoModelForCausalLM.from_config(config()).parameters())
    full = 4 * psi
    t0 = time.perf_counter()
    results = fzero.simulate(n, rank)
    wall = time.perf_counter() - t0
    shards = max(r["shards"] for r in results)
    largest = results[0]["largest_unit"]
    bound = shards + 2 * largest
    rows = [k for k, v in results[0].items() if isinstance(v, tuple)]
    lines = [
        "# Setup memory of a Hugging Face model, deferred (issue 48)",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.processor() or platform.machine()}"
        f" ({torch.get_num_threads()} threads), torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}, `python benchmarks/init_hf.py "
        f"--world-size {n}` ({wall:.0f} s).",
        "",
        f"Model: `LlamaForCausalLM` {CONFIG}: **{psi / 1e6:.1f}M parameters, "
        f"{full / MB:.0f} MiB fp32**. Stage 3, world size {n}, Adam, `units.auto` (one unit "
        "per decoder layer; the root holds the embeddings, the final norm and the head).",
        f"A rank's final state (parameter + Adam moment shards): {shards / MB:.0f} MiB; "
        f"largest unit {largest / MB:.0f} MiB; **bound = state + 2 x largest unit = "
        f"{bound / MB:.0f} MiB** ({bound / full:.2f} x the fp32 model).",
        "",
        "Peak resident rise per rank (max over ranks):",
        "",
        "| operation | peak rise (MiB) | x fp32 model | within bound | seconds |",
        "|---|---:|---:|:---:|---:|",
    ]
    for k in rows:
        rise = max(r[k][0] for r in results)
        secs = max(r[k][1] for r in results)
        ok = "yes" if rise <= bound else "**no**"
        lines.append(f"| {k} | {rise / MB:.0f} | {rise / full:.2f} | {ok} | {secs:.2f} |")
    lines += [
        "",
        "Values vs eager `torch.manual_seed(0); AutoModelForCausalLM.from_config(cfg)`, "
        f"max |delta| over every parameter and buffer: fzero "
        f"{max(r['fzero_delta'] for r in results):.3g}; FSDP2's recipe "
        f"{max(r['fsdp2_delta'] for r in results):.3g}.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
