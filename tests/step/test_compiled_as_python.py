"""A compiled step run as Python (`torch.compiler.set_stance("force_eager")`, or frames
dynamo skips): stages 0-2's gradient receivers are joined without storage, and the step
trains as one process does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fzero
from fzero._step._entries import joined_receivers
from tests.step.test_compiled import train
from tests.step.test_weights import DIMS, make_data, reference
from tests.support import make_params, run


def test_stand_ins_are_joined_without_storage_and_split_their_gradient_back() -> None:
    shapes = [(3, 4), (5,), (2, 1, 2)]
    stand_ins = [torch.zeros((), dtype=torch.float64).expand(s).requires_grad_() for s in shapes]
    joint = joined_receivers(stand_ins)
    total = sum(x.numel() for x in stand_ins)
    assert joint.shape == (total,) and joint.dtype == torch.float64
    # What `cat` would have written: `total` zeros. The joint holds one element.
    assert joint.untyped_storage().nbytes() == joint.element_size(), joint.stride()
    weights = torch.arange(total, dtype=torch.float64)
    (joint * weights).sum().backward()
    for x, want in zip(stand_ins, weights.split([x.numel() for x in stand_ins])):
        assert x.grad is not None and x.grad.shape == x.shape
        assert torch.equal(x.grad.reshape(-1), want)


def as_python(mesh: fzero.Mesh, *args: Any) -> Any:
    """`test_compiled.train` with torch.compile's stance "force_eager" in this rank."""
    torch.compiler.set_stance("force_eager")
    return train(mesh, *args)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_compiled_step_run_as_python_trains_like_one_process(stage: int) -> None:
    """Every unit's buckets in one burst (25 MiB), so each entry joins several receivers;
    two steps of uneven pairs, float64 AdamW against one-process torch.optim."""
    params = make_params(DIMS, torch.float64, 3)
    data = [[per_rank[:1] for per_rank in step] for step in make_data([[[2], [3]]] * 2, 3)]
    want = reference(params, data, "pair", "adamw")
    got = run(2, as_python, params, data, "pair", stage, "flat", "aot_eager")
    for rank, (p, graphs) in enumerate(got):
        fzero.assert_trees_close(p, want, rtol=1e-10, atol=1e-12, what=f"rank {rank}")
        assert graphs == 0, graphs  # run as Python: nothing compiled
    assert fzero._core._tree.max_abs_diff(got[0][0], params) > 1e-4
