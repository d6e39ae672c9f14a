"""Bytes each rank keeps per stage, measured on the real tensors, against the ZeRO formula."""

from typing import Any

import pytest
import torch
from support import make_params, mlp_loss, run

import fzero
from fzero._tree import tree_nbytes

N = 4
PARAMS = make_params([64, 96, 80, 10], torch.float32, seed=0)
PSI = sum(x.numel() for x in fzero._tree.tree_flatten(PARAMS)[0])
BATCH = (torch.randn(8, 64), torch.randn(8, 10))


def measure(mesh: fzero.Mesh, stage: int) -> dict[str, int]:
    opt = fzero.optim.adam(lr=1e-3)
    state = fzero.shard_state(PARAMS, opt, mesh, stage=stage)
    state, _ = fzero.sharded_step(mlp_loss, opt, mesh, stage=stage)(state, BATCH)
    report = fzero.memory_report(state)
    # The gradient a stage keeps is what its reduction hands the update: the full
    # all-reduced tree (stages 0-1) or this rank's reduce-scattered shard (stages 2-3).
    _, grads = fzero.value_and_grad(mlp_loss, fzero.gather_params(state.params, mesh), BATCH)
    if stage < 2:
        kept_grads = fzero.all_reduce_grads(grads, mesh)
    else:
        kept_grads = fzero.reduce_scatter_grads(grads, state.layout, mesh)
    return {
        "params": report.params,
        "grads": tree_nbytes(kept_grads),
        "opt_state": report.opt_state,
        "count": tree_nbytes(state.opt_state.count),
    }


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_rank_bytes_match_the_formula(stage: int) -> None:
    # fp32 Adam: 4-byte params and grads, 8 bytes of moments per parameter.
    want = fzero.estimate_memory(PSI, N, stage, param_bytes=4, grad_bytes=4, optim_bytes=8)
    pad = 4 * N  # fewer than N padding elements of 4 bytes per flat buffer (one bucket here)
    for got in run(N, measure, stage):
        assert want.params <= got["params"] < want.params + pad
        assert want.grads <= got["grads"] < want.grads + pad
        moments = got["opt_state"] - got["count"]  # the step counter is 8 bytes, not per-parameter
        assert want.opt_state <= moments < want.opt_state + 2 * pad


def test_estimate_memory_is_the_zero_paper_table() -> None:
    # ZeRO, section 5: Psi = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    psi = 7.5e9
    totals = [fzero.estimate_memory(psi, 64, s).total / 1e9 for s in range(4)]
    assert totals == pytest.approx([120, 31.4, 16.6, 1.875], rel=0.01)


def test_memory_report_counts_shared_storage_once() -> None:
    flat = torch.zeros(10)
    tree = {"a": flat[:4], "b": flat[4:]}
    assert tree_nbytes(tree) == 40
    assert tree_nbytes({"a": torch.zeros(3), "b": torch.zeros(3)}) == 24


def test_stage_3_keeps_a_quarter_of_the_parameters_at_four_ranks() -> None:
    def fn(mesh: fzero.Mesh) -> Any:
        return [
            fzero.memory_report(fzero.shard_state(PARAMS, fzero.optim.sgd(), mesh, stage=s)).params
            for s in (0, 3)
        ]

    for full, sharded in run(N, fn):
        assert full == 4 * PSI + 4 * (-PSI % N) and sharded * N == full
