"""Units on torch's own layers (attention, recurrent, normalization, tied weights,
parametrizations), size-based or chosen, with and without module hooks, against one
process running torch.optim."""

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from fzero._core._layout import build_layout
from fzero._engine._hooks import hookable_units
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


def weight_normed() -> nn.Module:
    """Weights as parametrizations (`original0`, `original1` under a ParametrizationList,
    which runs each time the layer reads its weight)."""
    wn = nn.utils.parametrizations.weight_norm
    return nn.Sequential(wn(nn.Linear(4, 6)), nn.Tanh(), wn(nn.Linear(6, 6)), nn.Linear(6, 3))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator, int], Any]]] = {
    "transformer": (Seq2Seq, lambda g, n: torch.randn(n, 4, 8, generator=g, dtype=torch.float64)),
    "recurrent": (Recurrent, lambda g, n: torch.randn(n, 4, 3, generator=g, dtype=torch.float64)),
    "tied": (TiedLM, lambda g, n: torch.randint(0, 13, (n, 4), generator=g)),
    "conv": (conv_net, lambda g, n: torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64)),
    "weight_norm": (
        weight_normed,
        lambda g, n: torch.randn(n, 4, generator=g, dtype=torch.float64),
    ),
}


@pytest.mark.slow
@pytest.mark.multiprocess
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
    check(model, data, units, world_size, model if hooked else None)


def check(
    model: nn.Module,
    data: Callable[[torch.Generator, int], Any],
    units: list[Any],
    world_size: int,
    module: nn.Module | None,
) -> None:
    """Every stage trains `model` on 3 steps of drawn data like one process with Adam."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        x = data(g, 2 * world_size)
        y = torch.randn(2 * world_size, *model(x[:1]).shape[1:], generator=g, dtype=torch.float64)
        batches.append(split_batch((x, y), world_size))

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    params = dict(model.named_parameters())
    assert_stages_equivalent(
        loss_fn, params, batches, (torch.optim.Adam, {"lr": 0.05}), units=units, module=module
    )


# Each attention's output projection its own unit, and one unit of it with the layer's
# first feed-forward Linear: nn.MultiheadAttention passes `out_proj.weight` to
# F.multi_head_attention_forward and never calls `out_proj`, so hooks on `out_proj`
# itself would never fire (the forward then met a placeholder and failed).
ATTENTION_UNITS = [
    "layers.0.self_attn.out_proj",
    ("layers.1.self_attn.out_proj", "layers.1.linear1"),
    "layers.1.self_attn",
    "layers.0",
]


def make_encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()


def test_an_attention_output_projection_unit_is_entered_by_its_attention() -> None:
    model = make_encoder()
    layout = build_layout(dict(model.named_parameters()), 2, units=ATTENTION_UNITS)
    hooked = hookable_units(layout, model)
    attn = [model.layers[i].self_attn for i in (0, 1)]
    assert hooked["layers.0.self_attn.out_proj"][0][0] is attn[0]
    group = hooked["layers.1.self_attn.out_proj+layers.1.linear1"]
    assert [m for m, _ in group] == [attn[1], model.layers[1].linear1]
    # The slots still name the projection's own parameters.
    assert [(p, o) for p, o, _ in group[0][1]] == [
        ("layers.1.self_attn.out_proj.bias", attn[1].out_proj),
        ("layers.1.self_attn.out_proj.weight", attn[1].out_proj),
    ]
    assert hooked["layers.1.self_attn"][0][0] is attn[1]
    # Size-based units split an attention as readily as any module.
    assert "layers.0.self_attn.out_proj" in fzero.units.by_size(dict(model.named_parameters()), 60)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_attention_projection_units_train_like_one_process(world_size: int) -> None:
    def data(g: torch.Generator, n: int) -> torch.Tensor:
        return torch.randn(n, 5, 8, generator=g, dtype=torch.float64)

    model = make_encoder()
    check(model, data, ATTENTION_UNITS, world_size, model)


def hook_normed() -> nn.Module:
    """The old `torch.nn.utils.weight_norm`: a forward pre-hook of the layer computes its
    `weight` from the parameters `weight_g` and `weight_v` (audio models still use it)."""
    with warnings.catch_warnings():  # deprecated in favour of the parametrization
        warnings.simplefilter("ignore", FutureWarning)
        wn = nn.utils.weight_norm
        return nn.Sequential(wn(nn.Linear(4, 6)), nn.Tanh(), wn(nn.Linear(6, 3)))


@pytest.mark.multiprocess
def test_a_layers_own_pre_hook_sees_its_units_parameters() -> None:
    # fzero's pre-hook is the first of the layer's: registered after weight_norm's, it
    # ran second, and weight_norm's hook met placeholders (refused, naming the leaf).
    model = hook_normed().double()
    units = ["0", "2"]
    layout = build_layout(dict(model.named_parameters()), 2, units=units)
    assert set(hookable_units(layout, model)) == {"0", "2"}
    data = MODELS["weight_norm"][1]
    check(model, data, units, 2, model)
