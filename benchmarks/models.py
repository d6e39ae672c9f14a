"""The benchmark models, their data and losses: a GPT-like decoder, a Linear stack, and a
deep stack of small residual blocks (hundreds of small leaves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fzero._tools._demo import Block, TinyGPT

Batch = tuple[torch.Tensor, torch.Tensor]


class LinearStack(nn.Module):
    """PyTorch's ZeroRedundancyOptimizer recipe model: square Linear layers with ReLU."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class NormBlock(nn.Module):
    """A small residual block, x + tanh(W LayerNorm(x) + b): four leaves, three of them
    vectors, as a deep narrow model's norms and biases are."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


@dataclass(frozen=True)
class Spec:
    """One benchmark model: how to build it, its units, its data and its loss."""

    name: str
    title: str
    build: Callable[[], nn.Module]
    block: type[nn.Module]  # the per-unit class (fully_shard target, fzero.units.by_module)
    extra_units: tuple[str, ...]  # further submodules that fzero gathers as units
    make_batch: Callable[[int, int], Batch]  # (step, global batch size) -> (inputs, targets)
    micro_batch: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets)
    per_unit: int = 1  # blocks per unit: fzero's `units.grouped`, FSDP2's fully_shard([...])

    def block_groups(self, model: nn.Module) -> list[list[str]]:
        """The names of `model`'s blocks, `per_unit` consecutive ones at a time."""
        names = [n for n, m in model.named_modules() if n and isinstance(m, self.block)]
        return [names[i : i + self.per_unit] for i in range(0, len(names), self.per_unit)]


def _gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _token_batches(vocab: int, seq: int) -> Callable[[int, int], Batch]:
    def make(step: int, batch: int) -> Batch:
        # Seeded by step, so every configuration and the reference see the same tokens.
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def _dense_batches(width: int) -> Callable[[int, int], Batch]:
    def make(step: int, batch: int) -> Batch:
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    return make


def spec(name: str, quick: bool, per_unit: int = 1) -> Spec:
    """The model called `name` ("gpt", "linear" or "deep"), tiny when `quick`, with
    `per_unit` blocks to a unit."""
    return dataclasses.replace(_spec(name, quick), per_unit=per_unit)


def _spec(name: str, quick: bool) -> Spec:
    if name == "gpt":
        # Full: 8 blocks of width 224, vocab 1024 -> 5.33M parameters (issue 3's size).
        d, layers, heads, vocab, seq, micro = (
            (32, 8, 2, 64, 16, 2) if quick else (224, 8, 4, 1024, 64, 4)
        )

        def build() -> nn.Module:
            return TinyGPT(vocab=vocab, block=seq, d=d, layers=layers, heads=heads)

        return Spec(
            "gpt",
            f"GPT decoder ({layers} blocks, d={d}, vocab {vocab}, seq {seq}, micro-batch {micro})",
            build,
            Block,
            ("tok", "pos", "head"),
            _token_batches(vocab, seq),
            micro,
            _gpt_loss,
        )
    if name == "linear":
        # Full: 20 x Linear(1000, 1000) -> 20.02M parameters (the recipe's 2000 scaled down).
        width, depth, micro = (64, 4, 4) if quick else (1000, 20, 20)

        def build_stack() -> nn.Module:
            return LinearStack(width, depth)

        return Spec(
            "linear",
            f"Linear stack ({depth} x Linear({width}, {width}) + ReLU, micro-batch {micro})",
            build_stack,
            nn.Linear,
            (),
            _dense_batches(width),
            micro,
            F.mse_loss,
        )
    if name == "deep":
        # Full: 100 blocks of width 64 -> 426,400 parameters in 400 leaves, where the cost
        # of a step is per leaf and per unit rather than per byte.
        width, depth, micro = (16, 6, 4) if quick else (64, 100, 16)

        def build_deep() -> nn.Module:
            return nn.Sequential(*(NormBlock(width) for _ in range(depth)))

        return Spec(
            "deep",
            f"deep stack ({depth} x [LayerNorm({width}) + Linear({width}, "
            f"{width}) + tanh, residual], micro-batch {micro})",
            build_deep,
            NormBlock,
            (),
            _dense_batches(width),
            micro,
            F.mse_loss,
        )
    raise ValueError(f"unknown model {name!r}: choose gpt, linear or deep")


def build_model(s: Spec) -> nn.Module:
    """The model with the benchmark's fixed initialisation (same on every rank and config)."""
    torch.manual_seed(0)
    return s.build()


def rank_batch(s: Spec, step: int, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s micro-batch of step `step`: its slice of the global batch."""
    x, y = s.make_batch(step, s.micro_batch * world_size)
    sl = slice(rank * s.micro_batch, (rank + 1) * s.micro_batch)
    return x[sl], y[sl]
