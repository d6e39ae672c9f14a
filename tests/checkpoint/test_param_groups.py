"""Param groups in and out: a torch optimizer with a decay group and a no-decay group
(weights; biases and a norm's same-shaped weight and bias) resumed by fzero's
`adamw(mask=)` and the reverse, through torch's state dicts and DCP, against one-process
torch.optim; groups that cannot be matched refused on every rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import errors_on_every_rank, run

F64 = torch.float64
HYPER = {"lr": 0.05, "weight_decay": 0.1}
WORLD, PER_RANK, STEPS = 2, 3, 3


def net() -> nn.Module:
    """A norm between two layers: its weight and bias have one shape, so a state matched
    by position across groups would swap their moments without any shape error."""
    torch.manual_seed(4)
    return nn.Sequential(
        nn.Linear(4, 6, dtype=F64), nn.LayerNorm(6, dtype=F64), nn.Tanh(),
        nn.Linear(6, 3, dtype=F64),
    )  # fmt: skip


def decays(name: str) -> bool:
    return name.endswith("weight") and not name.startswith("1.")  # not the norm's


def torch_groups(model: nn.Module, named: bool) -> list[dict[str, Any]]:
    """Decay group first, then the no-decay one: out of the model's parameter order."""
    pairs = list(model.named_parameters())
    out = []
    for keep, wd in ((True, HYPER["weight_decay"]), (False, 0.0)):
        chosen = [(n, p) for n, p in pairs if decays(n) == keep]
        out.append({"params": chosen if named else [p for _, p in chosen], "weight_decay": wd})
    return out


def names_of_groups(model: nn.Module) -> list[list[str]]:
    pairs = [n for n, _ in model.named_parameters()]
    return [[n for n in pairs if decays(n)], [n for n in pairs if not decays(n)]]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS, WORLD * PER_RANK, 4, generator=gen, dtype=F64)
    return x, torch.randn(STEPS, WORLD * PER_RANK, 3, generator=gen, dtype=F64)


def torch_step(model: nn.Module, opt: Any, k: int, lo: int = 0, hi: int | None = None) -> None:
    x, y = data()
    opt.zero_grad()
    nn.functional.mse_loss(model(x[k, lo:hi]), y[k, lo:hi]).backward()
    opt.step()


def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = net()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(torch_groups(model, named=False), **HYPER)
    for k in range(STEPS):
        torch_step(model, opt, k)
    return start, {k: v.detach() for k, v in model.named_parameters()}


def fzero_adamw(model: nn.Module) -> fzero.optim.Optimizer:
    return fzero.optim.adamw(**HYPER, mask={n: decays(n) for n, _ in model.named_parameters()})


def fzero_steps(mesh: fzero.Mesh, state: Any, model: nn.Module, ks: range) -> Any:
    x, y = data()
    adamw = fzero_adamw(model)
    step = fzero.sharded_step(
        lambda p, b: nn.functional.mse_loss(functional_call(model, p, (b[0],)), b[1]),
        adamw, mesh, stage=state.stage,
    )  # fmt: skip
    per = x.shape[1] // mesh.size
    lo, hi = mesh.rank * per, (mesh.rank + 1) * per
    for k in ks:
        state, _ = step(state, (x[k, lo:hi], y[k, lo:hi]))
    return state


def full(state: Any, mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    params = fzero.gather_params(state.params, mesh) if state.stage == 3 else state.params
    return {k: v.detach().clone() for k, v in params.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["named", "param_names="])
def test_a_torch_optimizer_with_two_groups_resumes_under_fzero(how: str) -> None:
    """torch.optim trains two steps with a decay and a no-decay group; fzero (`mask=`)
    resumes at stage 3 on 2 ranks for the third."""
    start, want = reference()
    model = net()
    opt = torch.optim.AdamW(torch_groups(model, named=how == "named"), **HYPER)
    for k in range(STEPS - 1):
        torch_step(model, opt, k)
    sd, osd = model.state_dict(), opt.state_dict()
    extra = {"param_names": names_of_groups(model)} if how == "param_names=" else {}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m = net()
        state = fzero.checkpoint.import_torch(
            sd, osd, fzero_adamw(m), mesh, stage=3, **extra
        )  # fmt: skip
        return full(fzero_steps(mesh, state, m, range(STEPS - 1, STEPS)), mesh)

    for got in run(WORLD, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


@pytest.mark.multiprocess
def test_fzero_exports_groups_that_torch_loads_and_reads_them_back() -> None:
    """fzero trains two steps and exports with the groups; torch's optimizer built with
    them loads it and steps the third; and the file imports back by its names."""
    start, want = reference()
    defaults = torch.optim.AdamW([torch.zeros(1)], **HYPER).defaults
    groups = [
        {**defaults, "params": names} if g == 0 else {**defaults, "weight_decay": 0.0,
                                                       "params": names}
        for g, names in enumerate(names_of_groups(net()))
    ]  # fmt: skip

    def fn(mesh: fzero.Mesh) -> Any:
        m = net()
        state = fzero.shard_state(dict(m.named_parameters()), fzero_adamw(m), mesh, stage=2)
        state = fzero_steps(mesh, state, m, range(STEPS - 1))
        out = fzero.checkpoint.export_torch(state, None, mesh, hyperparams=groups)
        back = fzero.checkpoint.import_torch(*out, fzero_adamw(m), mesh, stage=1) if out else None
        return out, None if back is None else full(fzero_steps(mesh, back, m, range(2, 3)), mesh)

    (sd, osd), resumed = run(1, fn)[0]
    assert [g["weight_decay"] for g in osd["param_groups"]] == [0.1, 0.0]
    model = net()
    opt = torch.optim.AdamW(torch_groups(model, named=False), **HYPER)
    model.load_state_dict(sd)
    opt.load_state_dict(osd)
    torch_step(model, opt, STEPS - 1)
    got = {k: v.detach() for k, v in model.named_parameters()}
    fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    fzero.assert_trees_close(resumed, want, rtol=1e-10, atol=1e-12)
    assert all(not torch.equal(got[k], start[k]) for k in want)


@pytest.mark.multiprocess
def test_export_dcp_takes_fsdp2s_own_groups_and_fsdp2_trains_on(tmp_path: Path) -> None:
    """fzero trains two steps on 2 ranks and exports to DCP with the groups FSDP2's
    optimizer reports (`get_optimizer_state_dict(...)["param_groups"]`); FSDP2 loads
    strictly and steps the third."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    start, want = reference()

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        theirs = net()
        fully_shard(theirs, mesh=init_device_mesh("cpu", (WORLD,)))
        opt = torch.optim.AdamW(torch_groups(theirs, named=False), **HYPER)
        osd = get_optimizer_state_dict(theirs, opt)
        m = net()
        state = fzero.shard_state(dict(m.named_parameters()), fzero_adamw(m), mesh, stage=3)
        state = fzero_steps(mesh, state, m, range(STEPS - 1))
        fzero.checkpoint.export_dcp(state, tmp_path / "c", mesh, optimizer_key="optim",
                                    hyperparams=osd["param_groups"])  # fmt: skip
        sd = theirs.state_dict()
        dcp.load({**sd, "optim": osd}, checkpoint_id=tmp_path / "c")
        theirs.load_state_dict(sd)
        set_optimizer_state_dict(theirs, opt, osd)
        lo = mesh.rank * PER_RANK
        torch_step(theirs, opt, STEPS - 1, lo, lo + PER_RANK)
        return {k: v.full_tensor().detach() for k, v in theirs.named_parameters()}

    for got in run(WORLD, fn):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        assert all(not torch.equal(got[k], start[k]) for k in want)


@pytest.mark.multiprocess
def test_groups_that_cannot_be_matched_are_refused_on_every_rank() -> None:
    model = net()
    opt = torch.optim.AdamW(torch_groups(model, named=False), **HYPER)
    torch_step(model, opt, 0)
    sd, osd = model.state_dict(), opt.state_dict()
    names = names_of_groups(model)

    def unnamed(mesh: fzero.Mesh) -> None:
        fzero.checkpoint.import_torch(sd, osd, fzero_adamw(net()), mesh, stage=3)

    def export(groups: Any) -> Any:
        def fn(mesh: fzero.Mesh) -> None:
            m = net()
            state = fzero.shard_state(dict(m.named_parameters()), fzero_adamw(m), mesh, stage=3)
            fzero.checkpoint.export_torch(state, None, mesh, hyperparams=groups)

        return fn

    twice = [{"params": names[0]}, {"params": names[1] + names[0][:1]}]
    unknown = [{"params": names[0]}, {"params": [*names[1], "5.weight"]}]
    cases = [
        (unnamed, "2 param groups without names"),
        (export(twice), "in param groups 0 and 1"),
        (export([{"params": names[0]}]), "trainable parameter(s) in no param group"),
        (export(unknown), "'5.weight' names no parameter"),
        (export([{"lr": 0.1}]), "param group 0 names no parameters"),
    ]
    for fn, expected in cases:
        messages = errors_on_every_rank(WORLD, fn)
        assert len(set(messages)) == 1 and expected in messages[0], messages


@pytest.mark.multiprocess
def test_torchs_other_forms_of_groups_resume_alike() -> None:
    """Groups keyed as `get_optimizer_state_dict` keys them (names as ids), a one-group
    optimizer of a DDP-wrapped model ("module." names), and an optimizer over every
    parameter with one frozen (listed in a group, no state): each resumes as torch."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    _, want = reference()

    def fqn_form(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        model = net()
        opt = torch.optim.AdamW(torch_groups(model, named=False), **HYPER)
        for k in range(STEPS - 1):
            torch_step(model, opt, k)
        osd = get_optimizer_state_dict(model, opt)
        assert isinstance(osd["param_groups"][0]["params"][0], str)
        m = net()
        state = fzero.checkpoint.import_torch(
            model.state_dict(), osd, fzero_adamw(m), mesh, stage=3
        )
        return full(fzero_steps(mesh, state, m, range(STEPS - 1, STEPS)), mesh)

    for got in run(WORLD, fqn_form):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)

    # One group, DDP's names: matched through the prefix (plain AdamW: decay everywhere).
    model = net()
    opt = torch.optim.AdamW([(f"module.{n}", p) for n, p in model.named_parameters()], **HYPER)
    torch_step(model, opt, 0)
    sd, osd = copy.deepcopy((model.state_dict(), opt.state_dict()))  # before the next step
    assert osd["param_groups"][0]["param_names"][0] == "module.0.weight"
    torch_step(model, opt, 1)
    plain_want = {k: v.detach().clone() for k, v in model.named_parameters()}

    def ddp_names(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        m = net()
        adamw = fzero.optim.adamw(**HYPER)
        state = fzero.checkpoint.import_torch(sd, osd, adamw, mesh, stage=2)
        x, y = data()
        step = fzero.sharded_step(
            lambda p, b: nn.functional.mse_loss(functional_call(m, p, (b[0],)), b[1]),
            adamw, mesh, stage=2,
        )  # fmt: skip
        state, _ = step(state, (x[1, mesh.rank * 3 : mesh.rank * 3 + 3],
                                y[1, mesh.rank * 3 : mesh.rank * 3 + 3]))  # fmt: skip
        return full(state, mesh)

    for got in run(WORLD, ddp_names):
        fzero.assert_trees_close(got, plain_want, rtol=1e-10, atol=1e-12)


@pytest.mark.multiprocess
def test_a_frozen_parameter_listed_in_torchs_groups_exports_and_imports() -> None:
    """torch's optimizer built over every parameter, the norm's bias frozen: fzero's
    export numbers it in its group with no state, torch loads it and steps as torch, and
    the file imports back."""
    frozen = "1.bias"

    def frozen_net() -> nn.Module:
        m = net()
        dict(m.named_parameters())[frozen].requires_grad_(False)
        return m

    model = frozen_net()
    opt = torch.optim.AdamW(torch_groups(model, named=False), **HYPER)
    for k in range(STEPS):
        torch_step(model, opt, k)
    want = {k: v.detach() for k, v in model.named_parameters()}
    defaults = torch.optim.AdamW([torch.zeros(1)], **HYPER).defaults
    groups = [{**defaults, "params": names} for names in names_of_groups(model)]
    groups[1]["weight_decay"] = 0.0

    def fn(mesh: fzero.Mesh) -> Any:
        m = frozen_net()
        state = fzero.shard_state(dict(m.named_parameters()), fzero_adamw(m), mesh, stage=3)
        state = fzero_steps(mesh, state, m, range(STEPS - 1))
        out = fzero.checkpoint.export_torch(state, None, mesh, hyperparams=groups)
        return out

    sd, osd = run(WORLD, fn)[0]
    assert frozen in osd["param_groups"][1]["param_names"]
    theirs = frozen_net()
    opt = torch.optim.AdamW(torch_groups(theirs, named=False), **HYPER)
    theirs.load_state_dict(sd)
    opt.load_state_dict(copy.deepcopy(osd))  # torch steps the loaded tensors in place
    torch_step(theirs, opt, STEPS - 1)
    got = {k: v.detach() for k, v in theirs.named_parameters()}
    fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)

    def back(mesh: fzero.Mesh) -> Any:
        m = frozen_net()
        like = dict(m.named_parameters())  # which is frozen: the state dict cannot say
        state = fzero.checkpoint.import_torch(
            sd, osd, fzero_adamw(m), mesh, stage=1, params_like=like
        )
        return full(fzero_steps(mesh, state, m, range(STEPS - 1, STEPS)), mesh)

    for got in run(WORLD, back):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.multiprocess
def test_groups_of_torchs_own_optimizer_go_to_torch_and_back() -> None:
    """`param_groups(partial(from_torch, RMSprop), ...)`: fzero trains two steps at stage 3
    (flat pieces mixing the groups) and exports with the groups; torch's RMSprop built with
    them loads it and steps the third as one process does; and torch's file imports back
    into the groups at stage 1 and steps the third alike."""
    import functools

    hyper = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.1}

    def torch_rmsprop(model: nn.Module) -> torch.optim.Optimizer:
        groups = torch_groups(model, named=False)
        groups[1]["lr"] = 0.02  # and no decay: the second group's own rate too
        return torch.optim.RMSprop(groups, **hyper)

    def ours() -> fzero.optim.Optimizer:
        make = functools.partial(fzero.optim.from_torch, torch.optim.RMSprop)
        groups = [{"params": decays}, {"params": lambda n: True, "weight_decay": 0.0, "lr": 0.02}]
        return fzero.optim.param_groups(make, groups, **hyper)

    model = net()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch_rmsprop(model)
    for k in range(STEPS):
        torch_step(model, opt, k)
    want = {k: v.detach() for k, v in model.named_parameters()}
    defaults = torch.optim.RMSprop([torch.zeros(1)], **hyper).defaults
    names = names_of_groups(net())
    groups = [{**defaults, "params": names[0]}]
    groups.append({**defaults, "weight_decay": 0.0, "lr": 0.02, "params": names[1]})

    def steps(mesh: fzero.Mesh, state: Any, m: nn.Module, ks: range) -> Any:
        x, y = data()
        step = fzero.sharded_step(
            lambda p, b: nn.functional.mse_loss(functional_call(m, p, (b[0],)), b[1]),
            ours(), mesh, stage=state.stage,
        )  # fmt: skip
        lo, hi = mesh.rank * PER_RANK, (mesh.rank + 1) * PER_RANK
        for k in ks:
            state, _ = step(state, (x[k, lo:hi], y[k, lo:hi]))
        return state

    def there(mesh: fzero.Mesh) -> Any:
        m = net()
        state = fzero.shard_state(dict(m.named_parameters()), ours(), mesh, stage=3)
        state = steps(mesh, state, m, range(STEPS - 1))
        return fzero.checkpoint.export_torch(state, None, mesh, hyperparams=groups)

    sd, osd = run(WORLD, there)[0]
    theirs = net()
    opt = torch_rmsprop(theirs)
    theirs.load_state_dict(sd)
    opt.load_state_dict(copy.deepcopy(osd))  # torch steps the loaded tensors in place
    torch_step(theirs, opt, STEPS - 1)
    got = {k: v.detach() for k, v in theirs.named_parameters()}
    fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
    assert all(not torch.equal(got[k], start[k]) for k in want)

    def back(mesh: fzero.Mesh) -> Any:
        m = net()
        state = fzero.checkpoint.import_torch(sd, osd, ours(), mesh, stage=1)
        return full(steps(mesh, state, m, range(STEPS - 1, STEPS)), mesh)

    for got in run(WORLD, back):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
