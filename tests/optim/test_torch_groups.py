"""Param groups over torch's own optimizers (`param_groups(partial(from_torch, cls), ...)`)
where torch's per-parameter state does not fit a flat piece's one dict: groups keeping
other entries (momentum in one group), groups moving a per-parameter scalar apart (NAdam's
`mu_product`) and whole-tensor optimizers (Adafactor) train on the tensor layout like
torch's groups, and the flat layout is refused on every rank naming why. (Groups that fit
a flat piece: `test_param_groups.py`'s "-torch" cases.)"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn

import fzero
from fzero import optim
from tests.optim.test_param_groups import PREFIXES, STEPS, data, full, net, torch_groups, train
from tests.support import errors_on_every_rank, run

# Each: torch's class, the shared arguments, each group's own (head, norm, rest).
PARTED: dict[str, Any] = {
    # momentum_decay moves NAdam's per-parameter mu_product apart between the groups
    "nadam": (torch.optim.NAdam, {"lr": 0.05, "weight_decay": 0.1},
              [{"momentum_decay": 0.002}, {"lr": 0.1, "weight_decay": 0.0}, {}]),
    # momentum in the head's group only: its parameters keep a buffer, the others none
    "sgd": (torch.optim.SGD, {"lr": 0.05}, [{"momentum": 0.9}, {"lr": 0.1}, {}]),
    # factored second moments: an update of a whole tensor, not of its elements
    "adafactor": (torch.optim.Adafactor, {"lr": 0.05, "weight_decay": 0.1},
                  [{"lr": 0.1}, {"weight_decay": 0.0}, {}]),
}  # fmt: skip


def reference(case: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    cls, shared, own = PARTED[case]
    model = net()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = cls(torch_groups(dict(model.named_parameters()), own), **shared, foreach=False)
    x, y = data()
    for k in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[k]), y[k]).backward()
        opt.step()
    return start, {k: v.detach() for k, v in model.named_parameters()}


def grouped(case: str) -> optim.Optimizer:
    cls, shared, own = PARTED[case]
    groups = [
        {"params": (lambda p, pre=prefix: p.startswith(pre)), **extra}
        for prefix, extra in zip(PREFIXES, own)
    ]
    return optim.param_groups(functools.partial(optim.from_torch, cls), groups, **shared)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(PARTED))
def test_groups_torchs_state_cannot_share_train_whole_tensors_as_torch(case: str) -> None:
    """The tensor layout at stages 1 and 3 trains like torch's groups (float64); the flat
    layout, whose pieces would mix the groups' parameters, is refused on every rank."""
    start, want = reference(case)

    def fn(mesh: fzero.Mesh, stage: int) -> dict[str, torch.Tensor]:
        return full(train(mesh, grouped(case), stage, layout="tensor"), mesh)

    for stage in (1, 3):
        for got in run(2, fn, stage):
            fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
            assert all(not torch.equal(got[k], start[k]) for k in want)
    why = {
        "nadam": r"groups 0 and 1 move the per-parameter \['mu_product'\] apart",
        "sgd": r"group 1's optimizer keeps \[\] per parameter, group 0's \['momentum_buffer'\]",
        "adafactor": "from_torch\\(Adafactor\\) updates a tensor by more than its elements",
    }[case]
    params = dict(net().named_parameters())
    refused = errors_on_every_rank(
        2, lambda m: fzero.shard_state(params, grouped(case), m, stage=1)
    )
    pattern = f"(?s)ValueError: .*{why}.*use layout='tensor'"
    assert all(re.search(pattern, e) for e in refused), refused
