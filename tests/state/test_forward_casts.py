"""Forward casts (`Precision.cast_forward_inputs`, `output_dtype`): a float32 batch through a
bfloat16 model given `module=`, against one process casting by hand."""

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence
from torch.utils.checkpoint import checkpoint

import fzero
from fzero._step._casts import cast_floating
from tests.support import graphs_made, run

BF16, FP32 = torch.bfloat16, torch.float32
Pair = namedtuple("Pair", "a b")
UNITS = ["blocks.0", "blocks.1"]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, pair: Pair, *, scale: dict, ids: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a list dynamo would guard on
            seen.append((pair.a.dtype, pair.b.dtype, scale["s"].dtype, ids.dtype))
        gate = torch.sigmoid(self.gate(pair.b))
        return torch.tanh(self.lin(pair.a)) * gate * scale["s"] + ids.unsqueeze(-1)


class Net(nn.Module):
    """`by_hand`: the reference's casts, written out; otherwise the step's hooks cast."""

    def __init__(self, d: int = 6, by_hand: torch.dtype | None = None, remat: bool = False):
        super().__init__()
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 2)
        self.by_hand, self.remat = by_hand, remat

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        cast = (lambda t: t.to(self.by_hand)) if self.by_hand else (lambda t: t)
        if not torch.compiler.is_compiling():
            seen.append((x.dtype,))
        h = self.inp(cast(x)).float()  # out of the compute dtype: each block casts it back
        for block in self.blocks:
            args = (Pair(cast(h), cast(h * 0.5)),)
            kw = {"scale": {"s": cast(torch.full((), 0.75))}, "ids": ids}
            h = (
                checkpoint(block, *args, use_reentrant=False, **kw)
                if self.remat
                else block(*args, **kw)
            )
        return self.head(cast(h))


seen: list[tuple[torch.dtype, ...]] = []  # what each forward received, in order


def data(n: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(steps, n, 3, 4, generator=g)
    ids = torch.randint(0, 2, (steps, n, 3), generator=g)
    ys = torch.randn(steps, n, 3, 2, generator=g)
    return xs, ids, ys


def loss_of(model: nn.Module, out_dtype: torch.dtype) -> Any:
    def loss_fn(params: dict, batch: Any) -> torch.Tensor:
        x, ids, y = batch
        out = functional_call(model, params, (x, ids))
        if out.dtype != out_dtype:
            raise TypeError(f"the model returned {out.dtype}, expected {out_dtype}")
        return ((out - y) ** 2).mean()

    return loss_fn


def reference(xs: torch.Tensor, ids: torch.Tensor, ys: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch.optim.Adam on float32 masters, one process: each micro-batch casts the
    parameters and the inputs to bfloat16 by hand, its gradient arriving in float32."""
    torch.manual_seed(0)
    model = Net(by_hand=BF16)
    loss_fn = loss_of(model, BF16)
    masters = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.Adam(list(masters.values()), lr=0.01, foreach=False)
    n = xs.shape[1]
    for t in range(xs.shape[0]):
        opt.zero_grad()
        total = sum(
            loss_fn({k: m.to(BF16) for k, m in masters.items()}, (xs[t, r], ids[t, r], ys[t, r]))
            for r in range(n)
        )
        total.backward()
        for m in masters.values():
            m.grad /= n
        opt.step()
    return {k: m.detach() for k, m in masters.items()}


def train(mesh: fzero.Mesh, xs: Any, ids: Any, ys: Any, stage: int, **kw: Any) -> Any:
    torch.manual_seed(0)
    model = Net(remat=kw.get("remat", False))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=BF16, reduce_dtype=FP32, output_dtype=kw.get("out"))
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    loss_fn = loss_of(model, kw.get("out") or BF16)
    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=stage, units=UNITS, module=model, compile=kw.get("compile", False)
    )
    seen.clear()
    graphs = []  # compiled: after each step, how many graphs this rank compiled
    made = graphs_made()
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ids[t, mesh.rank], ys[t, mesh.rank]))
        graphs.append(graphs_made() - made)
    forward = fzero.sharded_forward(lambda p, b: functional_call(model, p, b), mesh, module=model)
    out = forward(state, (xs[0, mesh.rank], ids[0, mesh.rank]))
    with fzero.bind(model, state, mesh) as bound:
        again = bound(xs[0, mesh.rank], ids[0, mesh.rank])
    return fzero.master_params(state, mesh), set(seen), (out, again), graphs


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_float32_batch_trains_as_casting_by_hand(stage: int) -> None:
    xs, ids, ys = data(2, 3)
    want = reference(xs, ids, ys)
    masters, dtypes, (out, again), _ = run(2, train, xs, ids, ys, stage, remat=stage == 3)[0]
    torch.manual_seed(0)
    start = dict(Net().named_parameters())
    for k, m in want.items():
        torch.testing.assert_close(masters[k], m, rtol=0, atol=0, msg=k)
        assert not torch.equal(m, start[k]), k  # trained
    # Every forward (the root's, each block's, the recomputes') saw its floating-point
    # inputs in bfloat16, the integer ones as they were.
    assert dtypes == {(BF16,), (BF16, BF16, BF16, torch.int64)}
    assert out.dtype == again.dtype == BF16 and torch.equal(out, again)


@pytest.mark.multiprocess
def test_one_rank_by_leaf_and_outputs_in_float32() -> None:
    xs, ids, ys = data(1, 2)
    want = reference(xs, ids, ys)
    masters, _, (out, _), _ = run(1, train, xs, ids, ys, 0, out=FP32)[0]
    for k, m in want.items():
        torch.testing.assert_close(masters[k], m, rtol=0, atol=0, msg=k)
    assert out.dtype == FP32


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_steps_cast_alike(stage: int) -> None:
    """The casts traced into the graph: the same hooks each step, so the first step's
    graphs serve the later ones (nothing compiles again)."""
    xs, ids, ys = data(2, 3)
    want = reference(xs, ids, ys)
    masters, _, _, graphs = run(2, train, xs, ids, ys, stage, compile="aot_eager")[0]
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs
    for k, m in want.items():  # the fused update's few float32 ulps (test_compiled.py)
        torch.testing.assert_close(masters[k], m, rtol=0, atol=1e-6, msg=k)


def _uncast(mesh: fzero.Mesh, cast: bool, module: bool) -> str:
    """torch's own dtype error where nothing casts the float32 batch, as every rank saw it."""
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=BF16, cast_forward_inputs=cast)
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS, precision=prec)
    loss_fn = loss_of(model, BF16)
    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model if module else None)
    xs, ids, ys = data(2, 1)
    try:
        step(state, (xs[0, mesh.rank], ids[0, mesh.rank], ys[0, mesh.rank]))
    except (RuntimeError, fzero.PeerError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_cast_forward_inputs_false_leaves_the_batch_as_it_is() -> None:
    for message in run(2, _uncast, False, True):
        assert "dtype" in message and "BFloat16" in message


@pytest.mark.multiprocess
def test_without_module_nothing_is_cast() -> None:
    # The step cannot tell the model's inputs from the targets: the loss casts.
    for message in run(2, _uncast, True, False):
        assert "dtype" in message and "BFloat16" in message


def test_bad_precision_options_are_clear_errors() -> None:
    with pytest.raises(TypeError, match="cast_forward_inputs must be a bool"):
        fzero.Precision(param_dtype=BF16, cast_forward_inputs="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Precision\.output_dtype"):
        fzero.Precision(output_dtype=torch.int32)


def test_cast_floating_walks_containers_as_fsdp2_does() -> None:
    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        count: int = 3

    class Cache:  # an object fzero does not look into
        def __init__(self) -> None:
            self.t = torch.ones(2)

    x, i, cache = torch.ones(2), torch.arange(2), Cache()
    packed = pack_padded_sequence(torch.ones(2, 2, 1), torch.tensor([2, 1]))
    tree = {"a": [x, (i, Pair(x, i))], "o": Out(x), "c": cache, "p": packed, "n": None}
    got = cast_floating(tree, BF16)
    assert got["a"][0].dtype == BF16 and got["a"][1][0] is i
    assert isinstance(got["a"][1][1], Pair) and got["a"][1][1].a.dtype == BF16
    assert isinstance(got["o"], Out) and got["o"].logits.dtype == BF16 and got["o"].count == 3
    assert got["c"] is cache and cache.t.dtype == FP32
    assert got["p"].data.dtype == BF16 and torch.equal(got["p"].batch_sizes, packed.batch_sizes)
    assert tree["a"][0].dtype == FP32  # the input is not changed
    top = cast_floating(torch.ones(2, 3).max(0), BF16)
    assert type(top).__name__ == "max" and top.values.dtype == BF16 and top.indices.dtype == i.dtype
    same = {"i": i, "l": [i]}
    assert cast_floating(same, BF16) is same  # nothing to cast: nothing rebuilt
