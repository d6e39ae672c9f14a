"""Units: per-unit gather, free and reduce-scatter, against one process on the whole batch."""

import copy
import itertools
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import fzero
from fzero._core._layout import build_layout
from tests.support import run


class Net(nn.Module):
    """Linear layers; optionally one layer applied twice, a checkpointed layer, an unused one."""

    def __init__(self, dims: list[int], twice: int = -1, remat: int = -1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.unused = nn.Linear(2, 2)  # a unit no step ever calls
        self.twice, self.remat = twice, remat
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i == self.remat else layer(x)
            if i == self.twice and layer.in_features == layer.out_features:
                x = layer(torch.tanh(x))  # shared weights: the same unit called again
            x = torch.tanh(x)
        return x * self.scale


def make_case(dims: list[int], n: int, seed: int, twice: int = -1, remat: int = -1) -> dict:
    torch.manual_seed(seed)
    model = Net(dims, twice, remat).double()
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(3, 2 * n, dims[0], generator=g, dtype=torch.float64)
    ys = torch.randn(3, 2 * n, dims[-1], generator=g, dtype=torch.float64)
    return {"model": model, "xs": xs, "ys": ys, "n": n}


def reference(case: dict) -> dict[str, torch.Tensor]:
    """torch.optim.Adam on a plain copy of the module, one process, concatenated batch.

    Not through functional_call: a checkpointed layer recomputes during backward, after
    functional_call has put the module's own parameters back, so its recompute would use
    the module's initial weights. A parameter no rank uses gets a zero gradient (fzero's
    flat buffers, like FSDP's, hold a gradient for every element), so the reference sets
    one where autograd left None.
    """
    model = copy.deepcopy(case["model"])
    opt = torch.optim.Adam(model.parameters(), lr=0.05, foreach=False)
    for t in range(case["xs"].shape[0]):
        opt.zero_grad()
        ((model(case["xs"][t]) - case["ys"][t]) ** 2).mean().backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def train(mesh: fzero.Mesh, case: dict, units: list[Any] | None, stage: int, **options: Any) -> Any:
    """`options` go to sharded_step, but for `layout` and `bucket_bytes` (shard_state's)."""
    model = case["model"]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    opt = fzero.optim.adam(lr=0.05)
    ledger = fzero.UnitLedger()
    layout, bucket_bytes = options.pop("layout", "flat"), options.pop("bucket_bytes", None)
    state = fzero.shard_state(
        params, opt, mesh, stage=stage, units=units, layout=layout, bucket_bytes=bucket_bytes
    )
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, ledger=ledger, **options)
    n = case["n"]
    for t in range(case["xs"].shape[0]):
        sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
        state, _ = step(state, (case["xs"][t, sl], case["ys"][t, sl]))
        assert n == mesh.size
    return fzero.gather_params(state.params, mesh), ledger, state.layout


@st.composite
def unit_splits(draw: Any, n_layers: int, unused: bool = True) -> list[Any]:
    """Any subset of layers (and, with `unused`, maybe the unused layer), some drawn into
    groups of several submodules as one unit (in any order, adjacent or not, the unused
    layer too), or the whole stack as one unit."""
    names = [f"layers.{i}" for i in range(n_layers)] + (["unused"] if unused else [])
    chosen = draw(st.lists(st.sampled_from(names), unique=True))
    if unused and draw(st.booleans()) and not chosen:
        return ["layers"]
    out: list[Any] = []
    for name in chosen:
        if out and draw(st.booleans()):  # joins the unit before it
            last = out[-1]
            out[-1] = (*last, name) if isinstance(last, tuple) else (last, name)
        else:
            out.append(name)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=24)
@given(
    st.lists(st.integers(1, 5), min_size=2, max_size=5).flatmap(
        lambda dims: st.tuples(st.just(dims), unit_splits(len(dims) - 1))
    ),
    st.integers(1, 4),
    st.sampled_from([0, 1, 2, 3]),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["flat", "tensor"]),
)
def test_units_match_single_process(
    dims_units: tuple, n: int, stage: int, reshard: bool, prefetch: bool, hooked: bool, layout: str
) -> None:
    dims, units = dims_units
    case = make_case(dims, n, seed=len(dims) + n)
    expected = reference(case)
    options = {
        "module": case["model"] if hooked else None,
        "reshard_after_forward": reshard,
        "prefetch": prefetch,
        "layout": layout,
    }
    for params, _, _ in run(n, train, case, units, stage, **options):
        fzero.assert_trees_close(
            params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage} units {units} {options}"
        )


SHARED_SPLITS = {
    "per layer": [f"layers.{i}" for i in range(4)] + ["unused"],
    # One unit of several submodules: the twice-called layer with the checkpointed one,
    # then the last layer with the first (it runs last) and one no forward calls.
    "grouped": [("layers.1", "layers.2"), ("layers.3", "layers.0", "unused")],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("split", list(SHARED_SPLITS))
def test_shared_and_checkpointed_units(stage: int, reshard: bool, split: str) -> None:
    # Layer 1 is square and called twice; layer 2 runs under non-reentrant checkpointing,
    # so its forward runs again inside the backward and must gather its parameters again.
    case = make_case([3, 4, 4, 4, 2], 2, seed=7, twice=1, remat=2)
    units = SHARED_SPLITS[split]
    expected = reference(case)
    options = {"module": case["model"], "reshard_after_forward": reshard}
    for params, _, _ in run(2, train, case, units, stage, **options):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("how", ["checkpoint", "raise"])
def test_the_module_gets_its_own_parameters_back_after_every_step(stage: int, how: str) -> None:
    # A unit's pre-hook swaps views of the step's buffers into its submodule; its forward
    # hook puts the module's own back. Some forwards never reach that hook: torch's
    # non-reentrant checkpoint stops its recompute once it has what it needs (inside
    # layer 1's forward here), and a loss may raise inside a unit.
    case = make_case([3, 4, 4, 2], 2, seed=3, remat=1 if how == "checkpoint" else -1)
    model = case["model"]

    def fn(mesh: fzero.Mesh) -> list[str]:
        own = {(n, k): p for n, m in model.named_modules() for k, p in m._parameters.items()}
        if how == "raise":

            def boom(x: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("boom inside layer 1")

            model.layers[1].forward = boom
        params = {k: v.detach().clone() for k, v in model.named_parameters()}

        def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
            return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

        opt = fzero.optim.adam(lr=0.05)
        units = [f"layers.{i}" for i in range(3)]
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model)
        sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
        for t in range(2):
            try:
                state, _ = step(state, (case["xs"][t, sl], case["ys"][t, sl]))
            except RuntimeError as exc:
                assert how == "raise" and "boom" in str(exc)
        now = {(n, k): p for n, m in model.named_modules() for k, p in m._parameters.items()}
        return [f"{n}.{k}" for (n, k), p in now.items() if p is not own[(n, k)]]

    for swapped in run(2, fn):
        assert swapped == [], f"left holding the step's views instead of its own: {swapped}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_stage3_holds_at_most_two_units_and_one_unit_of_gradients(
    prefetch: bool, overlap: bool
) -> None:
    """The engine's schedule, as its UnitLedger counts what it gathers and frees; the
    memory itself is measured on the process in tests/e2e/test_memory.py (resident bytes
    of a 16-unit MLP's steps, and the same bound rejecting units kept whole)."""
    case = make_case([6, 8, 8, 8, 8, 3], 2, seed=3)
    units = [f"layers.{i}" for i in range(5)]
    (_params, ledger, layout), _ = run(
        2, train, case, units, 3, module=case["model"], prefetch=prefetch, overlap_reduce=overlap
    )
    unit_bytes = {u: layout.unit_numel(u) * 8 for u in layout.units}
    largest = sorted(unit_bytes[u] for u in units)
    root = unit_bytes[""]  # gathered before the forward, kept until its reduce-scatter
    assert ledger.peak_params <= root + (2 if prefetch else 1) * largest[-1]
    # One burst of full gradients (a unit, or consecutive units no larger together than
    # the largest); with overlap, also the one whose reduce-scatter is in flight.
    assert ledger.peak_grads <= largest[-1] * (2 if overlap else 1)
    assert ledger.live_params == 0 and ledger.live_grads == 0  # all freed after the step
    if not prefetch:  # and it really is per unit: the whole model is never resident at once
        assert ledger.peak_params < sum(unit_bytes.values())


@pytest.mark.multiprocess
@pytest.mark.parametrize("overlap", [True, False])
def test_stage2_reduces_one_unit_of_gradients_at_a_time(overlap: bool) -> None:
    """The engine's schedule by its UnitLedger (memory measured: tests/e2e/test_memory.py)."""
    case = make_case([6, 8, 8, 8, 3], 2, seed=4)
    units = [f"layers.{i}" for i in range(4)]
    (_params, ledger, layout), _ = run(
        2, train, case, units, 2, module=case["model"], overlap_reduce=overlap
    )
    assert ledger.peak_params == 0  # nothing gathered: stage 2 keeps full parameters anyway
    sizes = sorted(layout.unit_numel(u) * 8 for u in layout.units)
    assert ledger.peak_grads <= sizes[-1] * (2 if overlap else 1)  # a burst, maybe two
    assert ledger.peak_grads < sum(sizes)  # never all full gradients at once


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("bucket", [0, 300, 25 * 2**20])
@pytest.mark.parametrize("n", [2, 3])
def test_reduce_buckets_train_like_one_process_and_hold_reductions(
    stage: int, bucket: int, n: int
) -> None:
    # Stages 0-1 gather complete unit gradients into bursts of `reduce_bucket_bytes`:
    # with 0 every unit is its own burst; with 25 MiB (more than this model has) the
    # whole model is one. Each burst is one collective (an all-reduce at stage 0, a
    # reduce-scatter at stage 1), whose buffer the units' gradients are written into, and
    # starts inside the backward as soon as no further gradient can join it: the last
    # with the root's gradient, the last to arrive.
    case = make_case([4, 6, 6, 3], n, seed=3)
    expected = reference(case)
    units = ["layers.0", "layers.1", "layers.2", "unused"]
    name = "all_reduce_async" if stage == 0 else "reduce_scatter_async"
    original = getattr(fzero._comm, name)

    def traced(fn: Any) -> Any:
        def reduce(mesh: fzero.Mesh, *args: Any, **kwargs: Any) -> Any:
            inside: list[bool] = []

            def spy(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                if t.numel() > 1:  # gradients, not the one-element loss-scale flags
                    inside.append(torch._C._current_graph_task_id() != -1)
                return original(t, *a, **k)

            setattr(fzero._comm, name, spy)  # in this rank's own (forked) process
            return fn(mesh, *args, **kwargs), inside

        return reduce

    results = run(
        n, traced(train), case, units, stage, module=case["model"], reduce_bucket_bytes=bucket
    )
    for (params, ledger, layout), inside in results:
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{bucket=}")
        if stage == 1 and bucket == 0:
            # A burst (here one unit) is finished when the next unit's gradient arrives:
            # one unit's full gradients alive at a time, not every unit's until the end.
            per_unit: dict[str, int] = {}
            for b in layout.buckets:
                per_unit[b.unit] = per_unit.get(b.unit, 0) + b.full_numel * 8
            assert 0 < ledger.peak_grads <= max(per_unit.values())
        steps = case["xs"].shape[0]
        units_run = 4 * steps  # three layers and the root ("unused" never runs)
        assert all(inside)
        if bucket == 0:  # each unit on its own
            assert len(inside) == units_run
        if bucket == 300:  # layers 2 and 1 on their own, layer 0 with the root
            assert len(inside) == 3 * steps
        if bucket == 25 * 2**20:  # one burst
            assert len(inside) == steps


def test_reduce_bucket_bytes_is_checked() -> None:
    opt = fzero.optim.sgd()
    with pytest.raises(ValueError, match="reduce_bucket_bytes must be >= 0"):
        fzero.sharded_step(lambda p, b: p, opt, None, stage=0, reduce_bucket_bytes=-1)
    with pytest.raises(TypeError, match="reduce_bucket_bytes must be an int"):
        fzero.sharded_step(lambda p, b: p, opt, None, stage=0, reduce_bucket_bytes=1.5)


def test_unit_prefixes_match_whole_path_components() -> None:
    params = {f"layers.{i}.w": torch.zeros(2) for i in (1, 10, 11)} | {"head": torch.zeros(1)}
    layout = build_layout(params, 2, units=["layers.1", "layers"])
    owner = {s.path: b.unit for b in layout.buckets for s in b.slots}
    assert owner == {
        "layers.1.w": "layers.1",
        "layers.10.w": "layers",
        "layers.11.w": "layers",
        "head": "",
    }
    with pytest.raises(ValueError, match="matches no parameter"):
        build_layout(params, 2, units=["layer"])
    with pytest.raises(ValueError, match="duplicates"):
        build_layout(params, 2, units=["head", "head"])


def test_unit_policies() -> None:
    model = Net([4, 8, 8, 2])
    assert fzero.units.by_module(model, nn.Linear) == ["layers.0", "layers.1", "layers.2", "unused"]
    params = dict(model.named_parameters())
    # 40 and 72 parameters per big layer; the rest (18 + 6 + 1) stays in the root.
    assert fzero.units.by_size(params, 30) == ["layers.0", "layers.1"]
    # Neither reaches 100 alone: the two together are one unit of two submodules, and the
    # last layer (18) is left to the root. At 120 the run takes every layer: "layers".
    assert fzero.units.by_size(params, 100) == [("layers.0", "layers.1")]
    assert fzero.units.by_size(params, 120) == ["layers"]
    with pytest.raises(ValueError, match="no submodule"):
        fzero.units.by_module(model, nn.Conv1d)


@pytest.mark.multiprocess
def test_unit_param_used_outside_its_module_fails_loudly() -> None:
    case = make_case([3, 3, 2], 1, seed=1)
    model = case["model"]

    def fn(mesh: fzero.Mesh) -> None:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}

        def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (x,)).sum() + p["layers.0.weight"].sum()

        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=3, units=["layers.0"])
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model)
        step(state, case["xs"][0])

    with pytest.raises(ValueError, match="outside its submodule's forward"):
        run(1, fn)


def _batches(n: int, extra: Any, steps: int = 3) -> list[list[tuple]]:
    """`steps` steps of `n` micro-batches (x: 3 x 4, y: 3 x 2, then `extra(rank)`)."""
    g = torch.Generator().manual_seed(1)
    return [
        [
            (
                torch.randn(3, 4, generator=g, dtype=torch.float64),
                torch.randn(3, 2, generator=g, dtype=torch.float64),
                *extra(r),
            )
            for r in range(n)
        ]
        for _ in range(steps)
    ]


class _PartlyUsed(nn.Module):
    """A unit whose forward leaves one of its own parameters unused."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.spare = nn.Parameter(torch.randn(3))  # never touched by forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_a_unit_leaf_its_forward_never_uses_trains_like_one_process(n: int) -> None:
    # The unit's node hands out every leaf; an unused one gets no gradient (None), so its
    # place in the bucket (and, at stage 0, in the burst) must be written as zero: stale
    # memory there would be all-reduced into the neighbours' means or the spare's update.
    torch.manual_seed(0)
    model = nn.Sequential(_PartlyUsed(4), _PartlyUsed(4), nn.Linear(4, 2)).double()

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    fzero.testing.assert_stages_equivalent(
        loss_fn,
        dict(model.named_parameters()),
        _batches(n, lambda r: ()),
        (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
        units=["0", "1", "2"],
        module=model,
    )


class _Skip(nn.Module):
    """Three layers; the middle one always runs, but its output reaches the loss only when
    the batch says so (a rank-dependent branch, as a per-rank flag or data would make)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        mid = self.b(h)
        return self.c(mid if bool(use) else h)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("hooks", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_a_unit_whose_output_reaches_the_loss_on_some_ranks_only(n: int, hooks: bool) -> None:
    # Rank 0's backward reduces unit "b" between "c" and "a"; the other ranks' never runs
    # it. Reductions pair up across ranks by the order they start in, so the others must
    # reduce zeros for "b" in that same place: reduced later (after "a"), rank 0's "b"
    # would be summed with the others' "a" (same size here), silently wrong on every
    # stage, and at stage 0 one burst would be larger than the others' (gloo aborts).
    torch.manual_seed(0)
    model = _Skip().double()

    def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
        x, y, use = batch
        return nn.functional.mse_loss(functional_call(model, p, (x, use)), y)

    fzero.testing.assert_stages_equivalent(
        loss_fn,
        dict(model.named_parameters()),
        _batches(n, lambda r: (torch.tensor(r == 0),)),
        (torch.optim.Adam, {"lr": 0.1}),
        units=["a", "b", "c"],
        module=model if hooks else None,
        timeout=120,
    )


class _Route(nn.Module):
    """A rank-dependent branch between two units of one size (a router's experts): `b` where
    `use_b` (rank 0 below), `c` elsewhere, so the ranks call different units."""

    def __init__(self, dout: int = 4) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, dout)
        self.d = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_b:
            return self.d(self.b(h))
        out = self.c(h)
        return self.d(out) if out.shape[-1] == 4 else out  # dout 2: d skipped too


def _called_differently(mesh: fzero.Mesh, stage: int, dout: int) -> tuple[str, bool]:
    """One step where rank 0 calls a, b, d and the others a, c (dout 4: then d; 2: not);
    returns the error and whether this rank's parameters are still the initial ones."""
    torch.manual_seed(0)
    model = _Route(dout).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.1)
    units = ["a", "b", "c", "d"]
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=units)

    def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (x, mesh.rank == 0)).square().mean()

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=units, module=model)
    with pytest.raises(ValueError) as err:
        step(state, torch.randn(3, 4, dtype=torch.float64))
    after = fzero.master_params(state, mesh)
    return str(err.value), all(torch.equal(after[k], v) for k, v in params.items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ranks_calling_different_units_fail_alike_and_leave_the_state(stage: int) -> None:
    # b and c have one size: without the check the ranks' reductions (and stage 3's
    # gathers) pair b with c and every stage trains silently wrong (|Δ| 0.09-0.5 against
    # torch.optim on one process).
    for message, untouched in run(2, _called_differently, stage, 4):
        assert "rank 0: 'a', 'b', 'd'; rank 1: 'a', 'c', 'd'" in message
        assert untouched


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_unit_skipped_on_some_ranks_fails_alike_instead_of_aborting(stage: int) -> None:
    # Without the check: a gloo size-mismatch abort (signal 6) at stage 0, the collective
    # timeout at stages 1-2. Stage 3 gathers in the forward, before any check can run, so
    # there the mismatch is still gloo's abort.
    for message, untouched in run(3, _called_differently, stage, 2):
        assert "rank 0: 'a', 'b', 'd'; rank 1: 'a', 'c'; rank 2: 'a', 'c'" in message
        assert untouched


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bucket_bytes_makes_units_of_that_size_that_train_like_one_process(stage: int) -> None:
    # Layers of 36, 42, 42 and 21 float64 parameters; 300 bytes is 37 parameters, so the
    # middle layers are units of their own and the first and last (57 together) make the
    # unit "layers" (a ModuleList: gathered before the forward), as FairScale's auto_wrap
    # would; the unused layer and the scale stay in the root.
    case = make_case([5, 6, 6, 6, 3], 2, seed=11)
    expected = reference(case)
    options = {"bucket_bytes": 300, "module": case["model"]}
    for params, _, layout in run(2, train, case, None, stage, **options):
        assert layout.units == ("", "layers", "layers.1", "layers.2"), layout.units
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bucket_bytes_joins_runs_of_small_layers_that_train_like_one_process(stage: int) -> None:
    # Layers of 15, 12, 12, 12 and 8 float64 parameters; 200 bytes is 25 parameters, which
    # no layer holds alone: runs of consecutive layers become units of several submodules,
    # entered by their module hooks, and the short tail (8) is left to the root.
    case = make_case([4, 3, 3, 3, 3, 2], 2, seed=5)
    expected = reference(case)
    options = {"bucket_bytes": 200, "module": case["model"], "reshard_after_forward": stage == 3}
    for params, _, layout in run(2, train, case, None, stage, **options):
        assert layout.units == ("", "layers.0+layers.1", "layers.2+layers.3+layers.4")
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"stage {stage}")
    assert not torch.equal(expected["layers.0.weight"], case["model"].layers[0].weight)


@pytest.mark.multiprocess
def test_a_stage3_unit_of_another_size_skipped_on_some_ranks_fails_fast() -> None:
    # Stage 3 gathers a unit in its forward pre-hook, before the call check of the other
    # stages can run: rank 0 gathers b (4x4) while the others gather c (4x2). Gloo refuses
    # the mismatched sizes and the ranks die; the point is that it fails within seconds
    # and is reported, not that it hangs to the collective timeout or trains.
    start = time.monotonic()
    with pytest.raises((fzero.RankFailure, ValueError, RuntimeError)):
        run(3, _called_differently, 3, 2)
    assert time.monotonic() - start < 20


@pytest.mark.multiprocess
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_resharded_unit_at_a_freed_units_address_trains_like_one_process(prefetch: bool) -> None:
    # Gloo's worker thread lets go of a finished gather's buffer when it gets round to it,
    # so a buffer `left` freed can outlive its memory, and the allocator hands its address
    # to a later unit's gather. When the old buffer object finally died it used to forget
    # that address, now the later unit's: its parameters were then saved for the backward
    # outright and freed under it ("storage of size 0"; intermittent on models of many
    # equal small units). Here every gathered buffer is held two gathers longer, as the
    # backend might, so the reuse happens every time.
    import fzero._engine._gatherer as gatherer_module

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(24, 24) for _ in range(8))).double()
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 4, 24, generator=g, dtype=torch.float64)
    ys = torch.randn(3, 4, 24, generator=g, dtype=torch.float64)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False)
    for t in range(3):
        opt_ref.zero_grad()
        ((ref(xs[t]) - ys[t]) ** 2).mean().backward()
        opt_ref.step()
    expected = {k: v.detach() for k, v in ref.named_parameters()}

    def fn(mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
        real_gather, real_open = (
            gatherer_module._comm.all_gather_async,
            gatherer_module.Gatherer.open,
        )
        backend: list[torch.Tensor] = []

        def gather(*args: Any, **kwargs: Any) -> Any:
            out, work = real_gather(*args, **kwargs)
            backend.append(out)
            return out, work

        def open_(self: Any, entry: Any, jit: bool) -> Any:
            fulls = real_open(self, entry, jit)
            del backend[:-2]  # the backend lets go of the older buffers only now
            return fulls

        params = {k: v.detach().clone() for k, v in model.named_parameters()}

        def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
            return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

        opt = fzero.optim.adam(lr=0.05)
        units = fzero.units.by_module(model, nn.Linear)
        state = fzero.shard_state(params, opt, mesh, stage=3, units=units)
        step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, prefetch=prefetch)
        sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
        gatherer_module._comm.all_gather_async, gatherer_module.Gatherer.open = gather, open_
        try:
            for t in range(3):
                state, _ = step(state, (xs[t, sl], ys[t, sl]))
        finally:
            gatherer_module._comm.all_gather_async = real_gather
            gatherer_module.Gatherer.open = real_open
        return fzero.gather_params(state.params, mesh)

    for params in run(2, fn):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what="stage 3")
        assert not torch.equal(params["0.weight"], model[0].weight.detach())


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.inner = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)])


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.blocks = torch.nn.ModuleList([_Block(), _Block(), _Block()])
        self.heads = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 5))
        self.shared = torch.nn.ModuleList([torch.nn.Linear(3, 3, bias=False) for _ in range(2)])
        self.shared[1].weight = self.shared[0].weight


def test_units_auto_takes_outermost_repeated_blocks_and_follows_ties() -> None:
    net = _Net()
    # blocks.k: outermost (their inner lists are not units); heads: two Linear, repeated;
    # shared.1: its only parameter is shared.0's, so dict(named_parameters()) lacks it.
    assert fzero.units.auto(net) == [
        "blocks.0", "blocks.1", "blocks.2", "heads.0", "heads.1", "shared.0",
    ]  # fmt: skip
    params = dict(net.named_parameters())
    [members] = run(
        1,
        lambda mesh: (
            fzero.shard_state(
                params, fzero.optim.sgd(), mesh, stage=3, units=fzero.units.auto(net)
            ).layout.members
        ),
    )
    assert len(members) == 7  # the six blocks and the root


@pytest.mark.multiprocess
def test_a_cleared_ledger_records_the_next_step_alone() -> None:
    """A ledger watching a long run grew by every unit event of every step (1.7 GB a
    million steps on a small model, a long-run reader's find): `clear()` between steps
    keeps one step's events, the peaks restarting from what lives."""
    case = {"model": torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))}

    def fn(mesh: fzero.Mesh) -> list[Any]:
        params = {k: v.detach().clone() for k, v in case["model"].named_parameters()}
        opt = fzero.optim.sgd(lr=0.1)
        ledger = fzero.UnitLedger()
        state = fzero.shard_state(params, opt, mesh, stage=3, units=["0", "1"])
        step = fzero.sharded_step(
            lambda p, x: functional_call(case["model"], p, (x,)).square().mean(),
            opt, mesh, stage=3, units=["0", "1"], ledger=ledger, module=case["model"],
        )  # fmt: skip
        seen = []
        for _ in range(3):
            state, _ = step(state, torch.ones(2, 3))
            seen.append((list(ledger.events), ledger.peak_params, ledger.peak_grads))
            ledger.clear()
            assert ledger.events == [] and ledger.peak_params == ledger.live_params == 0
        return seen

    for seen in run(2, fn):
        assert seen[0][0] and seen[1] == seen[2]  # the same step, recorded alone
        assert seen[1][1] > 0 and seen[1][2] > 0
