"""transformers' own `save_pretrained` read by `fzero.init.from_file(missing=...)`: the values
`from_pretrained` loads, or an error on every rank, never a pretrained model silently reset
(a second reader found GPT-2's base checkpoint, BERT's MLM one and transformers 5's
renamed architectures all made afresh by `missing=`)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fzero
from tests.e2e.test_hf import _architectures
from tests.faults.harness import outcomes
from tests.support import state_values

pytestmark = pytest.mark.multiprocess


def _cases() -> dict[str, tuple[Any, Any, Any, bool]]:
    """name: (class saved, class loaded, config, whether it must load)."""
    import transformers as t

    archs = _architectures()
    gpt2 = t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=61, n_positions=32)
    bert = t.BertConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=61,
    )  # fmt: skip
    return {
        # A base model's file into a model with a head, and a head's file into a base
        # model: the hub's GPT-2 and BERT checkpoints.
        "gpt2 base into a causal LM": (t.GPT2Model, t.AutoModelForCausalLM, gpt2, True),
        "bert for MLM into a base model": (t.BertForMaskedLM, t.AutoModel, bert, True),
        "qwen2": (*archs["qwen2"][:1], *archs["qwen2"], True),
        # transformers 5 renames these on load (fused experts; ViT's attention).
        "mixtral": (*archs["mixtral"][:1], *archs["mixtral"], False),
        "vit": (*archs["vit"][:1], *archs["vit"], False),
    }


def _read(mesh: fzero.Mesh, directory: str, auto: Any, config: Any) -> Any:
    """The values read, and what from_file warned of."""
    model = fzero.init.deferred(auto.from_config, config, seed=99)  # not the saved seed
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = fzero.shard_state(
            dict(model.named_parameters()), fzero.optim.sgd(0.1), mesh, stage=3,
            units=fzero.units.auto(model), buffers=dict(model.named_buffers()),
            init=fzero.init.from_file(directory, missing=fzero.init.from_module(model)),
        )  # fmt: skip
    return state_values(state, mesh), [
        str(w.message) for w in said if "from_file" in str(w.message)
    ]


@pytest.mark.parametrize("case", list(_cases()))
def test_a_pretrained_directory_loads_as_from_pretrained_or_is_refused(
    tmp_path: Path, case: str
) -> None:
    saved, auto, config, must_load = _cases()[case]
    torch.manual_seed(3)
    (saved.from_config(config) if hasattr(saved, "from_config") else saved(config)).save_pretrained(
        tmp_path
    )
    reference, info = auto.from_pretrained(tmp_path, output_loading_info=True)
    loaded = {
        k: v.detach()
        for k, v in [*reference.named_parameters(), *reference.named_buffers()]
        if k not in set(info["missing_keys"])
    }
    assert len(loaded) > 10
    for o in outcomes(2, _read, str(tmp_path), auto, config):
        if o.error is not None:
            assert not must_load, o.message
            assert o.error is ValueError and "under other names" in o.message, o.message
            continue
        got, said = o.value
        # BERT's pretraining head is left unread beside a pooler made afresh of its
        # shapes: named, as transformers names it.
        assert len(said) == ("bert" in case), said
        assert all("pooler.dense.weight" in w for w in said), said
        wrong = [k for k, v in loaded.items() if k in got and not torch.equal(got[k], v)]
        assert wrong == [], f"{case}: {wrong[:4]} differ from from_pretrained's"
        params = {k for k, _ in reference.named_parameters()} - set(info["missing_keys"])
        assert params <= set(got), f"{case}: {sorted(params - set(got))[:4]}"


def _tensor_names(directory: Path) -> set[str]:
    from safetensors import safe_open

    out: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update(f.keys())
    return out


def _export(mesh: fzero.Mesh, directory: str, auto: Any, config: Any) -> None:
    model = fzero.init.deferred(auto.from_config, config, seed=3)
    state = fzero.shard_state(
        dict(model.named_parameters()), fzero.optim.sgd(0.1), mesh, stage=3,
        buffers=dict(model.named_buffers()), init=fzero.init.from_module(model),
    )  # fmt: skip
    fzero.checkpoint.export_pretrained(state, directory, mesh, module=model, config=config)


@pytest.mark.parametrize("case", ["qwen2", "roberta", "marian"])
def test_export_pretrained_writes_what_save_pretrained_writes(tmp_path: Path, case: str) -> None:
    """The same tensor names (Marian's `_keys_to_ignore_on_save`: its sinusoidal positions
    left out), the model's class under `architectures`, and `generation_config.json`
    for a model that generates; against transformers' own save_pretrained."""
    import json

    import transformers as t

    if case == "marian":
        auto, config = t.AutoModelForSeq2SeqLM, t.MarianConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, vocab_size=61,
            max_position_embeddings=32, pad_token_id=60, decoder_start_token_id=60,
        )  # fmt: skip
    else:
        auto, config = _architectures()[case]
    # Ours first: save_pretrained sets `architectures` on the config it is given.
    run_ok = outcomes(2, _export, str(tmp_path / "ours"), auto, config)
    assert all(o.error is None for o in run_ok), [o.message for o in run_ok]
    torch.manual_seed(3)
    auto.from_config(config).save_pretrained(tmp_path / "theirs")
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    assert _tensor_names(ours) == _tensor_names(theirs)
    read = [json.loads((d / "config.json").read_text()) for d in (theirs, ours)]
    assert read[1]["architectures"] == read[0]["architectures"] == [type(
        auto.from_config(config)).__name__]  # fmt: skip
    assert (ours / "generation_config.json").exists() == (
        theirs / "generation_config.json"
    ).exists()
