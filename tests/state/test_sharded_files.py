"""Checkpoints sharded over several files (Hugging Face's `save_pretrained` layout), read
into shards by `fzero.init.from_file`: each tensor from the file its index names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fzero
from tests.faults.harness import outcomes, raised_together

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 5)


def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return {k: v.detach().clone() for k, v in Net().named_parameters()}


def save_sharded(directory: Path, fmt: str, files: int = 3) -> None:
    """`weights()` split over `files` files with an index, as `save_pretrained` writes."""
    names = list(weights())
    groups = [names[i::files] for i in range(files)]
    stem, ext = ("model", "safetensors") if fmt == "safetensors" else ("pytorch_model", "bin")
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        file = f"{stem}-{k:05d}-of-{files:05d}.{ext}"
        part = {n: weights()[n] for n in group}
        if fmt == "safetensors":
            safetensors.torch.save_file(part, str(directory / file))
        else:
            torch.save(part, directory / file)
        weight_map.update({n: file for n in group})
    total = sum(t.numel() * t.element_size() for t in weights().values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / f"{stem}.{ext}.index.json").write_text(json.dumps(index))


def _load(mesh: fzero.Mesh, path: str, stage: int) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        params = {k: v.detach() for k, v in Net().named_parameters()}
    units = ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    state = fzero.shard_state(
        params,
        fzero.optim.sgd(0.1),
        mesh,
        stage=stage,
        units=units,
        init=fzero.init.from_file(path),
    )
    return fzero.gather_params(state.params, mesh)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("by", ["directory", "index"])
def test_a_sharded_checkpoint_loads_into_shards(
    tmp_path: Path, fmt: str, by: str, stage: int
) -> None:
    save_sharded(tmp_path, fmt)
    stem = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    path = tmp_path if by == "directory" else tmp_path / f"{stem}.index.json"
    for o in outcomes(2, _load, str(path), stage):
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, weights(), rtol=0, atol=0)


def test_a_directory_prefers_safetensors_as_hugging_face_does(tmp_path: Path) -> None:
    save_sharded(tmp_path, "safetensors")
    torch.save(
        {k: torch.zeros_like(v) for k, v in weights().items()}, tmp_path / "pytorch_model.bin"
    )
    for o in outcomes(2, _load, str(tmp_path), 3):
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, weights(), rtol=0, atol=0)


def test_a_directory_prefers_the_single_file_to_an_index_as_hugging_face_does(
    tmp_path: Path,
) -> None:
    # from_pretrained reads model.safetensors where a directory holds it beside an index
    # (an export from one file to several, killed before the file's removal): fzero read
    # the index, so the two loaded other values from one directory.
    save_sharded(tmp_path, "safetensors")
    single = {k: v + 1 for k, v in weights().items()}
    safetensors.torch.save_file(single, str(tmp_path / "model.safetensors"))
    for o in outcomes(2, _load, str(tmp_path), 3):
        assert o.error is None, o.message
        fzero.assert_trees_close(o.value, single, rtol=0, atol=0)


def _broken(directory: Path, how: str) -> Any:
    save_sharded(directory, "safetensors")
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    if how == "a missing file":
        (directory / "model-00002-of-00003.safetensors").unlink()
        return "which is missing"
    if how == "a tensor not in its file":
        data["weight_map"]["head.bias"] = "model-00001-of-00003.safetensors"
        index.write_text(json.dumps(data))
        return "does not hold it"
    if how == "a file outside the directory":
        data["weight_map"]["head.bias"] = "../elsewhere.safetensors"
        index.write_text(json.dumps(data))
        return "outside"
    index.unlink()
    return "a directory without"


@pytest.mark.parametrize(
    "how",
    ["a missing file", "a tensor not in its file", "a file outside the directory", "no index"],
)
def test_a_broken_sharded_checkpoint_is_refused_on_every_rank(tmp_path: Path, how: str) -> None:
    needle = _broken(tmp_path, how)
    raised_together(outcomes(2, _load, str(tmp_path), 3), ValueError, needle)
