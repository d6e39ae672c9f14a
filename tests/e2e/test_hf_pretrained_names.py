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

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


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
