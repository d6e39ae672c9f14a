"""`fzero.init.from_file` on files whose names are not the model's: a base model's prefix
lined up as Hugging Face does, layers' weights under other names refused, not made afresh."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fzero
from tests.faults.harness import outcomes, raised_together
from tests.state.test_sharded_files import Net

pytestmark = pytest.mark.multiprocess


class WithHead(nn.Module):
    """A model with a new head around the base model (`base_model_prefix` "net")."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.cls = nn.Linear(5, 2)


class Adapted(Net):
    """Net with a small adapter matrix in every block, which no pretrained file holds."""

    def __init__(self) -> None:
        super().__init__()
        for block in self.blocks:
            block.register_parameter("adapter", nn.Parameter(torch.ones(2, 6)))


def eager(cls: type[nn.Module], seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in cls().named_parameters()}


def _load(
    mesh: fzero.Mesh, path: str, cls: type[nn.Module], key: Any = None, missing: bool = True
) -> Any:
    model = fzero.init.deferred(cls, seed=7)
    params = dict(model.named_parameters())
    made = fzero.init.from_module(model) if missing else None
    init = fzero.init.from_file(path, key=key, missing=made)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        state = fzero.shard_state(params, fzero.optim.sgd(0.1), mesh, stage=3, init=init)
    return fzero.gather_params(state.params, mesh), [str(w.message) for w in said]


def test_a_base_models_file_fills_a_model_with_a_head_and_the_reverse(tmp_path: Path) -> None:
    """Against the values saved, and the eager construction's for the new head; nothing
    said, since nothing is left unread beside leaves made afresh."""
    base, full = eager(Net, 3), eager(WithHead, 4)
    safetensors.torch.save_file(base, str(tmp_path / "base.safetensors"))
    safetensors.torch.save_file(full, str(tmp_path / "full.safetensors"))
    new_head = eager(WithHead, 7)
    for o in outcomes(2, _load, str(tmp_path / "base.safetensors"), WithHead):
        assert o.error is None, o.message
        got, said = o.value
        assert said == []
        for k, v in got.items():
            want = base[k.removeprefix("net.")] if k.startswith("net.") else new_head[k]
            assert torch.equal(v, want), k
    for o in outcomes(2, _load, str(tmp_path / "full.safetensors"), Net):
        assert o.error is None, o.message
        got, said = o.value
        assert said == [] and set(got) == set(base)
        for k, v in got.items():
            assert torch.equal(v, full["net." + k]), k


def test_layers_under_other_names_are_refused_not_made_afresh(tmp_path: Path) -> None:
    """What transformers >= 5 does to some architectures (fused MoE experts, ViT's
    attention): the blocks' weights saved under other names. missing= would have made
    them from the constructor, a pretrained model silently reset."""
    renamed = {k.replace("blocks.", "layers.").replace(".weight", ".w"): v for k, v in
               eager(Net, 3).items()}  # fmt: skip
    safetensors.torch.save_file(renamed, str(tmp_path / "m.safetensors"))
    raised_together(
        outcomes(2, _load, str(tmp_path / "m.safetensors"), Net),
        ValueError,
        "holds the layers' weights under other names",
        "'blocks.0.weight'",
        "'layers.0.w'",
        "pass key=",
    )


def test_an_adapter_beside_an_old_mask_is_named_and_key_returning_none_declares_it(
    tmp_path: Path,
) -> None:
    """GPT-2's hub file holds each layer's causal mask, which the model no longer keeps,
    beside an adapted model: other element counts than the adapters', so not the same
    weights renamed; a warning names both, and key= returning None says the adapters
    are new."""
    pretrained = eager(Net, 3)
    extra = {**pretrained, "blocks.0.mask": torch.ones(1, 1, 4, 4)}  # not the model's
    safetensors.torch.save_file(extra, str(tmp_path / "m.safetensors"))
    path = str(tmp_path / "m.safetensors")

    def key(p: str) -> str | None:
        return None if p.endswith(".adapter") else p

    for k, outs in enumerate(
        (outcomes(2, _load, path, Adapted), outcomes(2, _load, path, Adapted, key))
    ):
        for o in outs:
            assert o.error is None, o.message
            got, said = o.value
            if k == 0:
                assert len(said) == 1 and "['blocks.0.mask']" in said[0], said
                assert "'blocks.0.adapter'" in said[0] and "returning None" in said[0], said
            else:
                assert said == []
            for name, v in got.items():
                want = torch.ones(2, 6) if name.endswith(".adapter") else pretrained[name]
                assert torch.equal(v, want), name
    # Declared absent without missing=: said so (it read "pass key=", which was passed).
    raised_together(
        outcomes(2, _load, path, Adapted, key, False),
        ValueError,
        "key= says",
        "does not hold 'blocks.0.adapter'",
        "pass missing=",
    )


def test_a_leaf_made_afresh_beside_an_unread_tensor_of_its_shape_is_named(tmp_path: Path) -> None:
    """An embedding saved as `embedding.weight`: outside the layers, it may be a pretraining
    head's; a warning names both, as transformers' does, and the leaf is made afresh."""
    values = eager(Net, 3)
    values["embedding.weight"] = values.pop("embed.weight")
    safetensors.torch.save_file(values, str(tmp_path / "m.safetensors"))
    for o in outcomes(2, _load, str(tmp_path / "m.safetensors"), Net):
        assert o.error is None, o.message
        got, said = o.value
        assert len(said) == 1 and "['embedding.weight']" in said[0], said
        assert "['embed.weight']" in said[0] and "pass key=" in said[0]
        assert torch.equal(got["embed.weight"], eager(Net, 7)["embed.weight"])
