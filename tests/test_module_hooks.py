"""Module hooks on torch's own layers: a unit whose submodule's parent reads its parameters."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from fzero._hooks import hookable_units
from fzero._layout import build_layout
from fzero.testing import assert_stages_equivalent, split_batch

# Each attention's output projection its own unit, and one unit of it with the layer's
# first feed-forward Linear: nn.MultiheadAttention passes `out_proj.weight` to
# F.multi_head_attention_forward and never calls `out_proj`, so hooks on `out_proj`
# itself would never fire (the forward then met a placeholder and failed).
UNITS = [
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
    layout = build_layout(dict(model.named_parameters()), 2, units=UNITS)
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


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_transformer_with_attention_projection_units_trains_like_one_process(
    world_size: int,
) -> None:
    model = make_encoder()
    g = torch.Generator().manual_seed(1)
    batches = [
        split_batch(
            (
                torch.randn(2 * world_size, 5, 8, generator=g, dtype=torch.float64),
                torch.randn(2 * world_size, 5, 8, generator=g, dtype=torch.float64),
            ),
            world_size,
        )
        for _ in range(3)
    ]

    def loss_fn(params: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, params, (x,)) - y) ** 2).mean()

    assert_stages_equivalent(
        loss_fn,
        dict(model.named_parameters()),
        batches,
        (torch.optim.Adam, {"lr": 0.05}),
        units=UNITS,
        module=model,
    )


def test_bucket_bytes_on_a_transformer_can_make_the_projection_a_unit() -> None:
    # What made this matter: size-based units split nn.MultiheadAttention as readily as
    # any module (FairScale's auto_wrap, too, unless told to keep it whole).
    model = make_encoder()
    units = fzero.units.by_size(dict(model.named_parameters()), 60)
    assert "layers.0.self_attn.out_proj" in units
