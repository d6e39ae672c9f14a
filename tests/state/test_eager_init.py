"""`init=` with a model built as usual, with values (not `deferred`, not on meta).

`from_file` reads the buffers its file holds (a pretrained model's BatchNorm statistics),
as `from_pretrained` does, and keeps those it lacks; `from_module` of such a model gives
its own values (as `missing=`: a head the file lacks, made as the model made it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import fzero
from tests.support import errors_on_every_rank, run

pytestmark = pytest.mark.multiprocess


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():  # made here, not by reset_parameters: a replay misses it
            self.head.weight.fill_(0.25)
        self.register_buffer("mask", torch.tensor([1.0, 0.0]), persistent=False)


def pretrained_file(directory: Path) -> dict[str, torch.Tensor]:
    """A file of the body and statistics a model trained: no head, no mask."""
    torch.manual_seed(1)
    net = Net()
    with torch.no_grad():
        net.norm.running_mean.copy_(torch.randn(4))
        net.norm.running_var.copy_(torch.rand(4) + 0.5)
        net.norm.num_batches_tracked.fill_(7)
    file = {k: v for k, v in net.state_dict().items() if not k.startswith("head")}
    safetensors.torch.save_file(file, str(directory / "model.safetensors"))
    return file


def load(mesh: fzero.Mesh, path: str, stage: int) -> Any:
    torch.manual_seed(5)  # another init than the file's
    net = Net()
    state = fzero.shard_state(
        dict(net.named_parameters()),
        fzero.optim.sgd(lr=0.1),
        mesh,
        stage=stage,
        units=["body", "head"],
        buffers=dict(net.named_buffers()),
        init=fzero.init.from_file(path, missing=fzero.init.from_module(net)),
    )
    params = fzero.gather_params(state.params, mesh) if stage == 3 else state.params
    return params, state.buffers, {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_built_with_values_reads_the_files_buffers_and_keeps_its_own_head(
    tmp_path: Path, stage: int
) -> None:
    file = pretrained_file(tmp_path)
    for params, buffers, own in run(2, load, str(tmp_path), stage):
        for k in ("body.weight", "body.bias", "norm.weight", "norm.bias"):
            assert torch.equal(params[k], file[k]), k
        for k in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked"):
            assert torch.equal(buffers[k], file[k]), k  # they were the fresh model's
        assert torch.equal(params["head.weight"], torch.full((2, 4), 0.25))  # not replayed
        assert torch.equal(params["head.bias"], own["head.bias"])
        assert torch.equal(buffers["mask"], torch.tensor([1.0, 0.0]))  # not in the file


def meta_parameters_real_buffers(mesh: fzero.Mesh) -> Any:
    """accelerate's init_empty_weights (include_buffers=False): parameters on meta, buffers
    with values, which are kept as given."""
    net = Net()
    for m in net.modules():
        for name, p in list(m._parameters.items()):
            m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"))
    state = fzero.shard_state(
        dict(net.named_parameters()),
        fzero.optim.sgd(lr=0.1),
        mesh,
        stage=3,
        buffers=dict(net.named_buffers()),
        init=fzero.init.from_module(net),
    )
    return state.buffers["mask"], fzero.gather_params(state.params, mesh)["body.weight"]


def test_meta_parameters_beside_buffers_with_values_are_made_and_the_buffers_kept() -> None:
    for mask, weight in run(2, meta_parameters_real_buffers):
        assert torch.equal(mask, torch.tensor([1.0, 0.0]))
        torch.manual_seed(0)  # from_module's default seed: Linear's reset_parameters
        assert torch.equal(weight, nn.Linear(3, 4).weight.detach())


def half_meta(mesh: fzero.Mesh) -> None:
    net = Net()
    net.head = net.head.to("meta")
    fzero.init.from_module(net)


def seeded(mesh: fzero.Mesh) -> None:
    fzero.init.from_module(Net(), seed=3)


def test_a_module_partly_on_meta_or_seeded_with_values_is_refused() -> None:
    assert "partly materialized" in errors_on_every_rank(2, half_meta)[0]
    assert "read as they are" in errors_on_every_rank(2, seeded)[0]
