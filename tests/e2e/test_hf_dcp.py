"""A Hugging Face GPT-2 (tied embeddings, Conv1D) trained by FSDP2 and fzero in turn,
through DCP checkpoints with AdamW's state: the tie read from and written under both of
its names, and the training one-process torch.optim's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call
from transformers import AutoModelForCausalLM, GPT2Config

import fzero
from tests.support import run

F64 = torch.float64
HYPER = {"lr": 1e-2, "weight_decay": 0.1}
WORLD, PER_RANK, STEPS = 2, 3, 4
CONFIG = GPT2Config(
    vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)  # fmt: skip


def gpt2(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(CONFIG, dtype=F64)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """In float64 throughout (HF's own loss upcasts to float32, which rounds differently
    for different batch splits)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(61, (STEPS, WORLD * PER_RANK, 7), generator=gen)


@pytest.mark.multiprocess
def test_a_tied_gpt2_moves_between_fsdp2_and_fzero_through_dcp_like_torch(
    tmp_path: Path,
) -> None:
    """FSDP2 trains two steps and saves (weights under both tied names, AdamW's state
    under one); fzero imports at stage 3, steps once and exports; FSDP2 loads it
    strictly and steps once more: four steps of one-process torch.optim.AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    x = data()
    model = gpt2(5)
    assert model.lm_head.weight is model.transformer.wte.weight
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), **HYPER, foreach=False)
    for k in range(STEPS):
        opt.zero_grad()
        next_token_loss(model(input_ids=x[k]).logits, x[k]).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}

    def fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = gpt2(seed)
        dmesh = init_device_mesh("cpu", (WORLD,))
        for block in m.transformer.h:
            fully_shard(block, mesh=dmesh)
        fully_shard(m, mesh=dmesh)
        return m, torch.optim.AdamW(m.parameters(), **HYPER)

    def torch_step(m: Any, o: Any, k: int, rank: int) -> None:
        ids = x[k, rank * PER_RANK : (rank + 1) * PER_RANK]
        o.zero_grad()
        next_token_loss(m(input_ids=ids).logits, ids).backward()
        o.step()

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m, o = fsdp2(5)
        for k in range(2):
            torch_step(m, o, k, mesh.rank)
        sd = m.state_dict()
        assert {"lm_head.weight", "transformer.wte.weight"} <= set(sd)
        dcp.save({**sd, "optim": get_optimizer_state_dict(m, o)}, checkpoint_id=tmp_path / "a")

        plain = gpt2(9)  # other values: the import replaces them
        adamw = fzero.optim.adamw(**HYPER)
        meta = {k: torch.empty_like(v, device="meta") for k, v in plain.named_parameters()}
        state = fzero.checkpoint.import_dcp(
            tmp_path / "a", adamw, mesh, meta, stage=3, units=fzero.units.auto(plain),
            buffers=dict(plain.named_buffers()),
        )  # fmt: skip

        def loss(p: Any, b: Any, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return next_token_loss(functional_call(plain, (p, b), (ids,)).logits, ids), b

        step = fzero.sharded_step(loss, adamw, mesh, stage=3)
        state, _ = step(state, x[2, mesh.rank * PER_RANK : (mesh.rank + 1) * PER_RANK])
        defaults = torch.optim.AdamW([torch.zeros(1)], **HYPER).defaults
        fzero.checkpoint.export_dcp(state, tmp_path / "b", mesh, module=plain,
                                    optimizer_key="optim", hyperparams=defaults)  # fmt: skip

        m2, o2 = fsdp2(11)  # other values and an optimizer state, replaced by the load
        torch_step(m2, o2, 0, mesh.rank)
        sd, osd = m2.state_dict(), get_optimizer_state_dict(m2, o2)
        dcp.load({**sd, "optim": osd}, checkpoint_id=tmp_path / "b")  # strict: every key
        m2.load_state_dict(sd)
        set_optimizer_state_dict(m2, o2, osd)
        torch_step(m2, o2, 3, mesh.rank)
        assert m2.lm_head.weight is m2.transformer.wte.weight
        return {k: v.full_tensor().detach() for k, v in m2.named_parameters()}

    for got in run(WORLD, fn):
        assert set(got) == set(want)
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)
