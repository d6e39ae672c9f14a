"""Tests for fzero.optim: bitwise agreement with stateful torch.optim optimizers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero import optim
from fzero.optim import _base

SHAPES = [(), (1,), (0,), (3, 5), (2, 1, 4)]
FLOATS = [torch.float32, torch.float64]
STEPS = 4
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.complex64: torch.int64,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}

# A shape skeleton: leaves are shapes (tuples of ints, kept whole via is_leaf).
_shape = st.sampled_from(SHAPES)
_flat = st.dictionaries(st.sampled_from(["w", "b", "emb", "out.w"]), _shape, min_size=1)
skeletons = st.one_of(
    _flat,
    _shape,  # a bare tensor is a pytree too
    st.tuples(_shape, _shape),
    st.fixed_dictionaries({"enc": _flat, "dec": st.tuples(_shape), "head": _shape}),
)
seeds = st.integers(0, 2**31 - 1)
dtypes = st.sampled_from(FLOATS)
lrs = st.floats(1e-4, 1.0)
decays = st.one_of(st.just(0.0), st.floats(1e-4, 0.5))
betas = st.tuples(st.floats(0.0, 0.99), st.sampled_from([0.0, 0.9, 0.999]))


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def make_tree(skeleton: Any, gen: torch.Generator, dtype: torch.dtype) -> Any:
    """Random tensors with the given skeleton, drawn from ``gen``."""
    return optree.tree_map(
        lambda s: torch.randn(s, generator=gen, dtype=dtype), skeleton, is_leaf=_is_shape
    )


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    view = _INT_VIEW.get(a.dtype, a.dtype)  # integer tensors are compared directly
    assert torch.equal(a.contiguous().view(view), b.contiguous().view(view)), (a, b)


def snapshot(tree: Any) -> list[Any]:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in optree.tree_leaves(tree)]


def assert_unchanged(tree: Any, snap: list[Any]) -> None:
    leaves = optree.tree_leaves(tree)
    assert len(leaves) == len(snap)
    for now, before in zip(leaves, snap, strict=True):
        if isinstance(now, torch.Tensor):
            assert_bitwise(now, before)
        else:
            assert now == before


def run_both(
    opt: optim.Optimizer,
    ref_cls: type[torch.optim.Optimizer],
    ref_kwargs: dict[str, Any],
    skeleton: Any,
    seed: int,
    dtype: torch.dtype,
    steps: int = STEPS,
    schedule: Callable[[int], float] | None = None,
    ref_grad_filter: Callable[[torch.Tensor], bool] = lambda p: True,
) -> tuple[Any, Any, list[torch.Tensor], torch.optim.Optimizer]:
    """Steps ``opt`` functionally and ``ref_cls`` statefully on copies of the same data."""
    gen = torch.Generator().manual_seed(seed)
    params = make_tree(skeleton, gen, dtype)
    ref_params = [p.clone() for p in optree.tree_leaves(params)]
    ref = ref_cls(ref_params, **ref_kwargs)
    state = opt.init(params)
    for step in range(steps):
        grads = make_tree(skeleton, gen, dtype)
        for p, g in zip(ref_params, optree.tree_leaves(grads), strict=True):
            p.grad = g.clone() if ref_grad_filter(p) else None
        if schedule is not None:
            ref.param_groups[0]["lr"] = schedule(step)
        ref.step()
        params, state = opt.update(grads, state, params)
    for mine, theirs in zip(optree.tree_leaves(params), ref_params, strict=True):
        assert_bitwise(mine, theirs)
    return params, state, ref_params, ref


# (momentum, dampening, nesterov): every momentum branch of torch.optim.SGD.
SGD_BRANCHES = [(0.0, 0.0, False), (0.9, 0.0, False), (0.5, 0.3, False), (0.9, 0.0, True)]


# How Adam and SGD batch small leaves (`fzero.optim._base.grouped`): the defaults, every
# leaf alone, and groups of at most 8 elements (a tree splits into several).
GROUPINGS = {"default": None, "alone": (-1, 1), "split": (1 << 14, 8)}


@contextlib.contextmanager
def grouping(name: str) -> Iterator[None]:
    saved = (_base._SMALL, _base._GROUP)
    if GROUPINGS[name] is not None:
        _base._SMALL, _base._GROUP = GROUPINGS[name]
    try:
        yield
    finally:
        _base._SMALL, _base._GROUP = saved


@pytest.mark.parametrize("group", sorted(GROUPINGS))
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize(("momentum", "dampening", "nesterov"), SGD_BRANCHES)
@given(skeleton=skeletons, seed=seeds, dtype=dtypes, lr=lrs, weight_decay=decays)
def test_sgd_matches_torch(
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    group: str,
    skeleton: Any,
    seed: int,
    dtype: torch.dtype,
    lr: float,
    weight_decay: float,
) -> None:
    hp = {
        "lr": lr,
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": weight_decay,
        "nesterov": nesterov,
        "maximize": maximize,
    }
    with grouping(group):
        _, state, ref_params, ref = run_both(
            optim.sgd(**hp), torch.optim.SGD, dict(hp, foreach=False), skeleton, seed, dtype
        )
    assert int(state.count) == STEPS
    if momentum == 0:
        assert state.momentum is None
    else:
        for buf, p in zip(optree.tree_leaves(state.momentum), ref_params, strict=True):
            assert_bitwise(buf, ref.state[p]["momentum_buffer"])


@pytest.mark.parametrize("group", sorted(GROUPINGS))
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize(
    ("make", "ref_cls"), [(optim.adam, torch.optim.Adam), (optim.adamw, torch.optim.AdamW)]
)
@given(
    skeleton=skeletons,
    seed=seeds,
    dtype=dtypes,
    lr=lrs,
    betas=betas,
    eps=st.sampled_from([1e-8, 1e-3, 0.0]),
    weight_decay=decays,
)
def test_adam_matches_torch(
    make: Callable[..., optim.Optimizer],
    ref_cls: type[torch.optim.Optimizer],
    amsgrad: bool,
    maximize: bool,
    group: str,
    skeleton: Any,
    seed: int,
    dtype: torch.dtype,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    hp = {
        "lr": lr,
        "betas": betas,
        "eps": eps,
        "weight_decay": weight_decay,
        "amsgrad": amsgrad,
        "maximize": maximize,
    }
    with grouping(group):
        _, state, ref_params, ref = run_both(
            make(**hp), ref_cls, dict(hp, foreach=False), skeleton, seed, dtype
        )
    assert int(state.count) == STEPS
    assert (state.nu_max is None) != amsgrad
    for i, p in enumerate(ref_params):
        assert_bitwise(optree.tree_leaves(state.mu)[i], ref.state[p]["exp_avg"])
        assert_bitwise(optree.tree_leaves(state.nu)[i], ref.state[p]["exp_avg_sq"])
        if amsgrad:
            assert_bitwise(optree.tree_leaves(state.nu_max)[i], ref.state[p]["max_exp_avg_sq"])


@pytest.mark.parametrize(
    ("make", "ref_cls", "extra"),
    [
        (optim.sgd, torch.optim.SGD, {"momentum": 0.9, "dampening": 0.1}),
        (optim.adam, torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}),
        (optim.adamw, torch.optim.AdamW, {"weight_decay": 0.1}),
    ],
)
@given(skeleton=skeletons, seed=seeds, dtype=dtypes)
def test_lr_schedule_matches_torch(
    make: Callable[..., optim.Optimizer],
    ref_cls: type[torch.optim.Optimizer],
    extra: dict[str, Any],
    skeleton: Any,
    seed: int,
    dtype: torch.dtype,
) -> None:
    calls: list[int] = []

    def schedule(count: int) -> float:
        return 0.1 / (1 + count) + 0.01 * (count % 2)

    def recording(count: int) -> float:
        calls.append(count)
        return schedule(count)

    run_both(
        make(lr=recording, **extra),
        ref_cls,
        dict(extra, foreach=False),
        skeleton,
        seed,
        dtype,
        schedule=schedule,
    )
    assert calls == list(range(STEPS))  # 0-based index of the update being computed


FROM_TORCH = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.5}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.Adadelta, {"lr": 0.5}),
    (torch.optim.Rprop, {"lr": 0.01}),
    (torch.optim.ASGD, {"lr": 0.01, "t0": 2}),
    (torch.optim.Adafactor, {"lr": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True, "maximize": True}),
]


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    FROM_TORCH,
    ids=[c.__name__ + ("-foreach" if kw.get("foreach") else "") for c, kw in FROM_TORCH],
)
@given(skeleton=skeletons, seed=seeds, dtype=dtypes)
def test_from_torch_matches_torch(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    skeleton: Any,
    seed: int,
    dtype: torch.dtype,
) -> None:
    # torch's Adafactor divides by numel(), so the reference must skip empty tensors
    # (from_torch always does; for other optimizers an empty tensor is a no-op).
    keep = (lambda p: p.numel() > 0) if cls is torch.optim.Adafactor else (lambda p: True)
    _, state, ref_params, ref = run_both(
        optim.from_torch(cls, **kwargs), cls, kwargs, skeleton, seed, dtype, ref_grad_filter=keep
    )
    for mine, p in zip(
        optree.tree_structure(skeleton, is_leaf=_is_shape).flatten_up_to(state),
        ref_params,
        strict=True,
    ):
        assert isinstance(mine, dict)
        if p.numel() == 0:
            continue
        assert mine.keys() == ref.state[p].keys()
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise(value, ref.state[p][key])
            else:
                assert value == ref.state[p][key]


OPTIMIZERS = {
    "sgd": lambda: optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
    "adam": lambda: optim.adam(lr=0.1, weight_decay=0.1, amsgrad=True, maximize=True),
    "adamw": lambda: optim.adamw(lr=lambda c: 0.1 * (c + 1)),
    "from_torch": lambda: optim.from_torch(torch.optim.Adam, lr=0.1, amsgrad=True),
    "from_torch_adagrad": lambda: optim.from_torch(torch.optim.Adagrad, lr=0.1),
    # torch edits the gradients in place here (foreach Nesterov adds the momentum to
    # them): from_torch must hand it copies.
    "from_torch_sgd_nesterov": lambda: optim.from_torch(
        torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, foreach=True
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@given(skeleton=skeletons, seed=seeds, dtype=dtypes)
def test_update_does_not_mutate_inputs(
    name: str, skeleton: Any, seed: int, dtype: torch.dtype
) -> None:
    opt = OPTIMIZERS[name]()
    gen = torch.Generator().manual_seed(seed)
    params = make_tree(skeleton, gen, dtype)
    state = opt.init(params)
    for _ in range(3):  # later steps read the (non-trivial) state
        grads = make_tree(skeleton, gen, dtype)
        before = [snapshot(params), snapshot(grads), snapshot(state)]
        new_params, new_state = opt.update(grads, state, params)
        for tree, snap in zip((params, grads, state), before, strict=True):
            assert_unchanged(tree, snap)
        assert optree.tree_structure(new_params) == optree.tree_structure(params)
        for x in optree.tree_leaves(new_state):
            assert isinstance(x, (torch.Tensor, int, float)), type(x)
        params, state = new_params, new_state


@pytest.mark.parametrize(
    "kwargs, copied",
    [
        ({"foreach": False}, False),
        ({"foreach": True}, False),
        ({"foreach": True, "nesterov": True, "momentum": 0.9}, True),
    ],
)
def test_from_torch_hands_over_the_gradients_unless_torch_edits_them(
    kwargs: dict[str, Any], copied: bool
) -> None:
    """A full copy of the gradient shard per step is saved where torch's step leaves the
    gradients alone; where it writes into them, it gets copies (the test above checks
    that the caller's gradients survive)."""
    seen: list[int] = []

    class Recording(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.extend(p.grad.data_ptr() for g in self.param_groups for p in g["params"])
            return super().step(closure)

    opt = optim.from_torch(Recording, lr=0.1, **kwargs)
    params = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    grads = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    seen.clear()
    opt.update(grads, opt.init(params), params)
    given_ptrs = [grads["a"].data_ptr(), grads["b"].data_ptr()]
    assert (seen != given_ptrs) == copied, (seen, given_ptrs)


def test_from_torch_copies_gradients_that_cudas_default_path_would_edit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without foreach= or fused=, torch picks its path by device: the single-tensor one
    on the host, where fzero's probe runs, the foreach one on CUDA, whose Nesterov step
    adds the momentum into the gradients (a second reader found the caller's gradients
    overwritten, 0.5 to 0.95 to 2.21). CUDA's choice is made here as torch's own
    function would make it for CUDA tensors, after the probe."""
    import torch.optim.sgd as torch_sgd

    opt = optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)
    monkeypatch.setattr(torch_sgd, "_default_to_fused_or_foreach", lambda *a, **k: (False, True))
    params, grads = {"w": torch.ones(4)}, {"w": torch.full((4,), 0.5)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.update(grads, state, params)
    assert torch.equal(grads["w"], torch.full((4,), 0.5))
    assert not torch.equal(params["w"], torch.ones(4))  # it stepped


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("params", [(), {}, {"a": ()}])
def test_empty_pytree(name: str, params: Any) -> None:
    # A rank that owns no tensors still steps: nothing in, nothing out.
    opt = OPTIMIZERS[name]()
    new_params, state = opt.update(params, opt.init(params), params)
    assert new_params == params
    assert optree.tree_structure(state) == optree.tree_structure(opt.init(params))


@pytest.mark.parametrize("make", [optim.sgd, optim.adam, optim.adamw])
def test_state_is_a_stable_pytree(make: Callable[..., optim.Optimizer]) -> None:
    params = {"a": torch.ones(3), "b": (torch.zeros(()), torch.ones(2, 2))}
    opt = make(lr=0.1, **({"momentum": 0.9} if make is optim.sgd else {"amsgrad": True}))
    state = opt.init(params)
    _, new_state = opt.update(optree.tree_map(torch.ones_like, params), state, params)
    assert optree.tree_structure(new_state) == optree.tree_structure(state)
    assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state))
    moments = new_state.momentum if make is optim.sgd else new_state.mu
    assert optree.tree_structure(moments) == optree.tree_structure(params)


@pytest.mark.parametrize(
    ("make", "ref_cls"), [(optim.adam, torch.optim.Adam), (optim.adamw, torch.optim.AdamW)]
)
def test_complex_adam_matches_torch(
    make: Callable[..., optim.Optimizer], ref_cls: type[torch.optim.Optimizer]
) -> None:
    # torch steps complex params through real views; a naive complex g*g would differ.
    hp = {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}
    run_both(make(**hp), ref_cls, dict(hp, foreach=False), {"z": (3, 2)}, 0, torch.complex64)


@pytest.mark.parametrize("group", sorted(GROUPINGS))
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_adam_over_mixed_dtypes_sizes_and_strides_matches_torch(
    amsgrad: bool, donate: bool, group: str
) -> None:
    # Adam writes every leaf's denominator into one buffer per dtype and device, sized for
    # the largest leaf: leaves of other dtypes, smaller sizes after larger ones, a
    # transposed leaf and a complex one must each still get exactly torch's values.
    gen = torch.Generator().manual_seed(0)

    def draw() -> dict[str, torch.Tensor]:
        return {
            "big32": torch.randn(9, 8, generator=gen),
            "small64": torch.randn(3, generator=gen, dtype=torch.float64),
            "t32": torch.randn(5, 7, generator=gen).t(),
            "z": torch.randn(4, generator=gen, dtype=torch.complex64),
            "big64": torch.randn(50, generator=gen, dtype=torch.float64),
            "small32": torch.randn(2, generator=gen),
        }

    params = draw()
    ref_params = [p.clone() for p in params.values()]
    hp = {"lr": 0.05, "weight_decay": 0.1, "amsgrad": amsgrad}
    ref = torch.optim.Adam(ref_params, foreach=False, **hp)
    opt = optim.adam(**hp)
    state = opt.init(params)
    for _ in range(3):
        grads = draw()
        for p, g in zip(ref_params, grads.values(), strict=True):
            p.grad = g.clone()
        ref.step()
        update = opt.update_ if donate else opt.update
        with grouping(group):
            params, state = update(grads, state, params)
    for mine, theirs in zip(params.values(), ref_params, strict=True):
        assert_bitwise(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("make", "ref_cls", "hp"),
    [
        (optim.sgd, torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
        (optim.adam, torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}),
        (optim.adam, torch.optim.Adam, {"betas": (0.9, 0.99)}),
        (optim.adamw, torch.optim.AdamW, {}),
        (optim.adamw, torch.optim.AdamW, {"weight_decay": 0.33}),
    ],
)
def test_low_precision(
    make: Callable[..., optim.Optimizer],
    ref_cls: type[torch.optim.Optimizer],
    hp: dict[str, Any],
    dtype: torch.dtype,
) -> None:
    """16-bit small leaves, updated as a group by list ops (`_base.grouped`): bitwise
    torch's loop, with factors that 16-bit rounding would change (0.9967, 0.99, 0.9):
    on the CPU torch's `_foreach_mul_` rounds a Python scalar to the list's dtype, which
    the loop's `mul_` does not (`_base.mul_each_`)."""
    hp = dict(hp, lr=0.01)
    skeleton = {"a": (3, 5), "b": (), "c": (0,), "d": (20, 16)}
    run_both(make(**hp), ref_cls, dict(hp, foreach=False), skeleton, 0, dtype)


@pytest.mark.parametrize(
    "build",
    [
        lambda: optim.sgd(lr=-0.1),
        lambda: optim.sgd(momentum=-0.5),
        lambda: optim.sgd(weight_decay=-1.0),
        lambda: optim.sgd(nesterov=True),
        lambda: optim.sgd(momentum=0.9, dampening=0.1, nesterov=True),
        lambda: optim.adam(lr=-1e-3),
        lambda: optim.adam(lr=float("nan")),
        lambda: optim.adam(betas=(1.0, 0.999)),
        lambda: optim.adam(betas=(0.9, -0.1)),
        lambda: optim.adamw(eps=-1e-8),
        lambda: optim.adamw(weight_decay=-0.01),
        lambda: optim.from_torch(torch.optim.Adam, lr=-1.0),
        lambda: optim.from_torch(torch.optim.LBFGS),
    ],
)
def test_invalid_hyperparameters_raise(build: Callable[[], optim.Optimizer]) -> None:
    with pytest.raises(ValueError):
        build()


@pytest.mark.parametrize("make", [optim.sgd, optim.adam, optim.adamw])
def test_negative_scheduled_lr_raises(make: Callable[..., optim.Optimizer]) -> None:
    opt = make(lr=lambda count: 0.1 - count)  # valid at step 0, negative at step 1
    params = (torch.ones(2),)
    params, state = opt.update((torch.ones(2),), opt.init(params), params)
    with pytest.raises(ValueError, match="learning rate"):
        opt.update((torch.ones(2),), state, params)


@pytest.mark.parametrize("bad", [dict, torch.nn.Linear, "Adam", torch.optim.Adam([torch.zeros(1)])])
def test_from_torch_rejects_non_optimizers(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        optim.from_torch(bad)


def test_from_torch_refuses_a_schedule_naming_the_optimizers_that_take_one() -> None:
    # torch's constructor raised "'<=' not supported between instances of 'float' and
    # 'function'"; training.md's table offered schedules on every optimizer.
    with pytest.raises(TypeError, match=r"from_torch\(RMSprop\): lr= is a schedule.*lambda"):
        optim.from_torch(torch.optim.RMSprop, lr=lambda step: 0.01)


def test_from_torch_rejects_lbfgs_clearly() -> None:
    with pytest.raises(ValueError, match="closure"):
        optim.from_torch(torch.optim.LBFGS, lr=1.0)


# --- optimizers that must see whole tensors -------------------------------------------------


class _Lamb(torch.optim.Optimizer):
    """A trust-ratio SGD (LAMB's idea): each tensor's step is scaled by ||w|| / ||g||."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


class _MySgd(torch.optim.SGD):
    """An elementwise subclass torch does not list: found elementwise by trying it."""


def test_from_torch_says_which_optimizers_need_whole_tensors() -> None:
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.RMSprop, _MySgd):
        assert optim.from_torch(cls, lr=0.1).whole_tensors is None, cls
    for cls in (torch.optim.Adafactor, _Lamb):
        opt = optim.from_torch(cls, lr=0.1)
        assert opt.whole_tensors is not None and cls.__name__ in opt.whole_tensors
        # chain keeps the verdict of the optimizer it ends in
        assert optim.chain(optim.clip_by_global_norm(1.0), opt).whole_tensors is not None
    assert optim.adamw(lr=0.1).whole_tensors is None


@pytest.mark.parametrize(
    ("dtype", "fused"),
    [
        (torch.bfloat16, False),
        (torch.float16, False),
        (torch.float32, False),
        (torch.bfloat16, True),
        (torch.float16, True),
    ],
)
def test_a_decay_mask_across_a_flat_piece_rounds_as_torch(
    dtype: torch.dtype, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One flat piece holding a decayed and an undecayed parameter (as a flat shard does):
    fzero's AdamW equals torch's AdamW with two parameter groups, bitwise, in half
    precision too (the decay is the product with the Python float `1 - lr * wd`, as
    torch's `p.mul_` rounds it, not with that factor rounded to the parameter's dtype).
    The piece is cut into its runs (`_base.by_flag`), no mask made: unfused, and fused
    for a 16-bit piece, which runs the unfused ops there, even with two large runs
    (`_SMALL` 0) where an fp32 piece would keep its mask for one compiled kernel."""
    from fzero.optim._context import ShardContext, Spans, shard_context

    masks: list[int] = []
    made = Spans.mask
    monkeypatch.setattr(Spans, "mask", lambda self, like: masks.append(1) or made(self, like))
    if fused:
        monkeypatch.setattr(_base, "_SMALL", 0)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    grads = [(torch.randn(300, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype))]
    grads.append((torch.randn(300, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)))
    opt = optim.adamw(lr=0.01, weight_decay=0.33, mask=lambda path: path == "w", fused=fused)
    piece = torch.cat([w, b])
    state = opt.init((piece,))
    ctx = ShardContext(None, True, ((("w", 0, 300), ("b", 300, 340)),))
    tw, tb = w.clone(), b.clone()
    ref = torch.optim.AdamW(
        [{"params": [tw]}, {"params": [tb], "weight_decay": 0.0}],
        lr=0.01,
        weight_decay=0.33,
        foreach=False,
    )
    for gw, gb in grads:
        with shard_context(ctx):
            (piece,), state = opt.update_((torch.cat([gw, gb]),), state, (piece,))
        tw.grad, tb.grad = gw, gb
        ref.step()
    assert torch.equal(piece[:300], tw) and torch.equal(piece[300:], tb)
    assert not torch.equal(piece[:300], w)
    assert masks == [], masks
