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


def test_many_leaves_keep_their_own_torch_state() -> None:
    """A list of twelve parameters (paths "0".."11", which sort "0", "1", "10", ...) in two
    groups, updated as a tree (stage 0): each keeps its own state, bitwise torch's."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(12)]
    mine = [t.clone().requires_grad_() for t in params]
    ref = torch.optim.Adam([{"params": mine[:1], "lr": 0.1}, {"params": mine[1:]}], lr=0.05)
    make = functools.partial(optim.from_torch, torch.optim.Adam)
    fz = optim.param_groups(
        make, [{"params": ["0"], "lr": 0.1}, {"params": lambda p: True}], lr=0.05
    )
    state = fz.init(params)
    for _ in range(3):
        grads = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(12)]
        for p, g in zip(mine, grads):
            p.grad = g.clone()
        ref.step()
        params, state = fz.update(grads, state, params)
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, mine))


def test_groups_whose_shared_scalars_part_later_raise_on_a_flat_piece() -> None:
    """ASGD's `mu` is 1 in both groups until a group passes its own `t0`, later than the
    groups are tried when made: the update where they part raises, naming the entry,
    rather than keeping one group's value for both."""
    from fzero.optim._context import ShardContext, shard_context

    make = functools.partial(optim.from_torch, torch.optim.ASGD)
    fz = optim.param_groups(make, [{"params": ["a"], "t0": 2.0}, {"params": ["b"]}], lr=0.1, t0=5.0)
    assert fz.whole_tensors is None  # alike over the trial's two updates
    piece, grad = (
        (torch.ones(5, dtype=torch.float64),),
        (torch.full((5,), 0.5, dtype=torch.float64),),
    )
    with shard_context(ShardContext(None, True, ((("a", 0, 2), ("b", 2, 5)),))):
        state = fz.init(piece)
        with pytest.raises(ValueError, match=r"groups 0 and 1 leave different values of 'mu'"):
            for _ in range(6):
                piece, state = fz.update(grad, state, piece)
