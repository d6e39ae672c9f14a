"""Size-based units on torch's own layers (attention, recurrent, normalization, tied
weights), with and without module hooks, against one process running torch.optim."""

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from fzero.testing import assert_stages_equivalent, split_batch


class Seq2Seq(nn.Module):
    """nn.Transformer: self- and cross-attention, each with an `out_proj` child."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(8, 2, 1, 1, 12, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.t(x, x[:, :3]).mean(1))


class Recurrent(nn.Module):
    """LSTM and GRU: their weights are leaves of the recurrent module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.lstm = nn.LSTM(5, 5, num_layers=2, batch_first=True)
        self.gru = nn.GRU(5, 4, batch_first=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gru(self.lstm(self.inp(x))[0])[0]
        return self.out(h[:, -1])


class TiedLM(nn.Module):
    """A head registered with the embedding's weight, and a run of small blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(13, 6)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6)) for _ in range(5))
        )
        self.head = nn.Linear(6, 13, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks(self.tok(x)))).mean(1)[:, :3]


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(64, 3),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator, int], Any]]] = {
    "transformer": (Seq2Seq, lambda g, n: torch.randn(n, 4, 8, generator=g, dtype=torch.float64)),
    "recurrent": (Recurrent, lambda g, n: torch.randn(n, 4, 3, generator=g, dtype=torch.float64)),
    "tied": (TiedLM, lambda g, n: torch.randint(0, 13, (n, 4), generator=g)),
    "conv": (conv_net, lambda g, n: torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64)),
}


@settings(max_examples=24)
@example("transformer", 0.02, 2, True)  # each attention's out_proj a unit of its own
@example("tied", 0.08, 2, True)  # "tok" a unit, the head tied to its weight
@given(
    st.sampled_from(sorted(MODELS)),
    st.sampled_from([0.02, 0.08, 0.2, 0.45]),
    st.integers(2, 3),
    st.booleans(),
)
def test_size_based_units_on_torch_layers_train_like_one_process(
    name: str, fraction: float, world_size: int, hooked: bool
) -> None:
    build, data = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    params = dict(model.named_parameters())
    units = fzero.units.by_size(
        params, max(1, int(fraction * sum(p.numel() for p in params.values())))
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        split_batch(
            (
                data(g, 2 * world_size),
                torch.randn(2 * world_size, 3, generator=g, dtype=torch.float64),
            ),
            world_size,
        )
        for _ in range(3)
    ]

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    assert_stages_equivalent(
        loss_fn,
        params,
        batches,
        (torch.optim.Adam, {"lr": 0.05}),
        units=units,
        module=model if hooked else None,
    )
