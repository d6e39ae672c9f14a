"""The demo: a small GPT trained at every ZeRO stage, checked against one process."""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from tqdm import tqdm

from .. import _comm, optim
from .._comm import Mesh, ProcessGroupMesh, comm_ledger
from .._core import by_module, max_abs_diff
from .._engine import all_reduce_grads, gather_params
from .._state import shard_state
from .._step import sharded_step
from ._memory import estimate_memory, memory_report
from ._simulate import simulate
from ._traffic import estimate_comm


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
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
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
    world_size: int | None = None,
    steps: int = 30,
    micro_batch: int = 4,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    lr: float = 3e-3,
    dtype: torch.dtype = torch.float64,
    print_fn: Any = print,
    launcher: str = "simulate",
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """Trains TinyGPT at each stage and checks it against one process; one row per stage.

    Each row: final mean loss over ranks, max |delta| of the gathered parameters against a
    single process running torch.optim.AdamW on the concatenated batch, rank 0's measured
    parameter and optimizer-state bytes next to the ZeRO formula, and the bytes rank 0
    communicated per step (fzero's logical volume) next to the ZeRO paper's 2Ψ / 3Ψ.

    Args:
      world_size: ranks to simulate (default 4); under torchrun, the job's world size
        (None, or it must agree).
      steps: training steps per stage.
      micro_batch: sequences per rank per step.
      stages: the ZeRO stages to run, in order.
      lr: AdamW's learning rate.
      dtype: parameter dtype; float64 makes the comparison with the reference exact.
      print_fn: where the table goes (rank 0 only under torchrun).
      launcher: "simulate" (fork `world_size` ranks from this process) or "torchrun"
        (this process is one rank of a torchrun job: RANK / WORLD_SIZE from the
        environment, a gloo process group is initialised if none is).
      progress: a step progress bar on stderr, drawn by rank 0; None: only if stderr is
        a terminal.

    Returns:
      The rows, as dicts (the same on every rank under torchrun).
    """
    check_demo_args(world_size, steps, micro_batch, launcher)
    mesh, owned = _torchrun_mesh() if launcher == "torchrun" else (None, False)
    world_size = mesh.size if mesh is not None else (world_size or 4)
    if mesh is not None and mesh.rank != 0:
        print_fn = _silent
    torch.manual_seed(0)
    model = TinyGPT().to(dtype)
    nbytes = torch.empty((), dtype=dtype).element_size()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    psi = sum(p.numel() for p in params.values())
    data = make_data(steps, world_size * micro_batch)
    # One unit per block and per embedding / head, gathered just in time through hooks on
    # `model`: stage 3 then holds one unit of full parameters at a time and moves the
    # ZeRO paper's 3Ψ per step (a unit is gathered again for its backward).
    units = [*by_module(model, Block), "tok", "pos", "head"]

    def loss_fn(p: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (tokens[:, :-1],))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    reference = _train_reference(model, loss_fn, data, lr)
    opt = optim.adamw(lr=lr)

    def train(mesh: Mesh, stage: int) -> dict[str, Any]:
        state = shard_state(params, opt, mesh, stage=stage, units=units)
        step = sharded_step(loss_fn, opt, mesh, stage=stage, module=model)
        sl = slice(mesh.rank * micro_batch, (mesh.rank + 1) * micro_batch)
        bar = tqdm(
            total=steps,
            desc=f"stage {stage}",
            unit="step",
            leave=False,  # the table row replaces it
            file=sys.stderr,
            disable=(mesh.rank != 0) or (None if progress is None else not progress),
        )
        with bar, comm_ledger() as ledger:
            for t in range(steps):
                state, loss = step(state, data[t, sl])
                bar.update()
            bar.refresh()  # show the last step: fast steps can all fall within tqdm's mininterval
        mean_loss = all_reduce_grads({"loss": loss}, mesh)["loss"]  # outside the ledger
        return {
            "loss": mean_loss.item(),
            "params": gather_params(state.params, mesh),
            "memory": memory_report(state),
            "comm": ledger.nbytes / steps,
        }

    where = (
        f"{world_size} simulated ranks"
        if mesh is None
        else f"{world_size} torchrun ranks ({mesh.backend})"
    )
    print_fn(
        f"TinyGPT, {psi:,} parameters, AdamW ({dtype}), {where} x micro-batch {micro_batch}, "
        f"{steps} steps"
    )
    print_fn(f"single-process reference (torch.optim.AdamW): final loss {reference['loss']:.4f}\n")
    print_fn(
        f"{'stage':>5} {'loss':>8} {'max|Δ| vs ref':>14} {'params B/rank':>14} "
        f"{'formula':>9} {'optim B/rank':>13} {'formula':>9} {'comm B/step':>12} "
        f"{'formula':>9} {'time':>6}"
    )
    rows = []
    try:
        for stage in stages:
            t0 = time.perf_counter()
            results = simulate(world_size, train, stage) if mesh is None else [train(mesh, stage)]
            rows.append(_row(stage, results, reference, psi, world_size, nbytes, t0))
            print_fn(_format_row(rows[-1]))
    finally:
        if owned:
            _comm.destroy_process_group()
    print_fn(
        f"\nformula: ZeRO per-rank model states for Adam without mixed precision ({nbytes} B per"
        f" parameter,\n{2 * nbytes} B of moments) and bytes sent per step (2Ψ elements at stages"
        " 0-2, 3Ψ at stage 3,\nZeRO section 7). Measured bytes add < world-size elements of"
        " padding per unit, the\noptimizer's 8-byte step counter, and the ranks' few bytes a"
        " step of agreement (the\nledger's control records); stage 3 gathers its root unit"
        " (the final norm) only once,\ndoes not gather again the embeddings (their backward"
        " needs no weights), and from the\nsecond step keeps the forward's last two units"
        " gathered for the backward."
    )
    return rows


def _row(
    stage: int,
    results: list[dict[str, Any]],
    reference: dict[str, Any],
    psi: int,
    world_size: int,
    nbytes: int,
    t0: float,
) -> dict[str, Any]:
    """A table row from the ranks' results (rank 0's bytes; the worst rank's |delta|)."""
    want = estimate_memory(
        psi, world_size, stage, param_bytes=nbytes, grad_bytes=nbytes, optim_bytes=2 * nbytes
    )
    mem = results[0]["memory"]
    return {
        "stage": stage,
        "loss": results[0]["loss"],
        "max_delta": max(max_abs_diff(r["params"], reference["params"]) for r in results),
        "param_bytes": mem.params,
        "param_formula": math.ceil(want.params),
        "opt_bytes": mem.opt_state,
        "opt_formula": math.ceil(want.opt_state),
        # Nothing moves on one rank; otherwise ZeRO section 7's volumes per step.
        "comm_bytes": round(results[0]["comm"]),
        "comm_formula": 0
        if world_size == 1
        else round(sum(estimate_comm(psi, world_size, stage, elem_bytes=nbytes))),
        "seconds": time.perf_counter() - t0,
    }


def _format_row(row: dict[str, Any]) -> str:
    return (
        f"{row['stage']:>5} {row['loss']:>8.4f} {row['max_delta']:>14.2e} "
        f"{row['param_bytes']:>14,} {row['param_formula']:>9,} {row['opt_bytes']:>13,} "
        f"{row['opt_formula']:>9,} {row['comm_bytes']:>12,} {row['comm_formula']:>9,} "
        f"{row['seconds']:>5.1f}s"
    )


def _silent(*args: Any, **kwargs: Any) -> None:
    """print_fn of ranks other than 0 under torchrun."""


def check_demo_args(world_size: int | None, steps: int, micro_batch: int, launcher: str) -> None:
    """Raises ValueError naming the first bad argument of `run_demo` (before any work).

    Args:
      world_size: as for `run_demo`.
      steps: as for `run_demo`.
      micro_batch: as for `run_demo`.
      launcher: as for `run_demo`.
    """
    if launcher not in ("simulate", "torchrun"):
        raise ValueError(f"launcher must be 'simulate' or 'torchrun', got {launcher!r}")
    for name, value in (
        ("world_size", world_size or 1),
        ("steps", steps),
        ("micro_batch", micro_batch),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if launcher == "simulate" or _comm.is_initialized():
        return
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise ValueError(
            f"the torchrun launcher needs torchrun's environment ({', '.join(missing)} not "
            "set): torchrun --nproc-per-node 4 -m fzero demo --launcher torchrun"
        )
    if world_size is not None and world_size != int(os.environ["WORLD_SIZE"]):
        raise ValueError(
            f"world size {world_size} disagrees with torchrun's WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}"
        )


def _torchrun_mesh() -> tuple[ProcessGroupMesh, bool]:
    """This process's rank of a torchrun job, and whether we initialised its process group."""
    owned = not _comm.is_initialized()
    if owned:
        _comm.init_process_group("gloo", 120.0)
    return ProcessGroupMesh(), owned


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
