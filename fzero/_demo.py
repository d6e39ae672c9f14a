"""The demo: a small GPT trained at every ZeRO stage, checked against one process."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from . import optim
from ._gather import gather_params
from ._memory import estimate_memory, memory_report
from ._mesh import Mesh
from ._simulate import simulate
from ._state import shard_state
from ._step import sharded_step
from ._tree import max_abs_diff


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-like decoder: token and position embeddings, blocks, a final norm and head."""

    def __init__(
        self, vocab: int = 32, block: int = 16, d: int = 32, layers: int = 2, heads: int = 2
    ) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_data(
    steps: int, batch: int, vocab: int = 32, block: int = 16, seed: int = 0
) -> torch.Tensor:
    """Token sequences that count up mod `vocab` from a random start with a random stride."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab, (steps, batch, 1), generator=g)
    stride = torch.randint(1, 4, (steps, batch, 1), generator=g)
    return (start + stride * torch.arange(block + 1)) % vocab


def run_demo(
    world_size: int = 4,
    steps: int = 30,
    micro_batch: int = 4,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    lr: float = 3e-3,
    dtype: torch.dtype = torch.float64,
    print_fn: Any = print,
) -> list[dict[str, Any]]:
    """Trains TinyGPT at each stage on `world_size` simulated ranks; returns one row per stage.

    Each row: final mean loss over ranks, max |delta| of the gathered parameters against a
    single process running torch.optim.AdamW on the concatenated batch, and rank 0's
    measured parameter and optimizer-state bytes next to the ZeRO formula.
    """
    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    psi = sum(p.numel() for p in params.values())
    data = make_data(steps, world_size * micro_batch)

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (tokens[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    reference = _train_reference(model, loss_fn, data, lr)
    opt = optim.adamw(lr=lr)

    def train(mesh: Mesh, stage: int) -> dict[str, Any]:
        state = shard_state(params, opt, mesh, stage=stage)
        step = sharded_step(loss_fn, opt, mesh, stage=stage)
        sl = slice(mesh.rank * micro_batch, (mesh.rank + 1) * micro_batch)
        for t in range(steps):
            state, loss = step(state, data[t, sl])
        return {
            "loss": loss.item(),
            "params": gather_params(state.params, mesh),
            "memory": memory_report(state),
        }

    print_fn(
        f"TinyGPT, {psi:,} parameters, AdamW ({dtype}), {world_size} simulated ranks "
        f"x micro-batch {micro_batch}, {steps} steps"
    )
    print_fn(f"single-process reference (torch.optim.AdamW): final loss {reference['loss']:.4f}\n")
    header = (
        f"{'stage':>5} {'loss':>8} {'max|Δ| vs ref':>14} {'params B/rank':>14} "
        f"{'formula':>9} {'optim B/rank':>13} {'formula':>9} {'time':>6}"
    )
    print_fn(header)
    rows = []
    for stage in stages:
        t0 = time.perf_counter()
        results = simulate(world_size, train, stage)
        elapsed = time.perf_counter() - t0
        want = estimate_memory(
            psi, world_size, stage, param_bytes=nbytes, grad_bytes=nbytes, optim_bytes=2 * nbytes
        )
        mem = results[0]["memory"]
        row = {
            "stage": stage,
            "loss": sum(r["loss"] for r in results) / world_size,
            "max_delta": max(max_abs_diff(r["params"], reference["params"]) for r in results),
            "param_bytes": mem.params,
            "param_formula": want.params,
            "opt_bytes": mem.opt_state,
            "opt_formula": want.opt_state,
            "seconds": elapsed,
        }
        rows.append(row)
        print_fn(
            f"{stage:>5} {row['loss']:>8.4f} {row['max_delta']:>14.2e} {mem.params:>14,} "
            f"{math.ceil(want.params):>9,} {mem.opt_state:>13,} {math.ceil(want.opt_state):>9,} "
            f"{elapsed:>5.1f}s"
        )
    print_fn(
        f"\nformula: ZeRO per-rank model states for Adam without mixed precision ({nbytes} B per"
        f" parameter,\n{2 * nbytes} B of moments); measured bytes add < world-size elements of"
        " padding and the\noptimizer's 8-byte step counter."
    )
    return rows


def _train_reference(
    model: nn.Module, loss_fn: Any, data: torch.Tensor, lr: float
) -> dict[str, Any]:
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=lr, foreach=False)
    for t in range(data.shape[0]):
        opt.zero_grad()
        loss = loss_fn(params, data[t])
        loss.backward()
        opt.step()
    # The reference's last loss is on the whole batch before its last update, like the ranks'.
    return {"loss": loss.item(), "params": {k: v.detach() for k, v in params.items()}}
