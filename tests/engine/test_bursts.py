"""Bursts: several buckets in one collective, each way.

Stage 1's gradients are written rank by rank into one buffer per burst and
reduce-scattered as one; stages 1-2 gather the updated shards of a burst of buckets as
one all-gather. Checked against buffers built by hand and one-process `torch.optim`.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import functional_call

import fzero
from fzero._core._flat import paste
from fzero._core._layout import build_layout
from tests.core.test_layout import trees
from tests.engine.test_units import make_case, reference, train
from tests.support import run


@given(trees(), st.integers(1, 6), st.sampled_from(["flat", "tensor"]), st.data())
def test_paste_lays_a_bucket_out_rank_by_rank(tree: dict, n: int, kind: str, data: Any) -> None:
    # The reference is the bucket's flat gradient built by hand (each leaf's gradient at
    # its offset, divided in the buffer's dtype, zeros elsewhere), cut into n rows; the
    # burst's rows are wider than the bucket's columns, and the columns around them must
    # stay untouched. Leaves go through both of paste's ways (one call for all small
    # leaves, one per large leaf) as the threshold drawn puts them; gradients narrower
    # than the buffer (bfloat16 into float32) are divided after widening.
    layout = build_layout(tree, n, kind)
    divisor = data.draw(st.sampled_from([1, 3]))
    small = data.draw(st.sampled_from([0, 2, 1 << 15]))
    narrow = data.draw(st.booleans())
    for bucket in layout.buckets:
        dtype = torch.float32 if narrow and bucket.dtype == torch.float64 else bucket.dtype
        grads = [
            None if data.draw(st.booleans()) else torch.randn(s.shape, dtype=dtype)
            for s in bucket.ordered
        ]
        flat = torch.zeros(bucket.full_numel, dtype=bucket.dtype)
        for s, g in zip(bucket.ordered, grads):
            if g is not None:
                flat[s.offset : s.offset + s.numel] = g.reshape(-1).to(bucket.dtype) / divisor
        lead, trail = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        rows = torch.full((n, lead + bucket.shard_numel + trail), float("nan"), dtype=bucket.dtype)
        columns = rows[:, lead : lead + bucket.shard_numel]
        line = torch.full((bucket.full_numel + 2,), float("nan"), dtype=bucket.dtype)
        with _small_leaves(small):
            paste(bucket, grads, columns, divisor)
            paste(bucket, grads, line[1:-1], divisor)  # the 1-D form: the buffer end to end
        assert torch.equal(columns, flat.view(n, bucket.shard_numel))
        assert rows[:, :lead].isnan().all() and rows[:, lead + bucket.shard_numel :].isnan().all()
        assert torch.equal(line[1:-1], flat) and line[[0, -1]].isnan().all()


@contextlib.contextmanager
def _small_leaves(elements: int) -> Iterator[None]:
    saved, fzero._core._flat._SMALL = fzero._core._flat._SMALL, elements
    try:
        yield
    finally:
        fzero._core._flat._SMALL = saved


def test_paste_of_transposed_and_straddling_gradients_matches_by_hand() -> None:
    # Non-contiguous gradients (a transposed weight's), and leaves that straddle rows,
    # above and below the small-leaf threshold.
    tree = {"a": torch.randn(3, 5), "b": torch.randn(40, 1000), "c": torch.randn(7)}
    layout = build_layout(tree, 3, "flat")
    (bucket,) = layout.buckets
    grads = [torch.randn(s.shape[::-1]).t() for s in bucket.ordered]
    flat = torch.zeros(bucket.full_numel)
    for s, g in zip(bucket.ordered, grads):
        flat[s.offset : s.offset + s.numel] = g.reshape(-1) / 3
    out = torch.full((3, bucket.shard_numel), float("nan"))
    paste(bucket, grads, out, 3)
    assert torch.equal(out, flat.view(3, -1))


def _gather_many(mesh: fzero.Mesh) -> list[torch.Tensor]:
    # Three buffers: one whose own slice already holds the shard (a donated update in
    # place), one that does not, one cast on the way (float64 shards into float32 full
    # buffers, travelling in float32).
    sizes = [3, 1, 4]
    shards = [
        torch.arange(k, dtype=torch.float64) + 10 * mesh.rank + 100 * i for i, k in enumerate(sizes)
    ]
    outs = [torch.zeros(k * mesh.size, dtype=torch.float64) for k in sizes[:2]]
    outs.append(torch.zeros(sizes[2] * mesh.size, dtype=torch.float32))
    outs[0][mesh.rank * 3 : mesh.rank * 3 + 3] = shards[0]
    shards[0] = outs[0][mesh.rank * 3 : mesh.rank * 3 + 3]  # in place
    fzero._comm.all_gather_many_async(shards[:2], outs[:2], mesh, torch.float64).wait()
    fzero._comm.all_gather_many_async(shards[2:], outs[2:], mesh, torch.float32).wait()
    # In place but travelling narrower: every rank's copy, its own included, is rounded
    # through float32, so the replicas agree.
    third = torch.zeros(2 * mesh.size, dtype=torch.float64)
    own = third[mesh.rank * 2 : mesh.rank * 2 + 2]
    own.copy_(torch.tensor([1 / 3, 2 / 3], dtype=torch.float64) + mesh.rank)
    fzero._comm.all_gather_many_async(
        [own, shards[1]], [third, outs[1]], mesh, torch.float32
    ).wait()
    return [*outs, third]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_all_gather_many_fills_every_buffer_in_rank_order(n: int) -> None:
    sizes = [3, 1, 4]
    expected = [
        torch.cat([torch.arange(k, dtype=torch.float64) + 10 * r + 100 * i for r in range(n)])
        for i, k in enumerate(sizes)
    ]
    thirds = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64) + torch.arange(n)[:, None]
    expected.append(thirds.reshape(-1).float().double())
    for outs in run(n, _gather_many):
        assert len(outs) == len(expected)
        for got, want in zip(outs, expected):
            assert torch.equal(got, want.to(got.dtype))


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket", [0, 400, 25 * 2**20])
@pytest.mark.parametrize("donate", [True, False])
def test_updated_shards_travel_in_bursts_and_train_like_one_process(
    stage: int, bucket: int, donate: bool
) -> None:
    # With 0 each bucket is gathered by itself; with 400 bytes a few buckets at a time
    # (never more than 400 bytes of full buffers in one collective); with 25 MiB all of
    # them (four trainable buckets: three layers and the root) in one.
    case = make_case([4, 6, 6, 3], 3, seed=4)
    expected = reference(case)
    units = ["layers.0", "layers.1", "layers.2"]
    original = fzero._comm.all_gather_many_async

    def traced(mesh: fzero.Mesh) -> Any:
        calls: list[tuple[int, int]] = []  # (buffers, full bytes) per burst

        def spy(shards: list, outs: list, m: Any, dtype: torch.dtype) -> Any:
            calls.append((len(outs), sum(o.numel() for o in outs) * dtype.itemsize))
            return original(shards, outs, m, dtype)

        fzero._comm.all_gather_many_async = spy  # in this rank's own (forked) process
        out = train(
            mesh,
            case,
            units,
            stage,
            module=case["model"],
            reduce_bucket_bytes=bucket,
            donate=donate,
        )
        return out, calls

    steps = case["xs"].shape[0]
    for (params, _ledger, layout), calls in run(3, traced):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{bucket=}")
        trainable = sum(not b.frozen for b in layout.buckets)
        if bucket == 0:
            assert calls == []
        elif bucket == 400:
            assert calls and all(k > 1 and nbytes <= 400 for k, nbytes in calls)
        else:
            assert calls == [(trainable, calls[0][1])] * steps


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_a_buffer_above_the_pack_bound_is_gathered_alone_at_two_ranks(n: int) -> None:
    # Packing copies a buffer into the burst and out of it again: at two ranks, beyond the
    # bound (here 200 bytes) a buffer travels by itself, straight into place. Layer 0's
    # 240 bytes of float64 go alone; layers 1 and 2 (112 and 48 bytes) still travel
    # together. With more ranks a lone gather costs one collective per rank: all pack.
    case = make_case([4, 6, 2, 2], n, seed=5)
    expected = reference(case)
    original = fzero._comm.all_gather_many_async

    def traced(mesh: fzero.Mesh) -> Any:
        largest: list[int] = []  # per burst: its largest full buffer's bytes

        def spy(shards: list, outs: list, m: Any, dtype: torch.dtype) -> Any:
            largest.append(max(o.numel() for o in outs) * dtype.itemsize)
            return original(shards, outs, m, dtype)

        fzero._comm.all_gather_many_async = spy
        fzero._engine._by_hand._PACK_MAX_BYTES = 200
        units = ["layers.0", "layers.1", "layers.2"]
        return train(mesh, case, units, 1, module=case["model"]), largest

    for (params, _ledger, _layout), largest in run(n, traced):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        assert largest, "nothing was packed"
        assert (max(largest) <= 200) == (n == 2), largest


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(("n", "bursts"), [(2, [42, 42]), (3, [42, 36, 9])])
def test_small_units_share_a_reduce_scatter_no_larger_than_the_largest_unit(
    stage: int, n: int, bursts: list[int]
) -> None:
    # Stages 2-3 hold at most two units' worth of full gradients, so a burst may be as
    # large as the largest unit: layer 3 (42 elements) goes alone, and the units its
    # backward reaches next, layers 2, 1 and 0 and the root (18, 6, 10 and 7 elements,
    # each padded to a multiple of n), share one while they fit, as embeddings and norms
    # do in a transformer. Each burst is one reduce-scatter; its input is recorded here.
    case = make_case([4, 2, 2, 6, 6], n, seed=6)
    expected = reference(case)
    units = [f"layers.{i}" for i in range(4)]
    original = fzero._comm.reduce_scatter_async

    def traced(mesh: fzero.Mesh) -> Any:
        sizes: list[int] = []

        def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            sizes.append(t.numel())
            return original(t, *args, **kwargs)

        fzero._comm.reduce_scatter_async = spy  # in this rank's own (forked) process
        return train(mesh, case, units, stage, module=case["model"]), sizes

    for (params, ledger, layout), sizes in run(n, traced):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"{stage=}")
        assert [layout.unit_numel(u) for u in ("", *units)] == [
            7 + (-7 % n),
            10 + (-10 % n),
            6,
            18,
            42,
        ]
        assert sizes == bursts * case["xs"].shape[0]
        assert ledger.peak_grads <= 2 * 42 * 8  # the bound: two of the largest unit


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_a_stage1_burst_is_sized_to_the_units_that_fill_it(n: int) -> None:
    # A burst's rows are reduce-scattered as one tensor: a burst closed with columns to
    # spare would be copied into a narrower one first. Bursts are sized from the units
    # that will join them (here 560 bytes, room for two layers of 240 but not three:
    # layers 3 and 2, then layers 1 and 0 with the root), so each reduce-scatter sends
    # the burst's own buffer, a view of it.
    case = make_case([5, 5, 5, 5, 5], n, seed=8)
    expected = reference(case)
    units = [f"layers.{i}" for i in range(4)]
    original = fzero._comm.reduce_scatter_async

    def traced(mesh: fzero.Mesh) -> Any:
        sent: list[tuple[int, bool]] = []  # (elements, a view of the burst's buffer)

        def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            sent.append((t.numel(), t._base is not None))
            return original(t, *args, **kwargs)

        fzero._comm.reduce_scatter_async = spy
        out = train(mesh, case, units, 1, module=case["model"], reduce_bucket_bytes=560)
        return out, sent

    for (params, _ledger, layout), sent in run(n, traced):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12)
        layer, root = layout.unit_numel("layers.0"), layout.unit_numel("")
        assert sent == [(2 * layer, True), (2 * layer + root, True)] * 3


class _Mixed(torch.nn.Module):
    """Linear layers of alternating float64 and float32, each input cast to its layer's."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)]
        for i, layer in enumerate(layers):
            layer.to(torch.float64 if i % 2 == 0 else torch.float32)
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return x.double()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bucket", [0, 2000])
def test_units_of_alternating_dtypes_burst_apart_and_train_like_one_process(
    stage: int, bucket: int
) -> None:
    # A burst holds one dtype. Units of one dtype alternate here with units of the other,
    # float64 first, of 42, 15, 6, 18 and 15 elements (padded to 3 ranks). At stages 0-1,
    # 2000 bytes hold the three float64 layers in one burst, which stays open past the
    # float32 ones (in the other). At stages 2-3 a burst may be as large as layer 0, yet
    # layers 4 and 2 do not share one: the float32 layer 3 between them ends it, so that
    # no burst waits beside the others (their memory bound). Either way every gradient
    # is reduced once, in the same order on each rank.
    torch.manual_seed(9)
    model = _Mixed([6, 6, 2, 2, 6, 2])
    g = torch.Generator().manual_seed(10)
    xs = torch.randn(3, 6, 6, generator=g, dtype=torch.float64)
    ys = torch.randn(3, 6, 2, generator=g, dtype=torch.float64)
    expected = reference({"model": model, "xs": xs, "ys": ys})
    units = [f"layers.{i}" for i in range(5)]

    name = "all_reduce_async" if stage == 0 else "reduce_scatter_async"
    original = getattr(fzero._comm, name)

    def train_mixed(mesh: fzero.Mesh) -> Any:
        sizes: list[int] = []

        def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if t.numel() > 1:  # gradients, not one-element flags
                sizes.append(t.numel())
            return original(t, *args, **kwargs)

        setattr(fzero._comm, name, spy)  # in this rank's own (forked) process
        params = {k: v.detach().clone() for k, v in model.named_parameters()}

        def loss_fn(p: dict, batch: tuple) -> torch.Tensor:
            return ((functional_call(model, p, (batch[0],)) - batch[1]) ** 2).mean()

        adam = fzero.optim.adam(lr=0.05)
        state = fzero.shard_state(params, adam, mesh, stage=stage, units=units)
        step = fzero.sharded_step(
            loss_fn, adam, mesh, stage=stage, module=model, reduce_bucket_bytes=bucket
        )
        for t in range(3):
            sl = slice(2 * mesh.rank, 2 * mesh.rank + 2)
            state, _ = step(state, (xs[t, sl], ys[t, sl]))
        return fzero.gather_params(state.params, mesh), sizes

    per_step = 2 if stage < 2 and bucket else 5
    for params, sizes in run(3, train_mixed):
        assert len(sizes) == 3 * per_step, sizes
        for k, v in expected.items():
            # Every gradient passes through float32 layers: float32's rounding, over a
            # micro-batch here and the whole batch there.
            torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)
            assert not torch.equal(v, dict(model.named_parameters())[k])  # it trained
