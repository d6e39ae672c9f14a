"""A model larger than one rank's memory: built on meta, initialized sharded, trained, exported.

    torchrun --nproc-per-node 4 examples/big_model.py --out model.safetensors
    python examples/big_model.py --check model.safetensors
    torchrun --nproc-per-node 4 examples/big_model.py --eager   # the control: fails

Each rank process caps its own address space (RLIMIT_AS) at what it has mapped after
start-up plus `--cap` times the model's fp32 size (plus `--headroom` for the runtime's
threads and kernels), so an allocation that would hold the
whole model (an eager construction, a broadcast of it, an unsharded export) fails with
an out-of-memory error instead of passing unnoticed. Stage 3 at 4 ranks with plain SGD
keeps a quarter of the parameters and, during a step, a quarter of the gradients and
two units' full tensors: well under the cap. After training, the held-out loss is
evaluated under the cap too (`fzero.sharded_forward`: a unit at a time, as the step's
forward), and the export is written unit by unit on rank 0. `--check` then loads the
file with plain torch and safetensors, outside the cap, and evaluates the same batch.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import fzero


class Block(nn.Module):
    """Pre-norm transformer block with a causal mask kept as a non-persistent buffer."""

    def __init__(self, d: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.empty(seq, seq, dtype=torch.bool), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Only what this module owns directly: its children initialize themselves.
        n = self.mask.shape[0]
        self.mask.copy_(torch.ones(n, n, dtype=torch.bool, device=self.mask.device).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask[:t, :t]
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, seq) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--cap", type=float, default=0.75, help="x the fp32 model, per rank")
    p.add_argument("--headroom", type=int, default=128, help="MiB on top, for the runtime")
    p.add_argument("--out", default="model.safetensors")
    p.add_argument("--check", default=None, help="load this export in plain torch and exit")
    p.add_argument(
        "--eager", action="store_true", help="the control: build the model whole (fails the cap)"
    )
    return p.parse_args()


def build(args: argparse.Namespace) -> GPT:
    return GPT(args.vocab, args.width, args.layers, args.heads, args.seq)


def tokens(args: argparse.Namespace, step: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(args.vocab, (batch, args.seq + 1), generator=g)


def held_out(args: argparse.Namespace) -> torch.Tensor:
    return tokens(args, 10_000, 4)  # a step number training never reaches


def loss_of(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def cap_memory(limit: int) -> None:
    """Caps this process's address space at what it maps now plus `limit` bytes."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-8, 1)  # M_ARENA_MAX: one heap, not a 64 MiB reservation per thread
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed tensors are unmapped
    vm = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if "VmSize" in ln)
    now = int(vm.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (now + limit, now + limit))


def check(args: argparse.Namespace) -> None:
    from safetensors.torch import load_file

    model = build(args)
    torch.manual_seed(0)
    start = {k: v.detach().clone() for k, v in build(args).state_dict().items()}
    model.load_state_dict(load_file(args.check), strict=True)  # every key, right shapes
    moved = sum(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
    batch = held_out(args)
    with torch.no_grad():
        loss = loss_of(model(batch[:, :-1]), batch).item()
    print(f"plain torch loaded {args.check}: {moved} tensors trained, held-out loss {loss:.6f}")


def main() -> None:
    args = parse_args()
    if args.check:
        return check(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    mesh = fzero.ProcessGroupMesh()
    with torch.device("meta"):
        model = build(args)  # no memory: shapes only
    psi = sum(p.numel() for p in model.parameters())
    cap_memory(int(args.cap * 4 * psi) + args.headroom * 2**20)

    units = [*fzero.units.by_module(model, Block), "tok", "pos", "ln", "head"]
    opt = fzero.optim.sgd(lr=0.5)
    if args.eager:  # today's path without init=: every rank holds the whole model first
        torch.manual_seed(0)
        whole = build(args)
        fzero.shard_state(dict(whole.named_parameters()), opt, mesh, stage=3, units=units)
    state = fzero.shard_state(
        dict(model.named_parameters()), opt, mesh, stage=3, units=units,
        buffers=dict(model.named_buffers()),
        init=fzero.init.from_module(model, seed=0),  # == torch.manual_seed(0); build(args)
    )  # fmt: skip

    def loss_fn(params: dict, buffers: dict, batch: torch.Tensor) -> tuple:
        logits = functional_call(model, (params, buffers), (batch[:, :-1],))
        return loss_of(logits, batch), buffers

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model)
    mine = slice(mesh.rank * args.micro_batch, (mesh.rank + 1) * args.micro_batch)
    for t in range(args.steps):
        state, loss = step(state, tokens(args, t, mesh.size * args.micro_batch)[mine])
        if mesh.rank == 0:
            print(f"step {t}  loss {loss.item():.4f}", flush=True)

    def eval_fn(params: dict, buffers: dict, batch: torch.Tensor) -> torch.Tensor:
        return loss_of(functional_call(model, (params, buffers), (batch[:, :-1],)), batch)

    evaluate = fzero.sharded_forward(eval_fn, mesh, module=model)
    held = evaluate(state, held_out(args))  # every rank the same batch: the same loss
    if mesh.rank == 0:
        print(f"held-out loss {held.item():.6f} (sharded_forward, under the cap)", flush=True)
    fzero.checkpoint.export_safetensors(state, args.out, mesh, module=model)
    if mesh.rank == 0:
        peak = next(
            ln for ln in Path("/proc/self/status").read_text().splitlines() if "VmHWM" in ln
        )
        print(
            f"{psi / 1e6:.1f}M parameters ({4 * psi / 2**20:.0f} MiB fp32) on {mesh.size} "
            f"ranks capped at {args.cap} x that; rank 0 peak resident {peak.split()[1]} kB; "
            f"wrote {args.out}",
            flush=True,
        )
    dist.barrier()  # every rank past its last collective: gloo may abort one that is not
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
