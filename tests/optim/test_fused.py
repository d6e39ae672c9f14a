"""Fused updates (`fused=True`, and `fused=None` inside a compiled step): each large flat
piece's Adam, AdamW or SGD as one compiled kernel, the small ones (a tree's leaves, a
shard's pieces) as torch's fused list kernel, against torch.optim's single-tensor loop."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch

import fzero
from fzero import optim
from fzero.optim._context import ShardContext, shard_context
from fzero.optim._fused import _KERNELS, compiled_updates
from tests.step.test_weights import DIMS
from tests.support import fused_kernels, fused_lists, make_params, run, with_fused_kinds

# (fzero's factory, torch's class, hyper-parameters): decay on "w" only, so that the flat
# piece below mixes a decayed and an undecayed parameter (the kernel's mask).
CONFIGS: dict[str, tuple[Callable[..., optim.Optimizer], type, dict[str, Any]]] = {
    "adamw": (optim.adamw, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.33)),
    "adam-amsgrad-maximize": (
        optim.adam,
        torch.optim.Adam,
        dict(lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True),
    ),
    "sgd-momentum": (
        optim.sgd,
        torch.optim.SGD,
        dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.1),
    ),
    "sgd-nesterov": (optim.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
}
SEGMENTS = ((("w", 0, 300), ("b", 300, 340)),)


@pytest.fixture
def kernels_for_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every leaf with elements counts as large (`_base._SMALL` 0): the small pieces below
    run the compiled kernel as a large one does, not torch's list kernel."""
    monkeypatch.setattr(fzero.optim._base, "_SMALL", 0)


def _make(name: str, fused: bool | None) -> optim.Optimizer:
    factory, _, hyper = CONFIGS[name]
    return factory(**hyper, mask=lambda path: path == "w", fused=fused)


def _train(
    opt: optim.Optimizer, cls: type, hyper: dict[str, Any], dtype: torch.dtype, steps: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`opt` on one flat piece of w (300) and b (40) under a shard's context, and torch's
    `cls` on w and b (b without weight decay): (fzero's piece, torch's, the start)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, generator=g, dtype=dtype), torch.randn(40, generator=g, dtype=dtype)
    start = torch.cat([w, b])
    piece, state = start.clone(), opt.init((start,))
    tw, tb = w.clone(), b.clone()
    groups = [{"params": [tw]}, {"params": [tb], "weight_decay": 0.0}]
    ref = cls(groups, foreach=False, **hyper)
    for _ in range(steps):
        gw, gb = (
            torch.randn(300, generator=g, dtype=dtype),
            torch.randn(40, generator=g, dtype=dtype),
        )
        with shard_context(ShardContext(None, True, SEGMENTS)):
            (piece,), state = opt.update_((torch.cat([gw, gb]),), state, (piece,))
        tw.grad, tb.grad = gw, gb
        ref.step()
    return piece, torch.cat([tw, tb]), start


@pytest.mark.usefixtures("kernels_for_every_piece")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_kernels_step_as_torch_in_float64(name: str) -> None:
    """Compiled by inductor, a kernel call a step: within 1e-12 of torch's loop,
    parameters moved."""
    _, cls, hyper = CONFIGS[name]
    with fused_kernels() as calls:
        got, want, start = _train(_make(name, True), cls, hyper, torch.float64)
    assert calls == [(340,)] * 4
    assert (got - start).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_small_piece_mixing_decay_flags_runs_torchs_list_kernel(name: str) -> None:
    """As sizes are (no fixture): the 340-element piece mixing a decayed and an undecayed
    parameter is cut into its two runs, each in the group of its flag for torch's list
    kernel, a call a flag a step, no compiled kernel and no mask: as torch's loop in
    float64, parameters moved."""
    _, cls, hyper = CONFIGS[name]
    with fused_kernels() as calls, fused_lists() as lists:
        got, want, start = _train(_make(name, True), cls, hyper, torch.float64)
    decays = hyper.get("weight_decay", 0) > 0  # else no run is decayed: one flag
    assert calls == [] and lists == ([1, 1] if decays else [1]) * 4, (calls, lists)
    assert (got - start).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_piece_with_one_large_run_runs_it_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With w's 300 elements over the small size and b's 40 under it, the piece is cut
    too: w a compiled kernel of its own, without a mask, and b torch's list kernel; a
    piece of two large runs (the fixture's `_SMALL` 0, `test_fused_kernels_step_...`)
    keeps one masked kernel call."""
    monkeypatch.setattr(fzero.optim._base, "_SMALL", 100)
    _, cls, hyper = CONFIGS["adamw"]
    with fused_kernels() as calls, fused_lists() as lists:
        got, want, start = _train(_make("adamw", True), cls, hyper, torch.float64)
    assert calls == [(300,)] * 4 and lists == [1] * 4, (calls, lists)
    assert (got - start).abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, torch.float64) for name in sorted(CONFIGS)]
    + [(name, torch.bfloat16) for name in sorted(CONFIGS) if CONFIGS[name][2].get("weight_decay")],
)
def test_unfused_pieces_of_large_runs_are_cut_and_step_as_torch_bitwise(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unfused, a mixed piece is cut into its runs whatever their sizes (`_SMALL` 0:
    both of w's and b's runs large), no mask made: bitwise torch's loop with two
    parameter groups, for Adam's L2 term with AMSGrad and maximize, AdamW, SGD with
    momentum and Nesterov, in float64 and, where there is decay to cut by, in bf16 (where
    the masked ops were not bitwise). A bf16 piece that is not cut (no decay) is one
    tensor where torch's loop has two, and torch's CPU kernels round a 16-bit element in
    a vectorised body and in a scalar tail apart: the same op over 340 elements and over
    the first 300 can differ in an ulp."""
    from fzero.optim._context import Spans

    monkeypatch.setattr(fzero.optim._base, "_SMALL", 0)
    masks: list[int] = []
    made = Spans.mask
    monkeypatch.setattr(Spans, "mask", lambda self, like: masks.append(1) or made(self, like))
    _, cls, hyper = CONFIGS[name]
    with fused_kernels() as calls:
        got, want, start = _train(_make(name, False), cls, hyper, dtype)
    assert calls == [] and masks == []
    assert torch.equal(got, want) and not torch.equal(got, start)


def test_where_a_fused_piece_of_several_large_runs_is_cut() -> None:
    """`_base._calls_pay`: one large run, always; several, on the CPU where the piece
    holds `_CALL_ELEMENTS` elements per extra kernel call; elsewhere (a GPU: here the
    meta device) never."""
    from fzero.optim._base import _CALL_ELEMENTS, _SMALL, _calls_pay
    from fzero.optim._context import Spans

    big = 2 * _CALL_ELEMENTS
    one = Spans(((0, 10, False), (10, big, True)))
    two = Spans(((0, big // 2, True), (big // 2, big // 2 + 10, False), (big // 2 + 10, big, True)))
    assert _calls_pay(torch.empty(big, device="meta"), one)
    assert _calls_pay(torch.empty(big), two)
    assert not _calls_pay(torch.empty(big, device="meta"), two)
    few = _CALL_ELEMENTS - 1  # two large runs, too few elements for the extra call
    assert few > 2 * _SMALL
    split = Spans(((0, few // 2, True), (few // 2, few, False)))
    assert not _calls_pay(torch.empty(few), split)


@pytest.mark.parametrize("cut", [True, False])
def test_a_cpu_piece_with_several_large_runs_is_cut_where_its_calls_cost_less_than_its_mask(
    cut: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fused on the CPU, a piece with two large runs (`_SMALL` 100: w1's 300 elements
    and w2's 200, b's 40 between) is cut where its one extra kernel call costs less than
    its mask (`_CALL_ELEMENTS` 500 against its 540 elements): a kernel a large run, b
    torch's list kernel, no mask made; else (600) one kernel with the mask. Both as
    torch's AdamW with two groups in float64."""
    from fzero.optim._context import Spans

    monkeypatch.setattr(fzero.optim._base, "_SMALL", 100)
    monkeypatch.setattr(fzero.optim._base, "_CALL_ELEMENTS", 500 if cut else 600)
    masks: list[int] = []
    made = Spans.mask
    monkeypatch.setattr(Spans, "mask", lambda self, like: masks.append(1) or made(self, like))
    g = torch.Generator().manual_seed(4)
    sizes = {"w1": 300, "b": 40, "w2": 200}
    start = {k: torch.randn(n, generator=g, dtype=torch.float64) for k, n in sizes.items()}
    piece = torch.cat(list(start.values()))
    opt = optim.adamw(lr=0.01, weight_decay=0.33, mask=lambda p: p[0] == "w", fused=True)
    state = opt.init((piece,))
    tw = {k: v.clone() for k, v in start.items()}
    ref = torch.optim.AdamW(
        [{"params": [tw["w1"], tw["w2"]]}, {"params": [tw["b"]], "weight_decay": 0}],
        lr=0.01,
        weight_decay=0.33,
        foreach=False,
    )
    ctx = ShardContext(None, True, ((("w1", 0, 300), ("b", 300, 340), ("w2", 340, 540)),))
    with fused_kernels() as calls, fused_lists() as lists:
        for _ in range(3):
            grads = {k: torch.randn(n, generator=g, dtype=torch.float64) for k, n in sizes.items()}
            with shard_context(ctx):
                (piece,), state = opt.update_((torch.cat(list(grads.values())),), state, (piece,))
            for k in tw:
                tw[k].grad = grads[k]
            ref.step()
    if cut:
        assert calls == [(300,), (200,)] * 3 and lists == [1] * 3 and masks == []
    else:
        assert calls == [(540,)] * 3 and lists == [] and masks == [1] * 3
    torch.testing.assert_close(piece, torch.cat(list(tw.values())), rtol=0, atol=1e-12)
    assert (piece - torch.cat(list(start.values()))).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("fused", "every_run_large"), [(True, False), (False, False), (False, True), (True, True)]
)
def test_alternating_parameters_and_padding_in_a_piece_step_as_torch(
    fused: bool, every_run_large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flat piece of four parameters alternating decay, then a shard's padding (held by
    no parameter, zero gradient): each parameter as torch's AdamW with two groups (1e-12
    fused, bitwise unfused), the padding left at zero. Cut into its runs, no mask made:
    fused, torch's list kernel, a call per flag a step; unfused, whatever the runs'
    sizes. Fused with every run large (`_SMALL` 0): one compiled kernel a step, with a
    mask."""
    from fzero.optim._context import Spans

    masks: list[int] = []
    made = Spans.mask
    monkeypatch.setattr(Spans, "mask", lambda self, like: masks.append(1) or made(self, like))
    if every_run_large:
        monkeypatch.setattr(fzero.optim._base, "_SMALL", 0)
    g = torch.Generator().manual_seed(3)
    sizes = {"w1": 100, "b1": 10, "w2": 90, "b2": 5}
    segments, at = [], 0
    for k, n in sizes.items():
        segments.append((k, at, at + n))
        at += n
    pad = 3
    start = {k: torch.randn(n, generator=g, dtype=torch.float64) for k, n in sizes.items()}
    piece = torch.cat([*start.values(), torch.zeros(pad, dtype=torch.float64)])
    opt = optim.adamw(lr=0.01, weight_decay=0.33, mask=lambda p: p[0] == "w", fused=fused)
    state = opt.init((piece,))
    tw = {k: v.clone() for k, v in start.items()}
    ref = torch.optim.AdamW(
        [{"params": [tw["w1"], tw["w2"]]}, {"params": [tw["b1"], tw["b2"]], "weight_decay": 0}],
        lr=0.01,
        weight_decay=0.33,
        foreach=False,
    )
    ctx = ShardContext(None, True, (tuple(segments),))
    with fused_kernels() as calls, fused_lists() as lists:
        for _ in range(3):
            grads = {k: torch.randn(n, generator=g, dtype=torch.float64) for k, n in sizes.items()}
            flat = torch.cat([*grads.values(), torch.zeros(pad, dtype=torch.float64)])
            with shard_context(ctx):
                (piece,), state = opt.update_((flat,), state, (piece,))
            for k in tw:
                tw[k].grad = grads[k]
            ref.step()
    if fused and every_run_large:
        assert calls == [(at + pad,)] * 3 and lists == [] and masks == [1] * 3
    else:  # w1, w2 decayed; b1, and b2 with the padding after it (one run), not
        assert calls == [] and lists == ([2, 2] * 3 if fused else []) and masks == []
    for (k, lo, hi), v in zip(segments, start.values()):
        assert (piece[lo:hi] - v).abs().max() > 1e-3, k
        if fused:
            torch.testing.assert_close(piece[lo:hi], tw[k], rtol=0, atol=1e-12)
        else:
            assert torch.equal(piece[lo:hi], tw[k]), k
    assert torch.equal(piece[at:], torch.zeros(pad, dtype=torch.float64))


def test_a_mixed_pieces_spans_cover_it_in_order() -> None:
    """`resolve_mask`'s answer for a piece mixing flags: its runs in element order
    whatever the segments' order, neighbours of one flag merged, gaps and the tail (a
    shard's padding) undecayed; a piece of one flag stays a bool."""
    from fzero.optim._context import Spans, resolve_mask

    segments = (
        (("c", 12, 20), ("a", 2, 5), ("b", 5, 9)),
        (("a", 0, 4),),
    )
    pieces = (torch.zeros(24), torch.zeros(4))
    with shard_context(ShardContext(None, True, segments)):
        got = resolve_mask(lambda path: path != "c", pieces)
    assert got == [Spans(((0, 2, False), (2, 9, True), (9, 24, False))), True]
    mask = got[0].mask(torch.zeros(24, dtype=torch.float64))
    assert mask.dtype == torch.float64 and mask.tolist() == [0] * 2 + [1] * 7 + [0] * 15


@pytest.mark.usefixtures("kernels_for_every_piece")
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_fused_kernels_round_within_a_few_ulps_in_float32(name: str) -> None:
    """The kernel's rounding differs from the seven ops' (`_fused`): the documented bound,
    4 ulps of the largest parameter."""
    _, cls, hyper = CONFIGS[name]
    with fused_kernels() as calls:
        got, want, start = _train(_make(name, True), cls, hyper, torch.float32)
    assert len(calls) == 4
    assert (got - start).abs().max() > 1e-3
    bound = 4 * torch.finfo(torch.float32).eps * want.abs().max().item()
    assert (got - want).abs().max().item() <= bound


def test_16_bit_leaves_keep_the_unfused_ops() -> None:
    """A bf16 piece under `fused=True`: no kernel, bitwise torch's loop."""
    _, cls, hyper = CONFIGS["adamw"]
    with fused_kernels() as calls:
        got, want, start = _train(_make("adamw", True), cls, hyper, torch.bfloat16)
    assert calls == [] and torch.equal(got, want) and not torch.equal(got, start)


@pytest.mark.usefixtures("kernels_for_every_piece")
def test_fused_none_follows_the_compiled_step() -> None:
    """`fused=None` (the default) fuses inside a compiled step's update, with its backend,
    and nowhere else; `fused=False` never does (bitwise torch's loop there too)."""
    hyper = CONFIGS["adamw"][2]
    with fused_kernels() as calls:
        eager, want, _ = _train(_make("adamw", None), torch.optim.AdamW, hyper, torch.float64)
        with compiled_updates("aot_eager"):
            off, _, _ = _train(_make("adamw", False), torch.optim.AdamW, hyper, torch.float64)
            assert calls == []
            on, _, _ = _train(_make("adamw", None), torch.optim.AdamW, hyper, torch.float64)
    assert torch.equal(eager, want) and torch.equal(off, want)
    assert len(calls) == 4 and ("make_adam", "aot_eager") in {k[:2] for k in _KERNELS}
    torch.testing.assert_close(on, want, rtol=0, atol=1e-12)


@pytest.mark.usefixtures("kernels_for_every_piece")
def test_a_kernel_compiles_once_for_new_sizes_and_learning_rates() -> None:
    """The step's scalars are arguments and the shapes dynamic: a schedule and pieces of
    other sizes reuse the compiled kernel (one graph; none if an earlier test made it)."""
    opt = optim.sgd(lr=lambda count: 0.1 / (1 + count), momentum=0.5, fused=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with fused_kernels() as calls:
        for n in (1000, 3000, 20000):
            params = (torch.randn(n, dtype=torch.float64),)
            state = opt.init(params)
            for _ in range(3):
                with shard_context(ShardContext(None, True, ((("x", 0, n),),))):
                    grads = (torch.randn(n, dtype=torch.float64),)
                    params, state = opt.update_(grads, state, params)
    assert len(calls) == 9
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 1


# Owned tensors as `layout="tensor"` hands them over: a 0-d one (compiled, torch 2.13 lost
# an in-place update of a 0-d input), one element, and the shapes of a vision model
# (tokens, a patch convolution, 1x1 and depthwise kernels), more than dynamo's recompile
# limit of shapes for one function.
SHAPES = [(), (1,), (4, 7), (5,), (4, 4), (1, 7), (7, 1), (2, 3, 3, 3), (4, 3, 1, 1)]
SHAPES += [(1, 1, 7), (3, 1, 3, 3), (6, 2), (2, 2, 2, 2, 2)]


@pytest.mark.usefixtures("kernels_for_every_piece")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kernels_update_owned_tensors_of_any_shape(backend: str) -> None:
    """Every shape through one kernel (flat views), AdamW as torch's."""
    g = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    pieces, opt = tuple(x.clone() for x in start), optim.adamw(lr=0.05, weight_decay=0.1)
    state = opt.init(pieces)
    ref = [x.clone() for x in start]
    torch_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1, foreach=False)
    segments = tuple(((f"x{i}", 0, x.numel()),) for i, x in enumerate(start))
    with fused_kernels() as calls:
        for _ in range(3):
            grads = tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES)
            with compiled_updates(backend), shard_context(ShardContext(None, True, segments)):
                pieces, state = opt.update_(grads, state, pieces)
            for r, gr in zip(ref, grads):
                r.grad = gr
            torch_opt.step()
    assert len(calls) == 3 * len(SHAPES)
    for got, want, x in zip(pieces, ref, start):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert (got - x).abs().max() > 1e-4


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize(
    ("stage", "layout", "optimizer"), [(2, "tensor", "adamw"), (3, "flat", "adamw_matrices")]
)
def test_a_compiled_step_runs_its_update_fused(
    large: bool, stage: int, layout: str, optimizer: str
) -> None:
    """`sharded_step(compile=...)` with `adamw()` (`fused=None`): every rank's update runs
    fused, training as torch.optim in float64. Stage 2's small owned tensors
    (layout="tensor") go as groups to torch's fused list kernel, no compiled kernel;
    stage 3's flat pieces, with decay on the matrices alone (torch: two parameter
    groups), each mix a matrix and its bias and are cut into their runs, all of them
    small: the list kernel too. Every piece large (`_SMALL` 0): a compiled kernel each,
    a mixed piece's with its mask."""
    from tests.step.test_compiled import train
    from tests.step.test_weights import make_data, reference

    params = make_params(DIMS, torch.float64, 2)
    data = make_data([[[2], [1]], [[1], [2]]], 2)
    want = reference(params, data, "pair", optimizer)
    args = (params, data, "pair", stage, layout, "aot_eager", (), 0, optimizer)
    for (got, _), kernels, lists in run(2, with_fused_kinds, large, train, *args):
        fzero.assert_trees_close(got, want, rtol=1e-10, atol=1e-12)
        if large:
            assert kernels > 0 and lists == 0, (kernels, lists)
        else:
            assert kernels == 0 and lists > 0, (kernels, lists)
    assert fzero._core._tree.max_abs_diff(got, params) > 1e-3


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("factory", "cls", "hyper"),
    [
        (optim.adamw, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.33)),
        (optim.adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
        (optim.adam, torch.optim.Adam, dict(lr=0.01, maximize=True)),
        (optim.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.1)),
        (optim.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
        (optim.sgd, torch.optim.SGD, dict(lr=0.05, weight_decay=0.1)),
    ],
)
def test_small_leaves_and_pieces_run_torchs_fused_list_kernel(
    factory: Callable[..., optim.Optimizer],
    cls: type,
    hyper: dict[str, Any],
    dtype: torch.dtype,
    pieces: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fused, a tree's small leaves (stage 0's) or a shard's small pieces (stages 1-3's,
    a piece a leaf here; where a kernel each costs more than it saves) go to torch's
    `_fused_adam(w)_` or `_fused_sgd_` (momentum seeded on the first step as torch's
    loop seeds it), one call per group of one decay flag, no compiled kernel: within
    1e-12 of torch's loop in float64, 1 ulp of the largest parameter in float32,
    parameters moved."""
    g = torch.Generator().manual_seed(1)
    shapes = {"w1": (7, 5), "w2": (5,), "b1": (5,), "b2": (3, 2)}
    start = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
    opt = factory(**hyper, mask=lambda path: path.startswith("w"), fused=True)
    decay = hyper.get("weight_decay", 0.0)
    tw = {k: v.clone() for k, v in start.items()}
    ref = cls(
        [
            {"params": [tw["w1"], tw["w2"]]},
            {"params": [tw["b1"], tw["b2"]], "weight_decay": 0.0},
        ],
        foreach=False,
        **{**hyper, "weight_decay": decay},
    )
    calls: list[int] = []
    name = {optim.adamw: "_fused_adamw_", optim.adam: "_fused_adam_"}.get(factory, "_fused_sgd_")
    kernel = getattr(torch, name)

    def counted(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        calls.append(len(params))
        kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    params: Any = {k: v.clone() for k, v in start.items()}
    # As a shard's pieces: each leaf flat, its own piece (a decay flag a piece).
    segments = tuple(((k, 0, v.numel()),) for k, v in start.items())
    ctx = ShardContext(None, True, segments)
    context = (lambda: shard_context(ctx)) if pieces else nullcontext
    if pieces:
        params = tuple(v.reshape(-1) for v in params.values())
    state = opt.init(params)
    with fused_kernels() as compiled:
        for _ in range(4):
            grads = {k: torch.randn(s, generator=g, dtype=dtype) for k, s in shapes.items()}
            given = tuple(v.reshape(-1) for v in grads.values()) if pieces else grads
            with context():
                params, state = opt.update_(given, state, params)
            for k in tw:
                tw[k].grad = grads[k]
            ref.step()
    if pieces:
        params = {k: v.view(start[k].shape) for k, v in zip(start, params)}
    # Per step, a call for the decayed leaves and one for the others (one without decay).
    assert compiled == [] and calls == ([2, 2] if decay else [4]) * 4, calls
    for k in shapes:
        assert (params[k] - start[k]).abs().max() > 1e-3, k
        if dtype == torch.float64:
            torch.testing.assert_close(params[k], tw[k], rtol=0, atol=1e-12)
        else:
            bound = torch.finfo(dtype).eps * max(v.abs().max().item() for v in tw.values())
            assert (params[k] - tw[k]).abs().max().item() <= bound, k


def test_a_group_with_a_transposed_leaf_keeps_the_list_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's fused list kernel walks each tensor as flat memory: a leaf whose strides
    differ from its gradient's (a transposed view beside a contiguous gradient) would
    come out wrong there, so its group keeps the list ops: bitwise torch's loop."""
    g = torch.Generator().manual_seed(2)
    start = {"a": torch.randn(5, 7, generator=g).t(), "b": torch.randn(3, generator=g)}
    opt = optim.adam(lr=0.1, fused=True)
    ref_p = {k: v.clone() for k, v in start.items()}
    ref = torch.optim.Adam(list(ref_p.values()), lr=0.1, foreach=False)
    calls: list[int] = []
    kernel = torch._fused_adam_

    def counted(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        calls.append(len(params))
        kernel(params, *args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adam_", counted)
    params = {k: v.clone() for k, v in start.items()}  # clone keeps the transposed strides
    assert not params["a"].is_contiguous()
    state = opt.init(params)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in start.items()}  # contiguous
        params, state = opt.update_(grads, state, params)
        for k in ref_p:
            ref_p[k].grad = grads[k]
        ref.step()
    assert calls == []
    for k in start:
        assert torch.equal(params[k], ref_p[k]) and not torch.equal(params[k], start[k]), k


@pytest.mark.usefixtures("kernels_for_every_piece")
def test_a_kernel_past_its_recompile_limit_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's limit at 1 and fresh kernels: a one-element piece and a longer one need two
    variants of AdamW's kernel; the second runs eagerly instead of raising mid-run (no
    `fullgraph`), and both step as torch's loop (float64, 1e-12), parameters moved."""
    from fzero.optim import _fused

    monkeypatch.setattr(_fused, "_KERNELS", {})
    _, cls, hyper = CONFIGS["adamw"]
    g = torch.Generator().manual_seed(1)
    s, w, b = (torch.randn(n, generator=g, dtype=torch.float64) for n in (1, 300, 40))
    # Decay everywhere: both pieces the same kernel (a mask would key a kernel of its own).
    pieces, opt = (s.clone(), torch.cat([w, b])), optim.adamw(**hyper, fused=True)
    state = opt.init(pieces)
    ts, tw, tb = s.clone(), w.clone(), b.clone()
    ref = cls([tw, tb, ts], foreach=False, **hyper)
    segments = ((("s", 0, 1),), (("w", 0, 300), ("b", 300, 340)))
    with torch._dynamo.config.patch(recompile_limit=1), fused_kernels() as calls:
        for _ in range(3):
            gs, gw, gb = (torch.randn(n, generator=g, dtype=torch.float64) for n in (1, 300, 40))
            with shard_context(ShardContext(None, True, segments)):
                pieces, state = opt.update_((gs, torch.cat([gw, gb])), state, pieces)
            ts.grad, tw.grad, tb.grad = gs, gw, gb
            ref.step()
    assert sorted(calls) == [(1,)] * 3 + [(340,)] * 3  # each piece by its kernel, compiled or not
    assert (pieces[1] - torch.cat([w, b])).abs().max() > 1e-3
    torch.testing.assert_close(pieces[0], ts, rtol=0, atol=1e-12)
    torch.testing.assert_close(pieces[1], torch.cat([tw, tb]), rtol=0, atol=1e-12)
