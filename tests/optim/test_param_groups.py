"""`fzero.optim.param_groups`: torch.optim's per-group hyper-parameters (a rate for the
head, a scheduled rate per group, no decay on a norm) over one state, at every stage and
in pieces mixing groups, against one-process torch.optim with the same groups."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from fzero import optim
from tests.support import run

F64 = torch.float64
STEPS, ROWS = 3, 6


def net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Linear(4, 6, dtype=F64), nn.LayerNorm(6, dtype=F64), nn.Tanh(),
        nn.Linear(6, 3, dtype=F64),
    )  # fmt: skip


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, ROWS, 4, generator=gen, dtype=F64)
    return x, torch.randn(STEPS, ROWS, 3, generator=gen, dtype=F64)


def decay(k: int) -> float:
    return 1.0 / (k + 1)


# Per optimizer: torch's class and shared arguments, each group's own (the head's rate,
# the norm's decay), and fzero's factory. The groups run out of the model's order.
CASES: dict[str, Any] = {
    "adamw": (torch.optim.AdamW, optim.adamw, {"lr": 0.05, "weight_decay": 0.1},
              [{"lr": 0.1}, {"weight_decay": 0.0}, {}]),
    "adam-betas": (torch.optim.Adam, optim.adam, {"lr": 0.05, "weight_decay": 0.1},
                   [{"betas": (0.8, 0.99)}, {"eps": 1e-6, "weight_decay": 0.0}, {}]),
    "sgd": (torch.optim.SGD, optim.sgd, {"lr": 0.05, "momentum": 0.9},
            [{"lr": 0.2, "dampening": 0.5}, {"nesterov": True}, {}]),
    # torch's own state through from_torch: a dict per parameter, whose per-element
    # tensors a flat piece's runs share and whose step counts (NAdam's mu_product too)
    # each run keeps.
    "rmsprop-torch": (torch.optim.RMSprop, functools.partial(optim.from_torch, torch.optim.RMSprop),
                      {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1},
                      [{"lr": 0.02}, {"alpha": 0.9, "weight_decay": 0.0}, {}]),
    "nadam-torch": (torch.optim.NAdam, functools.partial(optim.from_torch, torch.optim.NAdam),
                    {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True},
                    [{"lr": 0.1}, {"eps": 1e-6, "weight_decay": 0.0}, {}]),
}  # fmt: skip
PREFIXES = ("3.", "1.", "")  # head, norm, the rest


def torch_groups(named: dict[str, torch.Tensor], own: list[dict[str, Any]]) -> list[dict]:
    """torch's groups: each prefix's parameters not taken by an earlier one, with its own
    arguments (the head, the norm, the rest)."""
    taken: set[str] = set()
    groups = []
    for prefix, extra in zip(PREFIXES, own):
        names = [n for n in named if n.startswith(prefix) and n not in taken]
        taken.update(names)
        groups.append({"params": [named[n] for n in names], **extra})
    return groups


def reference(case: str, scheduled: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    cls, _, shared, own = CASES[case]
    model = net()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = cls(torch_groups(dict(model.named_parameters()), own), **shared, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay) if scheduled else None
    x, y = data()
    for k in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[k]), y[k]).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return start, {k: v.detach() for k, v in model.named_parameters()}


def grouped(case: str, scheduled: bool, **kw: Any) -> optim.Optimizer:
    _, make, shared, own = CASES[case]

    def rate(extra: dict[str, Any]) -> Any:
        lr = extra.get("lr", shared["lr"])
        return {"lr": optim.lambda_lr(lr, decay)} if scheduled else {}

    groups = [
        {"params": (lambda p, pre=prefix: p.startswith(pre)), **extra, **rate(extra)}
        for prefix, extra in zip(PREFIXES, own)
    ]
    return optim.param_groups(make, groups, **{**shared, **rate({}), **kw})


def train(
    mesh: fzero.Mesh, opt: optim.Optimizer, stage: int, compile: Any = False, **kw: Any
) -> Any:
    model = net()
    state = fzero.shard_state(dict(model.named_parameters()), opt, mesh, stage=stage, **kw)
    step = fzero.sharded_step(
        lambda p, b: nn.functional.mse_loss(functional_call(model, p, (b[0],)), b[1]),
        opt, mesh, stage=stage, compile=compile,
    )  # fmt: skip
    x, y = data()
    per = ROWS // mesh.size
    for k in range(STEPS):
        state, _ = step(state, (x[k, mesh.rank * per : (mesh.rank + 1) * per],
                                y[k, mesh.rank * per : (mesh.rank + 1) * per]))  # fmt: skip
    return state


def full(state: Any, mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    params = fzero.gather_params(state.params, mesh) if state.stage == 3 else state.params
    return {k: v.detach().clone() for k, v in params.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("world", "stage", "options"),
    [
        (1, 0, {}),
        (2, 0, {}),
        (2, 1, {}),  # one flat piece a rank, cut into runs of the groups' elements
        (2, 2, {"units": ["0", "1"]}),
        (3, 3, {}),
        (2, 3, {"layout": "tensor"}),
    ],
)
def test_param_groups_train_like_torch_optims_groups(
    case: str, world: int, stage: int, options: dict[str, Any]
) -> None:
    scheduled = case == "adamw"
    start, want = reference(case, scheduled)

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        return full(train(mesh, grouped(case, scheduled), stage, **options), mesh)

    for got in run(world, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


def test_a_tree_update_is_bitwise_torchs_groups() -> None:
    """Called on the parameter tree itself, each group's leaves get torch's very ops."""
    for case in CASES:
        cls, _, shared, own = CASES[case]
        model = net()
        named = dict(model.named_parameters())
        params = {k: v.detach().clone() for k, v in named.items()}
        gen = torch.Generator().manual_seed(1)
        grads = {k: torch.randn(v.shape, generator=gen, dtype=F64) for k, v in params.items()}
        opt = cls(torch_groups(named, own), **shared, foreach=False)
        fz = grouped(case, False)
        state = fz.init(params)
        for _ in range(2):
            for k, p in named.items():
                p.grad = grads[k].clone()
            opt.step()
            params, state = fz.update(grads, state, params)
        assert all(torch.equal(params[k], named[k].detach()) for k in named), case
        if case.endswith("-torch"):  # torch's step count, per parameter
            assert all(int(s["step"]) == 2 for s in state.values()), case
        else:
            assert int(state.count) == 2


@pytest.mark.multiprocess
def test_groups_run_fused_offloaded_and_through_a_checkpoint(tmp_path: Path) -> None:
    """Fused kernels (within their ulps), a compiled step, both offload tiers, and a
    checkpoint saved with groups resumed at another world size and stage: the same
    training."""
    start, want = reference("adamw", True)

    def save(mesh: fzero.Mesh) -> None:
        model = net()
        opt = grouped("adamw", True)
        state = fzero.shard_state(dict(model.named_parameters()), opt, mesh, stage=3)
        step = fzero.sharded_step(
            lambda p, b: nn.functional.mse_loss(functional_call(model, p, (b[0],)), b[1]),
            opt, mesh, stage=3,
        )  # fmt: skip
        x, y = data()
        per = ROWS // mesh.size
        for k in range(STEPS - 1):
            state, _ = step(state, (x[k, mesh.rank * per : (mesh.rank + 1) * per],
                                    y[k, mesh.rank * per : (mesh.rank + 1) * per]))  # fmt: skip
        fzero.checkpoint.save(state, tmp_path / "ck", mesh)

    def resume(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        model = net()
        opt = grouped("adamw", True)
        state = fzero.checkpoint.load(tmp_path / "ck", mesh, opt, dict(model.named_parameters()),
                                      stage=1)  # fmt: skip
        step = fzero.sharded_step(
            lambda p, b: nn.functional.mse_loss(functional_call(model, p, (b[0],)), b[1]),
            opt, mesh, stage=1,
        )  # fmt: skip
        x, y = data()
        state, _ = step(state, (x[-1, mesh.rank * 2 : mesh.rank * 2 + 2],
                                y[-1, mesh.rank * 2 : mesh.rank * 2 + 2]))  # fmt: skip
        return full(state, mesh)

    run(2, save)
    for got in run(3, resume):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    for opt, options in [
        (grouped("adamw", True, fused=True), {}),
        (grouped("adamw", True), {"compile": "aot_eager"}),
        (grouped("adamw", True), {"offload": fzero.Offload("host")}),
        (
            grouped("adamw", True),
            {"offload": fzero.Offload("disk", directory=str(tmp_path / "spill"))},
        ),
    ]:
        for got in run(2, lambda mesh, o=opt, kw=options: full(train(mesh, o, 3, **kw), mesh)):
            fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
            assert all(not torch.equal(got[k], start[k]) for k in want)


def test_a_piece_mixing_groups_keeps_each_groups_mask_by_path() -> None:
    """One flat piece holding a, b and c, a and c in one group: the runs a | b | c each
    see their own paths, so the group's decay mask (on "c" only) lands where torch's
    groups put it."""
    from fzero.optim._context import ShardContext, shard_context

    gen = torch.Generator().manual_seed(2)
    sizes = {"a": 3, "b": 2, "c": 4}
    values = {k: torch.randn(n, generator=gen, dtype=F64) for k, n in sizes.items()}
    grads = {k: torch.randn(n, generator=gen, dtype=F64) for k, n in sizes.items()}
    mine = {k: v.clone().requires_grad_() for k, v in values.items()}
    opt = torch.optim.AdamW(
        [{"params": [mine["a"]], "weight_decay": 0.0}, {"params": [mine["c"]]},
         {"params": [mine["b"]], "lr": 0.2, "weight_decay": 0.0}],
        lr=0.1, weight_decay=0.3, foreach=False,
    )  # fmt: skip
    fz = optim.param_groups(
        optim.adamw, [{"params": ["a", "c"]}, {"params": ["b"], "lr": 0.2}],
        lr=0.1, weight_decay=0.3, mask=lambda path: path == "c",
    )  # fmt: skip
    piece = (torch.cat([values[k] for k in sizes]),)
    grad = (torch.cat([grads[k] for k in sizes]),)
    segments = ((("a", 0, 3), ("b", 3, 5), ("c", 5, 9)),)
    with shard_context(ShardContext(None, True, segments)):
        state = fz.init(piece)
        for _ in range(2):
            for k, p in mine.items():
                p.grad = grads[k].clone()
            opt.step()
            piece, state = fz.update(grad, state, piece)
    assert torch.equal(piece[0], torch.cat([mine[k].detach() for k in sizes]))


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="group 0 must be a dict with 'params'"):
        optim.param_groups(optim.adamw, [{"lr": 0.1}])
    with pytest.raises(ValueError, match=r"group 0 sets \['momentum'\], which adamw lacks"):
        optim.param_groups(optim.adamw, [{"params": lambda p: True, "momentum": 0.9}])
    with pytest.raises(ValueError, match="another structure"):
        optim.param_groups(optim.adam, [{"params": ["a"], "amsgrad": True}, {"params": ["b"]}])

    clipped = lambda **kw: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(**kw))  # noqa: E731
    with pytest.raises(ValueError, match="state is not per-parameter tensors"):
        optim.param_groups(clipped, [{"params": ["a"], "lr": 0.1}])
    opt = optim.param_groups(optim.adamw, [{"params": ["a"], "lr": 0.1}])
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="no group claims parameter 'b'"):
        opt.update({"a": torch.ones(2), "b": torch.ones(3)}, opt.init(params), params)


@given(data=st.data())
def test_any_cut_of_a_flat_shard_steps_each_group_as_torch(data: st.DataObject) -> None:
    """Leaves of random sizes in random groups, laid end to end and cut into pieces at
    random points (a rank's flat shards, some empty): two updates over the pieces are
    bitwise torch's groups over the leaves."""
    from fzero.optim._context import ShardContext, shard_context

    sizes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=6), label="sizes")
    groups = data.draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    total = sum(sizes)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=4), label="cuts"))
    case = data.draw(st.sampled_from(sorted(CASES)), label="case")
    cls, make, shared, own = CASES[case]
    names = [f"p{i}" for i in range(len(sizes))]
    gen = torch.Generator().manual_seed(len(sizes) * 31 + total)
    values = [torch.randn(n, generator=gen, dtype=F64) for n in sizes]
    grads = [[torch.randn(n, generator=gen, dtype=F64) for n in sizes] for _ in range(2)]

    mine = [v.clone().requires_grad_() for v in values]
    torch_groups = [
        {"params": [mine[i] for i, g in enumerate(groups) if g == k], **own[k]}
        for k in range(3)
        if k in groups
    ]
    opt = cls(torch_groups, **shared, foreach=False)
    fz = optim.param_groups(
        make,
        [{"params": [n for n, g in zip(names, groups) if g == k], **own[k]} for k in range(3)],
        **shared,
    )
    bounds = [0, *cuts, total]
    flat = torch.cat(values)
    starts = list(itertools.accumulate(sizes, initial=0))

    def cut(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t[a:b].clone() for a, b in itertools.pairwise(bounds))

    segments = tuple(
        tuple(
            (names[i], max(a, starts[i]) - a, min(b, starts[i + 1]) - a)
            for i in range(len(sizes))
            if max(a, starts[i]) < min(b, starts[i + 1])
        )
        for a, b in itertools.pairwise(bounds)
    )
    pieces = cut(flat)
    with shard_context(ShardContext(None, True, segments)):
        state = fz.init(pieces)
        for step in range(2):
            for p, g in zip(mine, grads[step]):
                p.grad = g.clone()
            opt.step()
            pieces, state = fz.update(cut(torch.cat(grads[step])), state, pieces)
    assert torch.equal(torch.cat(pieces), torch.cat([p.detach() for p in mine]))


def test_a_bare_tensor_steps_as_the_factory_does() -> None:
    """Parameters that are one tensor: its step count is no parameter's (bitwise plain
    adamw over two updates)."""
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(5, generator=gen, dtype=F64), torch.randn(5, generator=gen, dtype=F64)
    plain = optim.adamw(lr=0.1)
    grouped_ = optim.param_groups(optim.adamw, [{"params": lambda path: True}], lr=0.1)
    a, sa = p.clone(), plain.init(p)
    b, sb = p.clone(), grouped_.init(p)
    for _ in range(2):
        a, sa = plain.update(g, sa, a)
        b, sb = grouped_.update(g, sb, b)
    assert torch.equal(a, b) and int(sb.count) == 2


def test_a_path_in_two_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="'a' is listed in group 0 and group 1"):
        optim.param_groups(optim.adamw, [{"params": ["a"]}, {"params": ["a", "b"]}])


def _steps_with_a_misspelt_group(mesh: fzero.Mesh) -> None:
    groups = [{"params": ["w2_typo"], "lr": 1.0}, {"params": lambda path: True}]
    opt = optim.param_groups(optim.sgd, groups, lr=0.1)
    params = {"w1": torch.ones(3), "w2": torch.ones(3)}
    state = fzero.shard_state(params, opt, mesh, stage=1)
    loss = lambda p, x: (x * (p["w1"] + p["w2"])).sum()  # noqa: E731
    fzero.sharded_step(loss, opt, mesh, stage=1)(state, torch.ones(3))


@pytest.mark.multiprocess
def test_a_misspelt_path_in_a_group_is_refused_on_every_rank() -> None:
    """torch's groups hold the tensors themselves; a path list may name none: the leaf
    fell to a later group and trained at its rate without a word (a second reader's)."""
    with pytest.raises(ValueError, match="group 0 lists 'w2_typo', which is no parameter"):
        run(2, _steps_with_a_misspelt_group)
