"""The communication ledger: every stage moves the ZeRO paper's volume per step."""

from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero


class Net(nn.Module):
    """Four unit layers and a root parameter (the root unit is gathered once per step)."""

    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        h = d_hidden
        self.layers = nn.Sequential(
            nn.Linear(d_in, h),
            nn.Tanh(),
            nn.Linear(h, h),
            nn.Tanh(),
            nn.Linear(h, h),
            nn.Tanh(),
            nn.Linear(h, 3),
        )
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * self.scale


UNITS = ["layers.0", "layers.2", "layers.4", "layers.6"]


def volumes(
    mesh: fzero.Mesh, dims: tuple[int, int], stage: int, hooks: bool = False, **options: Any
) -> Any:
    """Per-step logical elements by op, for steps 2 and 3 (step 1 learns the call order)."""
    torch.manual_seed(0)
    model = Net(*dims).double()
    if hooks:
        options["module"] = model
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS)

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x,)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=UNITS, **options)
    per_step = []
    for i in range(3):
        with fzero.comm_ledger() as ledger:
            state, _ = step(state, torch.randn(2, dims[0], dtype=torch.float64))
        ops: dict[str, int] = {}
        control = [(r.op, r.dtype, r.elements) for r in ledger.records if r.control]
        # Each step opens with the ranks' call names (8 words and a refusal flag).
        if mesh.size > 1:
            assert control[0] == ("all_gather", torch.int64, 9 * mesh.size)
            control = control[1:]
        # One small all-gather: the check's header (the calls' count and digest, presence,
        # the micro-batch count, a loss error: 5 words), with hooks at stage 3 resharding a
        # word of flags (which units a backward uses the parameters of), then each rank's
        # losses' weights, calls of each kind, presence and total (5 words). The first
        # step agrees on the configuration before that (sizes, then the bytes).
        flags = 1 if stage == 3 and hooks and options.get("reshard_after_forward", True) else 0
        tally = ("all_gather", torch.int64, (10 + flags) * mesh.size)
        if i == 0 and mesh.size > 1:
            assert [c[:2] for c in control[:2]] == [
                ("all_gather", torch.int64),
                ("all_gather", torch.uint8),
            ]
            control = control[2:]
            # After the first step's backward: which leaves no rank's loss used, a bit
            # per leaf in one int64 word a rank (fzero._step._unused).
            assert control[1:] == [("all_gather", torch.int64, mesh.size)]
            control = control[:1]
        assert control == ([tally] if mesh.size > 1 else [])
        for r in ledger.data:
            assert r.dtype == torch.float64
            ops[r.op] = ops.get(r.op, 0) + r.elements
        per_step.append(ops)
    lay = state.layout
    padded = {b.unit: b.full_numel for b in lay.buckets}  # Ψ per unit, with padding
    return per_step[1:], padded, lay.numel


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=8)
@given(
    n=st.integers(2, 4),
    dims=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    stage=st.integers(0, 3),
    reshard=st.booleans(),
    prefetch=st.booleans(),
)
@example(n=2, dims=(3, 4), stage=3, reshard=True, prefetch=True)
@example(n=3, dims=(3, 4), stage=3, reshard=True, prefetch=False)
def test_each_stage_moves_the_zero_volume(
    n: int, dims: tuple, stage: int, reshard: bool, prefetch: bool
) -> None:
    """Stages 0-2 move 2Ψ per step, stage 3 3Ψ when it reshards after the forward and 2Ψ
    when it keeps. Resharding gathers again neither the root unit (gathered once and kept,
    as in FSDP) nor the forward's last unit (with prefetch its last two), which stay
    gathered for the backward that starts with them, nor the first layer: its input needs
    no gradient, so autograd saves not its weight, and no backward uses its parameters."""
    opts = {"hooks": True, "reshard_after_forward": reshard, "prefetch": prefetch}
    opts = opts if stage == 3 else {}
    steps, padded, numel = fzero.simulate(n, volumes, dims, stage, **opts)[0]
    psi = sum(padded.values())
    assert numel <= psi < numel + n * len(padded)  # padding: < n elements per buffer
    regathered = sum(padded[u] for u in UNITS[1 : -2 if prefetch else -1])
    expected = {
        0: {"all_reduce": 2 * psi},
        1: {"reduce_scatter": psi, "all_gather": psi},
        2: {"reduce_scatter": psi, "all_gather": psi},
        3: {"reduce_scatter": psi, "all_gather": psi + (regathered if reshard else 0)},
    }[stage]
    assert steps == [expected, expected]


@pytest.mark.multiprocess
def test_stage3_without_module_hooks_gathers_once() -> None:
    """Without `module=` every unit is gathered before the forward and kept: 2Ψ."""
    steps, padded, _ = fzero.simulate(2, volumes, (4, 5), 3)[0]
    psi = sum(padded.values())
    assert steps == [{"reduce_scatter": psi, "all_gather": psi}] * 2


def primitives(mesh: fzero.Mesh) -> Any:
    params = {"w": torch.randn(5, 3), "b": torch.randn(())}
    state = fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=3)
    with fzero.comm_ledger() as outer:
        full = fzero.gather_params(state.params, mesh)
        with fzero.comm_ledger() as inner:
            fzero.reduce_scatter_grads(full, state.layout, mesh)
    return outer.records, inner.data, outer.by_op(data_only=True), sum(r.nbytes for r in inner.data)


@pytest.mark.multiprocess
def test_primitives_record_and_ledgers_nest() -> None:
    """The data each primitive moves, and beside it (`control`) each call's name: the
    primitives by hand are fzero calls, checked to be the same call on every rank."""
    outer, inner, by_op, nbytes = fzero.simulate(2, primitives)[0]
    padded = 16  # 16 elements: 15 + 1 padded to a multiple of 2
    assert [(r.op, r.elements, r.control) for r in outer] == [
        ("all_gather", 2 * 9, True),  # gather_params's name (8 words), a refusal flag
        ("all_gather", padded, False),
        ("all_gather", 2 * 9, True),
        ("reduce_scatter", padded, False),
    ]
    assert [(r.op, r.elements) for r in inner] == [("reduce_scatter", padded)]
    assert by_op == {"all_gather:float32": 4 * padded, "reduce_scatter:float32": 4 * padded}
    assert nbytes == 4 * padded


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_one_rank_sends_nothing(stage: int) -> None:
    steps, _, _ = fzero.simulate(1, volumes, (3, 4), stage)[0]
    assert steps == [{}, {}]
