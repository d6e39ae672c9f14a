"""Hugging Face architectures beyond Llama, GPT-2 and BERT, trained at stage 3 with their
blocks entered by module hooks (`units.auto`), against torch.optim on one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.func import functional_call

import fzero
from tests.e2e.test_hf import _architectures
from tests.support import run

F64 = torch.float64
ENCODERS = ("roberta", "albert", "deberta_v2")  # no loss of their own: the hidden states'


def _undropped(cfg: Any) -> Any:
    """`cfg` without dropout, layer drop or stochastic depth: both sides draw no numbers."""
    cfg = copy.deepcopy(cfg)
    todo = [cfg]
    while todo:
        c = todo.pop()
        for k, v in list(vars(c).items()):
            if isinstance(v, float) and any(w in k for w in ("dropout", "pdrop", "drop_path")):
                setattr(c, k, 0.0)
            if k.endswith("layerdrop") and isinstance(v, float):
                setattr(c, k, 0.0)
            if hasattr(v, "to_dict") and hasattr(v, "model_type"):  # a nested config
                todo.append(v)
    if getattr(cfg, "model_type", "") == "t5":
        cfg.decoder_start_token_id, cfg.pad_token_id = 0, 0
    if getattr(cfg, "model_type", "") == "mixtral":
        cfg._experts_implementation = "eager"
    return cfg


def _batches(arch: str, n: int, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    pixels = lambda: torch.randn(2, 3, 16, 16, generator=g, dtype=F64)  # noqa: E731
    ids = lambda k=7: torch.randint(3, 61, (2, k), generator=g)  # noqa: E731
    if arch in ("vit", "swin"):
        return [{"pixel_values": pixels()} for _ in range(n)]
    if arch == "whisper":
        mel = lambda: torch.randn(2, 8, 32, generator=g, dtype=F64)  # noqa: E731
        return [{"input_features": mel(), "decoder_input_ids": ids(5)} for _ in range(n)]
    if arch == "clip":
        return [
            {"input_ids": ids(6), "pixel_values": pixels(), "return_loss": True} for _ in range(n)
        ]
    if arch in ENCODERS:
        return [{"input_ids": ids()} for _ in range(n)]
    return [{"input_ids": x, "labels": x} for x in (ids() for _ in range(n))]


def _loss(out: Any) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    pooled = getattr(out, "pooler_output", None)
    extra = 0 if pooled is None else pooled.square().mean()
    return out.last_hidden_state.square().mean() + extra


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", sorted(_architectures()))
def test_an_architecture_trains_at_stage_3_like_torch_optim(arch: str) -> None:
    """Deferred, each block a unit entered where it runs; two AdamW steps over two ranks'
    micro-batches equal one process's over all four (float64, 1e-9), every leaf that
    torch moved moved. ALBERT's one layer runs num_hidden_layers times a forward, as a
    unit entered again each time."""
    world, steps = 2, 2
    auto, cfg = _architectures()[arch]
    cfg = _undropped(cfg)
    units_of = lambda m: (  # noqa: E731
        ["encoder.albert_layer_groups.0"] if arch == "albert" else fzero.units.auto(m)
    )
    data = [[_batches(arch, 1, 10 * t + r)[0] for r in range(world)] for t in range(steps)]
    torch.manual_seed(5)
    model = auto.from_config(cfg, dtype=F64)
    model.train()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for per_rank in data:
        opt.zero_grad()
        for mb in per_rank:  # the mean over the ranks' micro-batches, as the step takes
            (_loss(model(**mb)) / world).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m = fzero.init.deferred(auto.from_config, cfg, dtype=F64, seed=5)
        m.train()
        adamw = fzero.optim.adamw(1e-2, weight_decay=0.1)
        bufs = dict(m.named_buffers())
        state = fzero.shard_state(
            dict(m.named_parameters()), adamw, mesh, stage=3, units=units_of(m),
            buffers=bufs, init=fzero.init.from_module(m),
        )  # fmt: skip

        def loss_fn(params: Any, b: Any, batch: dict[str, Any]) -> Any:
            return _loss(functional_call(m, (params, b), (), batch)), b

        step = fzero.sharded_step(loss_fn, adamw, mesh, stage=3, module=m)
        for per_rank in data:
            state, _ = step(state, per_rank[mesh.rank])
        return {k: v.clone() for k, v in fzero.gather_params(state.params, mesh).items()}

    for got in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-9, atol=1e-11, what=arch)
        moved = [k for k in want if not torch.equal(start[k], want[k])]
        assert len(moved) > len(want) // 2, moved
        assert all(not torch.equal(got[k], start[k]) for k in moved)
