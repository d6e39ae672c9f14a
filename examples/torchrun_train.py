"""Train a small model with fzero under torchrun, on one machine or several.

One machine, 4 processes:

    torchrun --nproc-per-node 4 examples/torchrun_train.py --stage 3 --out params.pt

Two machines, 2 processes each (run on both; HOST is machine 0's address, reachable from
machine 1, and PORT a free port on it):

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST \\
        --master-port PORT examples/torchrun_train.py --stage 3 --out params.pt
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 --master-addr HOST \\
        --master-port PORT examples/torchrun_train.py --stage 3 --out params.pt

Every rank builds the same model from the same seed and reads its own slice of each
global batch; rank 0 saves the trained parameters, gathered, with torch.save.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import fzero


class Block(nn.Module):
    """A residual MLP block: one unit of sharding (gathered just before its forward)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    """Input projection, residual blocks, output head: a regression model."""

    def __init__(self, d_in: int = 16, width: int = 32, depth: int = 3, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def make_model(dtype: torch.dtype, seed: int = 0) -> Model:
    """The model every rank (and a single-process reference) starts from."""
    torch.manual_seed(seed)
    return Model().to(dtype)


def make_data(steps: int, batch: int, dtype: torch.dtype, seed: int = 1) -> list[tuple]:
    """`steps` global batches of (x, y): a fixed random linear map plus a nonlinearity."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g, dtype=dtype)
    data = []
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g, dtype=dtype)
        data.append((x, torch.tanh(x @ w)))
    return data


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=8, help="examples per rank per step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--out", default=None, help="rank 0 saves the trained parameters here")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective waits for its peers before failing",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    mesh = fzero.ProcessGroupMesh()
    rank, world = mesh.rank, mesh.size

    # Same seed on every rank (shard_state also broadcasts rank 0's values, like DDP).
    model = make_model(dtype).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    data = make_data(args.steps, world * args.micro_batch, dtype)

    def loss_fn(params: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(functional_call(model, params, (x,)), y)

    # One unit per block plus the input and the head; with module=model each unit is
    # gathered (stage 3) just before its forward and reduced as soon as its backward ends.
    units = [*fzero.units.by_module(model, Block), "inp", "head"]
    opt = fzero.optim.adamw(lr=args.lr, weight_decay=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=args.stage, units=units)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=args.stage, module=model)

    t0 = time.perf_counter()
    mine = slice(rank * args.micro_batch, (rank + 1) * args.micro_batch)
    for t, (x, y) in enumerate(data):
        state, loss = step(state, (x[mine].to(device), y[mine].to(device)))
        if rank == 0 and (t % 5 == 0 or t == args.steps - 1):
            print(f"step {t:4d}  loss (rank 0's micro-batch) {loss.item():.6f}", flush=True)
    elapsed = time.perf_counter() - t0

    # Every rank takes part in the gather; only rank 0 writes.
    full = fzero.gather_params(state.params, mesh)
    memory = fzero.memory_report(state)
    if rank == 0:
        if args.out:
            torch.save({k: v.cpu() for k, v in full.items()}, args.out)
        psi = sum(v.numel() for v in full.values())
        print(
            f"stage {args.stage}, {world} ranks ({mesh.backend}), {psi:,} parameters, "
            f"{args.steps} steps in {elapsed:.1f}s; rank 0 holds {memory.params:,} B of "
            f"parameters and {memory.opt_state:,} B of optimizer state"
            + (f"; saved {args.out}" if args.out else ""),
            flush=True,
        )
    dist.barrier()  # every rank past its last collective: gloo may abort one that is not
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
