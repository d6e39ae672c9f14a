"""Hugging Face models built from `transformers` configs (no downloads): Llama (GQA, RoPE,
RMSNorm), GPT-2 (tied embeddings, Conv1D), BERT (encoder, pooler). Deferred init bitwise
the eager construction, training as one-process torch.optim, pretrained files into shards."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
)

import fzero
from tests.support import differences, errors_on_every_rank, run, state_values, torchrun
from tests.support import module_values as values

F64 = torch.float64


def config(name: str) -> tuple[Any, PretrainedConfig, list[str]]:
    """(constructor, config, units: one per layer) of a tiny model, without dropout."""
    if name == "llama":
        cfg = LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        return AutoModelForCausalLM.from_config, cfg, ["model.layers.0", "model.layers.1"]
    if name == "gpt2":
        cfg = GPT2Config(
            vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return AutoModelForCausalLM.from_config, cfg, ["transformer.h.0", "transformer.h.1"]
    cfg = BertConfig(
        vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return AutoModel.from_config, cfg, ["encoder.layer.0", "encoder.layer.1"]


def eager(name: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    make, cfg, _ = config(name)
    torch.manual_seed(seed)
    return make(cfg, dtype=dtype)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_deferred_hf_model_is_bitwise_the_eager_construction(name: str, world: int) -> None:
    make, cfg, units = config(name)
    want = values(eager(name, 11))

    def fn(mesh: fzero.Mesh) -> list[list[str]]:
        model = fzero.init.deferred(make, cfg, seed=11)  # each rank records its own
        out = []
        for stage in range(4):
            state = fzero.shard_state(
                dict(model.named_parameters()), fzero.optim.sgd(), mesh, stage=stage,
                units=units[: stage + world - 1], buffers=dict(model.named_buffers()),
                init=fzero.init.from_module(model),
            )  # fmt: skip
            out.append(differences(state_values(state, mesh), want))
        return out

    for result in run(world, fn):
        assert result == [[]] * 4


def lm_batch(name: str, steps: int, n: int) -> torch.Tensor:
    return torch.randint(61, (steps, n, 7), generator=torch.Generator().manual_seed(1))


def batch_kwargs(name: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": x} if name == "bert" else {"input_ids": x, "labels": x}


def torch_trained(name: str, data: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference: `eager(name, 5)` in float64 trained by torch.optim.AdamW on one
    process, a step per `data[k]` (the whole batch); its parameters before and after."""
    model = eager(name, 5, F64)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for batch in data:
        loss = loss_of(name, model(**batch_kwargs(name, batch)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return start, {k: v.detach() for k, v in model.named_parameters()}


def loss_of(name: str, out: Any) -> torch.Tensor:
    if name == "bert":  # the encoder and its pooler
        return out.pooler_output.square().mean() + out.last_hidden_state.square().mean()
    return out.loss


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "name, compile",
    [("llama", False), ("gpt2", False), ("bert", False), ("llama", "aot_eager"),
     ("gpt2", "aot_eager"), ("bert", "aot_eager")],
)  # fmt: skip
def test_training_a_deferred_hf_model_matches_torch_optim(name: str, compile: Any) -> None:
    """A deferred Hugging Face model at stage 3, its blocks entered by module= hooks
    (compiled: the hooks traced, each block gathered in the graph where it runs), equal
    to torch.optim.AdamW on one process (float64), every leaf moved."""
    world, per_rank, steps = 2, 2, 3
    make, cfg, _ = config(name)
    data = lm_batch(name, steps, world * per_rank)
    start, want = torch_trained(name, data)

    def fn(mesh: fzero.Mesh) -> Any:
        m = fzero.init.deferred(make, cfg, dtype=F64, seed=5)
        adamw = fzero.optim.adamw(1e-2, weight_decay=0.1)
        units = fzero.units.auto(m)
        state = fzero.shard_state(
            dict(m.named_parameters()), adamw, mesh, stage=3, units=units,
            buffers=dict(m.named_buffers()), init=fzero.init.from_module(m),
        )  # fmt: skip
        mine = data[:, mesh.rank * per_rank : (mesh.rank + 1) * per_rank]

        def loss_fn(params: Any, bufs: Any, batch: torch.Tensor) -> Any:
            out = functional_call(m, (params, bufs), (), batch_kwargs(name, batch))
            return loss_of(name, out), bufs

        step = fzero.sharded_step(loss_fn, adamw, mesh, stage=3, module=m, compile=compile)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for k in range(steps):
                state, _ = step(state, mine[k])
        said = [str(w.message) for w in seen if "fzero" in str(w.message)]
        if compile:  # the blocks entered by their traced hooks, not before the loss
            import gc

            from fzero._step._compiled import CompiledLoss

            (loss,) = [o for o in gc.get_objects() if type(o) is CompiledLoss]
            assert loss.hooks is not None and set(loss.hooks.hooked) == set(units), units
        params = fzero.gather_params(state.params, mesh)
        return {k: v.detach().clone() for k, v in params.items()}, said

    for got, said in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)  # every leaf moved
        # GPT-2's loss logs once through transformers' `warning_once`, which dynamo does
        # not trace: its graph compiles in pieces, said once; the others' whole.
        breaks = compile and name == "gpt2"
        assert [("breaks torch.compile's graph" in w) for w in said] == [True] * breaks


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("module", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_gradient_checkpointing_recomputes_with_the_steps_parameters(
    stage: int, module: bool, reentrant: bool
) -> None:
    """`activation_checkpointing_enable()` (once `gradient_checkpointing_enable`) on a
    deferred Llama, module= hooks: each layer's own checkpoint runs its recompute inside
    the backward, after functional_call has put the module's parameters back (meta
    here; stale on an eager model, silently wrong before). The step rebinds the
    forward's parameters for it: torch.optim.AdamW's training on one process (float64),
    every leaf moved. Without module= too: torch's checkpoint is handed the layer's own
    call, whose module the step binds for the recompute. Reentrant too (transformers
    4.x's default), which torch refuses under the step's gradient: inside the step it
    runs as the non-reentrant checkpoint."""
    world, per_rank, steps = 2, 2, 3
    make, cfg, _ = config("llama")
    data = lm_batch("llama", steps, world * per_rank)
    start, want = torch_trained("llama", data)

    def fn(mesh: fzero.Mesh) -> Any:
        m = fzero.init.deferred(make, cfg, dtype=F64, seed=5)
        m.activation_checkpointing_enable({"use_reentrant": reentrant})
        m.train()
        adamw = fzero.optim.adamw(1e-2, weight_decay=0.1)
        state = fzero.shard_state(
            dict(m.named_parameters()), adamw, mesh, stage=stage, units=fzero.units.auto(m),
            buffers=dict(m.named_buffers()), init=fzero.init.from_module(m),
        )  # fmt: skip
        mine = data[:, mesh.rank * per_rank : (mesh.rank + 1) * per_rank]

        def loss_fn(params: Any, bufs: Any, batch: torch.Tensor) -> Any:
            kw = {"input_ids": batch, "labels": batch}
            return functional_call(m, (params, bufs), (), kw).loss, bufs

        step = fzero.sharded_step(loss_fn, adamw, mesh, stage=stage, module=m if module else None)
        with warnings.catch_warnings():  # transformers turns its KV cache off, and says so
            warnings.simplefilter("ignore")
            for k in range(steps):
                state, _ = step(state, mine[k])
        assert all(layer.gradient_checkpointing for layer in m.model.layers)
        return {k: v.detach().clone() for k, v in fzero.gather_params(state.params, mesh).items()}

    for got in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_a_multi_file_pretrained_checkpoint_loads_into_shards(name: str, tmp_path: Path) -> None:
    model = eager(name, 3)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    want = values(model)
    make, cfg, units = config(name)

    def fn(mesh: fzero.Mesh) -> list[str]:
        m = fzero.init.deferred(make, cfg)  # the seed does not matter: the buffers are made
        state = fzero.shard_state(
            dict(m.named_parameters()), fzero.optim.sgd(), mesh, stage=3, units=units,
            buffers=dict(m.named_buffers()),
            init=fzero.init.from_file(tmp_path, missing=fzero.init.from_module(m)),
        )  # fmt: skip
        return differences(state_values(state, mesh), want)

    assert run(2, fn) == [[], []]


def test_a_pretrained_checkpoint_without_missing_names_the_buffer(tmp_path: Path) -> None:
    eager("llama", 3).save_pretrained(tmp_path)
    make, cfg, _ = config("llama")

    def fn(mesh: fzero.Mesh) -> None:
        m = fzero.init.deferred(make, cfg)
        fzero.shard_state(
            dict(m.named_parameters()), fzero.optim.sgd(), mesh, stage=3,
            buffers=dict(m.named_buffers()), init=fzero.init.from_file(tmp_path),
        )  # fmt: skip

    for msg in errors_on_every_rank(2, fn):
        assert "model.rotary_emb.inv_freq" in msg and "missing=" in msg


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_export_pretrained_loads_strictly_with_from_pretrained(name: str, tmp_path: Path) -> None:
    make, cfg, units = config(name)
    data = lm_batch(name, 1, 4)[0]

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m = fzero.init.deferred(make, cfg, seed=2)
        adamw = fzero.optim.adamw(1e-2)
        state = fzero.shard_state(
            dict(m.named_parameters()), adamw, mesh, stage=3, units=units,
            buffers=dict(m.named_buffers()), init=fzero.init.from_module(m),
        )  # fmt: skip

        def loss_fn(params: Any, bufs: Any, batch: torch.Tensor) -> Any:
            out = functional_call(m, (params, bufs), (), batch_kwargs(name, batch))
            return loss_of(name, out), bufs

        step = fzero.sharded_step(loss_fn, adamw, mesh, stage=3, module=m)
        state, _ = step(state, data[2 * mesh.rank : 2 * mesh.rank + 2])  # trained a step
        fzero.checkpoint.export_pretrained(
            state, tmp_path, mesh, module=m, config=cfg, max_shard_size="20KB"
        )
        return state_values(state, mesh)

    trained = run(2, fn)[0]
    assert (tmp_path / "model.safetensors.index.json").exists() and (
        tmp_path / "config.json"
    ).exists()
    auto = AutoModel if name == "bert" else AutoModelForCausalLM
    loaded, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert differences(values(loaded), trained) == []
    if name == "gpt2":  # the tie survived: one tensor under both names
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    reference = eager(name, 0)
    reference.load_state_dict({k: v for k, v in trained.items()}, strict=False)
    with torch.no_grad():
        assert torch.equal(loaded(data)[0], reference(data)[0])  # logits, or hidden states
    back = run(
        2,
        lambda mesh: state_values(
            fzero.shard_state(  # and into shards again
                {k: v for k, v in trained.items() if k in dict(reference.named_parameters())},
                fzero.optim.sgd(),
                mesh,
                stage=3,
                init=fzero.init.from_file(tmp_path),
            ),
            mesh,
        ),
    )
    assert all(differences(b, {k: trained[k] for k in b}) == [] for b in back)


@pytest.mark.parametrize(
    ("name", "blocks"),
    [
        ("llama", ["model.layers.0", "model.layers.1"]),
        ("gpt2", ["transformer.h.0", "transformer.h.1"]),
        ("bert", None),  # BERT declares its embeddings as a block too
    ],
)
def test_units_auto_finds_hf_blocks(name: str, blocks: list[str] | None) -> None:
    make, cfg, _ = config(name)
    model = fzero.init.deferred(make, cfg)
    units = fzero.units.auto(model)
    if blocks is None:
        declared = set(model._no_split_modules)
        blocks = [n for n, m in model.named_modules() if n and type(m).__name__ in declared]
        assert "encoder.layer.0" in blocks
    assert units == blocks


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [3, 1])
def test_bind_generates_as_hf_with_ranks_stopping_at_different_lengths(stage: int) -> None:
    make, cfg, _ = config("llama")
    reference = eager("llama", 9)
    prompts = torch.tensor([[3, 14, 15, 9], [26, 5, 35, 8]])
    free = reference.generate(prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
    # An end token that rank 0's prompt reaches before rank 1's, if at all.
    eos = next(
        int(t)
        for t in free[0, 5:]
        if int(t) not in free[1, 4 : 4 + (free[0, 4:] == t).nonzero()[0, 0] + 2].tolist()
    )
    want = [
        reference.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=eos,
                           pad_token_id=0)[0]
        for p in prompts
    ]  # fmt: skip
    assert len(want[0]) < len(want[1])  # rank 0 stops first, and keeps rank 1 company

    def fn(mesh: fzero.Mesh) -> torch.Tensor:
        m = fzero.init.deferred(make, cfg, seed=9)
        state = fzero.shard_state(
            dict(m.named_parameters()), fzero.optim.sgd(), mesh, stage=stage,
            units=fzero.units.auto(m), buffers=dict(m.named_buffers()),
            init=fzero.init.from_module(m),
        )  # fmt: skip
        with fzero.bind(m, state, mesh):
            out = m.generate(
                prompts[mesh.rank][None], max_new_tokens=8, do_sample=False,
                eos_token_id=eos, pad_token_id=0, synced_gpus=True,
            )[0]  # fmt: skip
        assert all(p.device.type == "meta" for p in m.parameters())  # unbound again
        return out

    got = run(2, fn)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def fsdp2_llama(seed: int) -> torch.nn.Module:
    """The tiny Llama built eagerly on every rank and sharded by FSDP2 (per layer, root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = eager("llama", seed)
    dmesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    return model


@pytest.mark.multiprocess
def test_fsdp2_checkpoints_load_into_fzero_and_fzero_checkpoints_into_fsdp2(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    make, cfg, _ = config("llama")
    theirs, ours = tmp_path / "fsdp2", tmp_path / "fzero"

    def fn(mesh: fzero.Mesh) -> tuple[list[str], list[str]]:
        model = fsdp2_llama(7)  # FSDP2's save: DTensor shards, one file per rank
        dcp.save(model.state_dict(), checkpoint_id=theirs)
        m = fzero.init.deferred(make, cfg, seed=1)
        state = fzero.shard_state(
            dict(m.named_parameters()), fzero.optim.sgd(), mesh, stage=3,
            units=fzero.units.auto(m), buffers=dict(m.named_buffers()),
            init=fzero.init.from_file(theirs, missing=fzero.init.from_module(m)),
        )  # fmt: skip
        loaded = differences(state_values(state, mesh), values(eager("llama", 7)))
        fzero.checkpoint.export_dcp(state, ours, mesh, module=m)
        back = fsdp2_llama(2)  # other values, replaced by the load (strict: every key)
        sd = back.state_dict()
        dcp.load(sd, checkpoint_id=ours)
        back.load_state_dict(sd)
        full = {k: v.full_tensor() for k, v in back.state_dict().items()}
        full.update(dict(back.named_buffers()))
        return loaded, differences(full, values(eager("llama", 7)))

    for loaded, exported in run(2, fn):
        assert loaded == [] and exported == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_fine_tuning_example_learns_exports_and_reloads(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "hf_finetune.py"
    pretrained, out = tmp_path / "pretrained", tmp_path / "tuned"
    made = subprocess.run(
        [sys.executable, str(script), f"--make-pretrained={pretrained}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    assert (pretrained / "model.safetensors.index.json").exists()  # several files
    job = torchrun(script, f"--pretrained={pretrained}", f"--out={out}")
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    losses = re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", job.stdout)
    assert losses and float(losses.group(2)) < 0.8 * float(losses.group(1)), job.stdout
    assert "logits identical" in job.stdout, job.stdout
    # The same job with FSDP2 (the docs compare their lengths) learns the same.
    fsdp2_script = script.with_name("hf_finetune_fsdp2.py")
    theirs = torchrun(fsdp2_script, f"--pretrained={pretrained}", f"--out={tmp_path / 'fsdp2'}")
    assert theirs.returncode == 0, theirs.stdout[-2000:] + theirs.stderr[-3000:]
    fsdp2 = re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", theirs.stdout)
    assert fsdp2 and abs(float(fsdp2.group(2)) - float(losses.group(2))) < 1e-3, theirs.stdout
    assert "logits identical" in theirs.stdout, theirs.stdout


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, dtype=F64), torch.nn.Tanh(), torch.nn.Linear(8, 3, dtype=F64)
    )


@pytest.mark.multiprocess
def test_training_moves_between_fsdp2_and_fzero_through_dcp_with_adam_state(
    tmp_path: Path,
) -> None:
    """FSDP2 trains two steps and saves (weights and AdamW state); fzero resumes for one
    and saves; FSDP2 resumes for one more: four steps of one-process torch.optim."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    world, per_rank, steps = 2, 3, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(steps, world * per_rank, 4, generator=gen, dtype=F64)
    y = torch.randn(steps, world * per_rank, 3, generator=gen, dtype=F64)
    hyper = {"lr": 0.05, "weight_decay": 0.1}
    torch.manual_seed(4)
    model = _mlp()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), **hyper)
    for k in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[k]), y[k]).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}

    def fsdp2(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(seed)
        m = _mlp()
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
        return m, torch.optim.AdamW(m.parameters(), **hyper)

    def torch_step(m: Any, o: Any, k: int, rank: int) -> None:
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x[k, lo:hi]), y[k, lo:hi]).backward()
        o.step()

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m, o = fsdp2(4)
        for k in range(2):
            torch_step(m, o, k, mesh.rank)
        dcp.save(
            {**m.state_dict(), "optim": get_optimizer_state_dict(m, o)},
            checkpoint_id=tmp_path / "a",
        )
        adamw = fzero.optim.adamw(**hyper)
        meta = {k: torch.empty_like(v, device="meta") for k, v in start.items()}
        state = fzero.checkpoint.import_dcp(tmp_path / "a", adamw, mesh, meta, stage=3)
        plain = _mlp()  # not FSDP2's module, whose hooks would put back its own weights
        step = fzero.sharded_step(
            lambda p, b: torch.nn.functional.mse_loss(functional_call(plain, p, (b[0],)), b[1]),
            adamw, mesh, stage=3,
        )  # fmt: skip
        lo, hi = mesh.rank * per_rank, (mesh.rank + 1) * per_rank
        state, _ = step(state, (x[2, lo:hi], y[2, lo:hi]))
        defaults = torch.optim.AdamW([torch.zeros(1)], **hyper).defaults
        fzero.checkpoint.export_dcp(
            state, tmp_path / "b", mesh, optimizer_key="optim", hyperparams=defaults
        )
        m2, o2 = fsdp2(9)  # other values, replaced by the load
        torch_step(m2, o2, 0, mesh.rank)  # and an optimizer state to replace
        sd, osd = m2.state_dict(), get_optimizer_state_dict(m2, o2)
        dcp.load({**sd, "optim": osd}, checkpoint_id=tmp_path / "b")
        m2.load_state_dict(sd)
        set_optimizer_state_dict(m2, o2, osd)
        torch_step(m2, o2, 3, mesh.rank)
        return {k: v.full_tensor().detach() for k, v in m2.named_parameters()}

    for got in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


def _architectures() -> dict[str, tuple[Any, Any]]:
    """Tiny configs of other architectures: decoders with GQA and MoE, encoders,
    encoder-decoders, vision and speech, two towers, shared layers and a state space
    model."""
    import transformers as t

    base = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    base["vocab_size"] = 61
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)
    return {
        "qwen2": (t.AutoModelForCausalLM, t.Qwen2Config(num_key_value_heads=2, **base)),
        "mistral": (t.AutoModelForCausalLM, t.MistralConfig(num_key_value_heads=2, **base)),
        "gemma": (t.AutoModelForCausalLM, t.GemmaConfig(num_key_value_heads=2, head_dim=8, **base)),
        "mixtral": (t.AutoModelForCausalLM, t.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **base)),
        "phi": (t.AutoModelForCausalLM, t.PhiConfig(**base)),
        "gpt_neox": (t.AutoModelForCausalLM, t.GPTNeoXConfig(**base)),
        "opt": (t.AutoModelForCausalLM, t.OPTConfig(
            hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=61, word_embed_proj_dim=32)),
        "bloom": (t.AutoModelForCausalLM, t.BloomConfig(
            hidden_size=32, n_layer=2, n_head=4, vocab_size=61)),
        "roberta": (t.AutoModel, t.RobertaConfig(**base)),
        "t5": (t.AutoModelForSeq2SeqLM, t.T5Config(
            d_model=32, d_ff=48, num_layers=2, num_heads=4, d_kv=8, vocab_size=61)),
        "vit": (t.AutoModel, t.ViTConfig(image_size=16, patch_size=4, **vision)),
        "whisper": (t.AutoModel, t.WhisperConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=61,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            num_mel_bins=8, max_source_positions=16, max_target_positions=16)),
        "clip": (t.AutoModel, t.CLIPConfig(
            text_config=dict(vocab_size=61, **vision),
            vision_config=dict(image_size=16, patch_size=4, **vision))),
        # One layer applied num_hidden_layers times; relative attention; a state space
        # model; windowed vision attention; a BART encoder-decoder; Falcon's fused QKV.
        "albert": (t.AutoModel, t.AlbertConfig(embedding_size=16, **base)),
        "deberta_v2": (t.AutoModel, t.DebertaV2Config(
            relative_attention=True, position_buckets=8, max_relative_positions=16,
            pos_att_type=["p2c", "c2p"], **base)),
        "mamba": (t.AutoModelForCausalLM, t.MambaConfig(
            hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=61, expand=2,
            conv_kernel=2)),
        "swin": (t.AutoModel, t.SwinConfig(
            image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2],
            window_size=2)),
        "bart": (t.AutoModelForSeq2SeqLM, t.BartConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
            vocab_size=61, max_position_embeddings=32)),
        "falcon": (t.AutoModelForCausalLM, t.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=61)),
    }  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", sorted(_architectures()))
def test_deferred_is_bitwise_eager_across_architectures(arch: str) -> None:
    auto, cfg = _architectures()[arch]
    torch.manual_seed(5)
    want = values(auto.from_config(cfg))

    def fn(mesh: fzero.Mesh) -> list[str]:
        model = fzero.init.deferred(auto.from_config, cfg, seed=5)
        state = fzero.shard_state(
            dict(model.named_parameters()), fzero.optim.sgd(), mesh, stage=0,
            buffers=dict(model.named_buffers()), init=fzero.init.from_module(model),
        )  # fmt: skip
        return differences(state_values(state, mesh), want)

    assert run(1, fn) == [[]]


@pytest.mark.multiprocess
def test_a_dcp_checkpoint_sharded_any_way_reads_into_shards_by_range(tmp_path: Path) -> None:
    """DTensors saved by rows, by columns and replicated, read by ranks whose ranges
    start and end inside rows (three ranks, odd shapes)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    full = {"a": torch.randn(7, 5, 3), "b": torch.randn(11), "c": torch.randn(4, 9)}

    def save(mesh: fzero.Mesh) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        dmesh = init_device_mesh("cpu", (mesh.size,))
        placements = {"a": Shard(0), "b": Replicate(), "c": Shard(1)}
        sd = {k: distribute_tensor(v, dmesh, [placements[k]]) for k, v in full.items()}
        dcp.save(sd, checkpoint_id=tmp_path / "ckpt")

    run(2, save)

    def load(mesh: fzero.Mesh) -> list[str]:
        like = {k: torch.empty_like(v, device="meta") for k, v in full.items()}
        state = fzero.shard_state(like, fzero.optim.sgd(), mesh, stage=3,
                                  init=fzero.init.from_file(tmp_path / "ckpt"))  # fmt: skip
        return differences(state_values(state, mesh), full)

    assert run(3, load) == [[], [], []]


@pytest.mark.multiprocess
def test_layer_wise_rates_on_bert_train_as_torchs_param_groups() -> None:
    """A fine-tuning recipe: the rate decays from the top layer down and biases and norms
    do not decay (`optim.param_groups` and `mask=`), BERT at stage 3 with module hooks,
    against torch.optim.AdamW with the same groups on one process."""

    def rate(path: str) -> float:
        top = {"encoder.layer.1.": 1e-2, "encoder.layer.0.": 5e-3}
        return next((lr for prefix, lr in top.items() if path.startswith(prefix)), 2.5e-3)

    def decays(path: str) -> bool:
        return not (path.endswith("bias") or "LayerNorm" in path)

    data = lm_batch("bert", 3, 4)
    model = eager("bert", 5, F64)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    groups: dict[tuple[float, float], list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        groups.setdefault((rate(name), 0.1 if decays(name) else 0.0), []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()],
        foreach=False,
    )
    for batch in data:
        opt.zero_grad()
        loss_of("bert", model(input_ids=batch)).backward()
        opt.step()
    want = {k: v.detach() for k, v in model.named_parameters()}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m = eager("bert", 5, F64)
        adamw = fzero.optim.param_groups(
            fzero.optim.adamw,
            [{"params": lambda p, lr=lr: rate(p) == lr, "lr": lr} for lr in (1e-2, 5e-3, 2.5e-3)],
            weight_decay=0.1, mask=decays,
        )  # fmt: skip
        state = fzero.shard_state(
            dict(m.named_parameters()), adamw, mesh, stage=3, units=fzero.units.auto(m),
            buffers=dict(m.named_buffers()),
        )  # fmt: skip

        def loss(p: Any, b: Any, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
            return loss_of("bert", functional_call(m, (p, b), (), {"input_ids": ids})), b

        step = fzero.sharded_step(loss, adamw, mesh, stage=3, module=m)
        for batch in data:
            state, _ = step(state, batch[mesh.rank * 2 : (mesh.rank + 1) * 2])
        return {k: v.detach().clone() for k, v in fzero.gather_params(state.params, mesh).items()}

    for got in run(2, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)
