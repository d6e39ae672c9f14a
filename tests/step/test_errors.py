"""Bad input fails fast, on every rank, with a message that names the problem (never a hang)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fzero
from fzero import optim
from tests.support import errors_on_every_rank, run

F64 = torch.float64


def _params(**override: Any) -> dict[str, Any]:
    """A small nested tree, so leaf paths are dotted ("layers.0.w"); `override` edits leaves."""
    tree: dict[str, Any] = {
        "layers": [
            {"w": torch.ones(2, 3, dtype=F64), "b": torch.zeros(3, dtype=F64)},
            {"w": torch.ones(3, 1, dtype=F64), "b": torch.zeros(1, dtype=F64)},
        ],
        "scale": torch.tensor(1.0, dtype=F64),
    }
    for path, value in override.items():
        *parents, leaf = path.split("__")
        node: Any = tree
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return tree


def _loss(params: dict[str, Any], batch: torch.Tensor) -> torch.Tensor:
    h = batch
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    return (h * params["scale"]).pow(2).mean()


def _batch() -> torch.Tensor:
    return torch.linspace(-1, 1, 8, dtype=F64).reshape(4, 2)


# --- params that are not a pytree of floating-point tensors ---------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("params", "error", "match"),
    [
        (
            _params(layers__0__w=torch.ones(2, 3, dtype=torch.int64)),
            TypeError,
            r"'layers\.0\.w' has dtype torch\.int64, expected a floating-point dtype",
        ),
        (
            _params(layers__1__b=torch.zeros(1, dtype=torch.bool)),
            TypeError,
            r"'layers\.1\.b' has dtype torch\.bool",
        ),
        (
            _params(layers__1__w=torch.ones(3, 2, dtype=torch.complex64)),
            TypeError,
            r"'layers\.1\.w' has dtype torch\.complex64, expected a floating-point dtype: hold "
            r"it as torch\.view_as_real\(x\)",
        ),
        (_params(scale=1.0), TypeError, r"'scale' is a float, expected a floating-point"),
        (_params(layers__0__b=np.zeros(3)), TypeError, r"'layers\.0\.b' is a ndarray"),
        ({}, ValueError, r"params has no leaves"),
        ({"layers": [], "scale": None}, ValueError, r"params has no leaves"),
        (  # torch's own message ("Attempted to use an uninitialized parameter") names none
            _params(layers__1__w=nn.LazyLinear(2).weight),
            ValueError,
            r"'layers\.1\.w' is an uninitialized parameter \(a lazy module's",
        ),
    ],
    ids=[
        "int-tensor",
        "bool-tensor",
        "complex-tensor",
        "python-float",
        "numpy-array",
        "empty-dict",
        "no-tensors",
        "lazy-parameter",
    ],
)
def test_params_must_be_a_pytree_of_floating_tensors(
    params: Any, error: type[Exception], match: str
) -> None:
    def fn(mesh: fzero.Mesh) -> None:
        fzero.shard_state(params, optim.sgd(lr=0.1), mesh, stage=2)

    with pytest.raises(error, match=match):
        run(2, fn)


def _twice(case: str) -> tuple[dict[str, torch.Tensor], Any]:
    """A tree listing one tensor twice, and `shard_state`'s frozen=."""
    w = torch.ones(3, 3, dtype=F64)
    if case == "view":  # a view of the other: its transpose
        return {"a": w, "b": w.t()}, None
    if case == "rows":  # views of one buffer sharing no element are distinct leaves
        return {"a": w[0], "b": w[1], "c": w.view(-1)[6::3]}, None
    if case == "frozen-once":  # frozen under one name, trained under the other
        return {"a": w, "b": w, "c": torch.ones(2, dtype=F64)}, ["a"]
    if case == "frozen-both":  # never written: nothing to part
        return {"a": w, "b": w, "c": torch.ones(2, dtype=F64, requires_grad=True)}, None
    return {"a": w, "b": w}, None


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["object", "view", "frozen-once", "frozen-both", "rows"])
def test_a_leaf_listed_twice_is_refused_unless_both_are_frozen(case: str) -> None:
    """torch.optim steps a tensor it is given twice once, with both gradients; fzero
    trained each leaf apart, so the two parted after the first step, silently."""

    def fn(mesh: fzero.Mesh) -> str:
        params, frozen = _twice(case)
        try:
            fzero.shard_state(params, optim.sgd(lr=0.1), mesh, stage=3, frozen=frozen)
        except ValueError as exc:
            return str(exc)
        return "no error"

    for message in run(2, fn):
        if case in ("frozen-both", "rows"):
            assert message == "no error", message
        else:
            assert "params leaves 'a' and 'b' share elements" in message, message


@pytest.mark.multiprocess
def test_invalid_params_on_one_rank_raise_on_every_rank_naming_it() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        bad = torch.ones(2, 3, dtype=torch.int32) if mesh.rank == 1 else torch.ones(2, 3, dtype=F64)
        fzero.shard_state(_params(layers__0__w=bad), optim.sgd(lr=0.1), mesh, stage=1)

    for message in errors_on_every_rank(3, fn):
        assert message.startswith("TypeError: shard_state: rank 1:"), message
        assert "'layers.0.w' has dtype torch.int32" in message


# --- loss_fn must return a real scalar tensor -----------------------------------------------

_BAD_LOSSES: dict[str, tuple[Callable[..., Any], type[Exception], str]] = {
    # Returned by rank 1 only: the message must name the rank, and its peers (already in
    # the gradient collectives) must not keep the caller waiting.
    "vector": (lambda p, b: _loss(p, b) * torch.ones(3, dtype=F64), ValueError, r"shape \(3,\)"),
    "python-float": (lambda p, b: _loss(p, b).item(), TypeError, r"scalar tensor, got float"),
    "int-tensor": (
        lambda p, b: _loss(p, b).round().long(),
        ValueError,
        r"real scalar tensor .*dtype torch\.int64",
    ),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", sorted(_BAD_LOSSES))
def test_loss_fn_must_return_a_real_scalar_tensor(kind: str, stage: int) -> None:
    bad_loss, error, match = _BAD_LOSSES[kind]

    def fn(mesh: fzero.Mesh) -> None:
        loss_fn = bad_loss if mesh.rank == 1 else _loss
        opt = optim.sgd(lr=0.1)
        state = fzero.shard_state(_params(), opt, mesh, stage=stage)
        fzero.sharded_step(loss_fn, opt, mesh, stage=stage)(state, _batch())

    with pytest.raises(error, match=rf"loss_fn must return .*{match}.* on rank 1"):
        run(2, fn)


# --- stage validation -------------------------------------------------------------------------

_BAD_STAGES = [4, -1, "1", True, None]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", _BAD_STAGES, ids=repr)
def test_shard_state_rejects_a_stage_outside_0_to_3(stage: Any) -> None:
    def fn(mesh: fzero.Mesh) -> None:
        fzero.shard_state(_params(), optim.sgd(lr=0.1), mesh, stage=stage)

    with pytest.raises(ValueError, match=rf"stage must be one of 0, 1, 2, 3 .*got {stage!r}"):
        run(1, fn)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", _BAD_STAGES, ids=repr)
def test_sharded_step_rejects_a_stage_outside_0_to_3(stage: Any) -> None:
    def fn(mesh: fzero.Mesh) -> None:
        fzero.sharded_step(_loss, optim.sgd(lr=0.1), mesh, stage=stage)

    with pytest.raises(ValueError, match=rf"stage must be one of 0, 1, 2, 3 .*got {stage!r}"):
        run(1, fn)


# --- ranks that disagree about their params ---------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("rank2_params", "expected"),
    [
        (
            _params(layers__0__extra=torch.ones(2, dtype=F64)),
            "rank 2's params differ from rank 0's: leaf 'layers.0.extra' where rank 0 has "
            "'layers.0.w'",
        ),
        (
            {**_params(), "zzz": torch.ones(2, dtype=F64)},  # extra leaf after every other
            "rank 2's params differ from rank 0's: 6 leaves vs rank 0's 5 (first unmatched: 'zzz')",
        ),
        (
            _params(layers__1__w=torch.ones(1, 3, dtype=F64)),
            "rank 2's params differ from rank 0's: leaf 'layers.1.w' is (1, 3) torch.float64, "
            "rank 0 has (3, 1) torch.float64",
        ),
        (
            _params(layers__1__b=torch.zeros(1, dtype=torch.float32)),
            "rank 2's params differ from rank 0's: leaf 'layers.1.b' is (1,) torch.float32, "
            "rank 0 has (1,) torch.float64",
        ),
    ],
    ids=["extra-leaf", "extra-last-leaf", "shape", "dtype"],
)
@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_with_different_params_fail_on_every_rank(
    rank2_params: Any, expected: str, stage: int
) -> None:
    def fn(mesh: fzero.Mesh) -> None:
        params = rank2_params if mesh.rank == 2 else _params()
        fzero.shard_state(params, optim.adam(lr=0.1), mesh, stage=stage)

    for message in errors_on_every_rank(3, fn):
        assert message == f"ValueError: shard_state: {expected}"


@pytest.mark.multiprocess
def test_ranks_asking_for_different_stages_fail_on_every_rank() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        fzero.shard_state(_params(), optim.sgd(lr=0.1), mesh, stage=2 if mesh.rank == 1 else 0)

    for message in errors_on_every_rank(3, fn):
        assert message == "ValueError: shard_state: rank 1 asked for stage 2, rank 0 for 0"


@pytest.mark.multiprocess
def test_ranks_asking_for_different_layouts_fail_on_every_rank() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        layout = "tensor" if mesh.rank == 1 else "flat"
        fzero.shard_state(_params(), optim.sgd(lr=0.1), mesh, stage=1, layout=layout)

    for message in errors_on_every_rank(2, fn):
        assert message.startswith("ValueError: shard_state: rank 1"), message
        assert "'tensor'" in message and "'flat'" in message


@pytest.mark.multiprocess
def test_unknown_layout_is_rejected() -> None:
    def fn(mesh: fzero.Mesh) -> None:
        fzero.shard_state(_params(), optim.sgd(lr=0.1), mesh, stage=1, layout="rows")

    with pytest.raises(ValueError, match=r"layout must be one of \('flat', 'tensor'\), got 'rows'"):
        run(2, fn)


# --- a step given a state it was not built for ------------------------------------------------


def _step_with(
    make_state: Callable[[fzero.Mesh, optim.Optimizer], Any], stage: int, **step_kwargs: Any
) -> Callable[[fzero.Mesh], None]:
    def fn(mesh: fzero.Mesh) -> None:
        opt = optim.sgd(lr=0.1)
        step = fzero.sharded_step(_loss, opt, mesh, stage=stage, **step_kwargs)
        step(make_state(mesh, opt), _batch())

    return fn


def _state(stage: int, layout: str = "flat") -> Callable[[fzero.Mesh, optim.Optimizer], Any]:
    return lambda mesh, opt: fzero.shard_state(_params(), opt, mesh, stage=stage, layout=layout)


def _state_for_three_ranks(mesh: fzero.Mesh, opt: optim.Optimizer) -> fzero.ShardedState:
    # What loading a checkpoint written at another world size without resharding gives.
    state = fzero.shard_state(_params(), opt, mesh, stage=0)
    return fzero.ShardedState(
        state.params, state.opt_state, 0, fzero.build_layout(_params(), 3), stage=0
    )


def _state_of_the_other_rank(mesh: fzero.Mesh, opt: optim.Optimizer) -> fzero.ShardedState:
    state = fzero.shard_state(_params(), opt, mesh, stage=3)
    shards = fzero.Shards(state.params.buffers, state.layout, 1 - mesh.rank)
    return fzero.ShardedState(shards, state.opt_state, 0, state.layout, stage=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (_step_with(_state(0), stage=1), ValueError, r"step is for stage 1, .* for stage 0"),
        (_step_with(_state(3), stage=2), ValueError, r"step is for stage 2, .* for stage 3"),
        (
            _step_with(_state(1), stage=1, layout="tensor"),
            ValueError,
            r"step is for layout 'tensor', the state has 'flat'",
        ),
        (
            _step_with(_state_for_three_ranks, stage=0),
            ValueError,
            r"the state is sharded over 3 ranks, the mesh shards over 2",
        ),
        (
            _step_with(_state_of_the_other_rank, stage=3),
            ValueError,
            # Whatever catches it, the message must say whose shards these are and where.
            r"shards belong to shard [01] of 2, this is rank [01] \(shard [01]\)",
        ),
        (
            _step_with(lambda mesh, opt: _params(), stage=0),
            TypeError,
            r"step expects the ShardedState from shard_state, got dict",
        ),
    ],
    ids=["stage-0-state", "stage-3-state", "other-layout", "other-world-size", "other-rank", "raw"],
)
def test_step_rejects_a_state_it_was_not_built_for(
    fn: Callable[[fzero.Mesh], None], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        run(2, fn)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_a_donated_state_given_to_a_step_or_a_checkpoint_again_is_refused(
    stage: int, tmp_path: Any
) -> None:
    # The first step updated its buffers in place: a second step from it would train on
    # the updated values under the old step count, and a checkpoint of it would pair them
    # with that count. A pure step (donate=False) leaves states reusable.
    def fn(mesh: fzero.Mesh, donate: bool, then: str) -> int:
        opt = optim.adam(lr=0.1)
        state = fzero.shard_state(_params(), opt, mesh, stage=stage)
        step = fzero.sharded_step(_loss, opt, mesh, stage=stage, donate=donate)
        step(state, _batch())
        if then == "save":
            fzero.checkpoint.save(state, str(tmp_path / "ckpt"), mesh)
            return state.step
        again, _ = step(state, _batch())
        return again.step

    assert run(2, fn, False, "step") == [1, 1]
    assert run(2, fn, False, "save") == [0, 0]
    for then, what in (("step", "step"), ("save", "checkpoint.save")):
        with pytest.raises(ValueError, match=rf"rank \d: {what}: this state \(step 0\) was"):
            run(2, fn, True, then)


# --- primitives given pieces that do not fit --------------------------------------------------


@pytest.mark.multiprocess
def test_gather_params_rejects_shards_of_another_mesh() -> None:
    layout3 = fzero.build_layout(_params(), 3)

    def other_world(mesh: fzero.Mesh) -> None:
        fzero.gather_params(fzero.Shards(layout3.shard(_params(), 0), layout3, 0), mesh)

    with pytest.raises(ValueError, match=r"shards of rank 0 of 3 cannot be gathered on rank \d"):
        run(2, other_world)


@pytest.mark.multiprocess
def test_reduce_scatter_grads_rejects_grads_that_do_not_fit_the_layout() -> None:
    def fn(mesh: fzero.Mesh) -> list[str]:
        layout = fzero.build_layout(_params(), mesh.size)
        out = []
        for grads in (
            _params(layers__1__w=torch.ones(1, 3, dtype=F64)),
            _params(layers__1__w=torch.ones(3, 1, dtype=torch.float32)),
            {"layers": _params()["layers"]},
        ):
            with pytest.raises(ValueError) as info:
                fzero.reduce_scatter_grads(grads, layout, mesh)
            out.append(str(info.value))
        return out

    shape, dtype, structure = run(2, fn)[0]
    assert "'layers.1.w'" in shape and "(1, 3)" in shape and "(3, 1)" in shape
    assert "'layers.1.w'" in dtype and "torch.float32" in dtype and "torch.float64" in dtype
    assert "structure" in structure


def _shards(params: Any, world_size: int, rank: int) -> fzero.Shards:
    layout = fzero.build_layout(params, world_size)
    return fzero.Shards(layout.shard(params, rank), layout, rank)


@pytest.mark.parametrize(
    "grads",
    [
        _params(),  # a full tree where Shards are expected
        _shards({"other": torch.ones(7, dtype=F64)}, 2, 0),  # another layout
        _shards(_params(), 2, 1),  # another rank's shard
        _shards(_params(), 3, 0),  # another world size
    ],
    ids=["full-tree", "other-layout", "other-rank", "other-world-size"],
)
def test_sharded_update_rejects_grads_that_do_not_match_the_shards(grads: Any) -> None:
    opt = optim.adam(lr=0.1)
    params = _shards(_params(), 2, 0)
    with pytest.raises(ValueError, match="grads must be Shards with the parameters' layout"):
        fzero.sharded_update(opt, params, grads, opt.init(params.pieces()))


@pytest.mark.parametrize(
    ("grads", "match"),
    [
        ({**_params(), "extra": torch.ones(1, dtype=F64)}, r"extra"),
        (_params(layers__1__w=torch.ones(1, 3, dtype=F64)), r"layers\.1\.w.*\(1, 3\).*\(3, 1\)"),
    ],
    ids=["extra-leaf", "wrong-shape"],
)
def test_sharded_update_of_a_full_tree_rejects_mismatched_grads(grads: Any, match: str) -> None:
    # Stage 0 updates the replicated full tree: a wrong gradient must be named, not surface
    # as a broadcasting error deep inside the optimizer.
    opt = optim.adam(lr=0.1)
    params = _params()
    with pytest.raises(ValueError, match=match):
        fzero.sharded_update(opt, params, grads, opt.init(params))


# --- meshes -----------------------------------------------------------------------------------


def test_process_group_mesh_needs_an_initialised_process_group() -> None:
    assert not dist.is_initialized()  # simulate initialises gloo only in its ranks
    with pytest.raises(RuntimeError, match=r"init_process_group.*fzero\.simulate"):
        fzero.ProcessGroupMesh()


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_that_needs_whole_tensors_is_refused_on_flat_shards(stage: int) -> None:
    # Adafactor's factored moments (and its RMS) are of whole tensors: on flat slices of
    # buckets it stepped silently differently from torch. layout="tensor" is right.
    opt = optim.from_torch(torch.optim.Adafactor, lr=0.01)

    def make(mesh: fzero.Mesh) -> None:
        fzero.shard_state(_params(), opt, mesh, stage=stage)

    def update(mesh: fzero.Mesh) -> None:
        state = fzero.shard_state(_params(), optim.sgd(lr=0.1), mesh, stage=stage)
        shards = fzero.local_shard(_params(), state.layout, mesh)
        fzero.sharded_update(opt, shards, shards, opt.init(shards.pieces()), mesh=mesh)

    with pytest.raises(ValueError, match=r"shard_state: rank \d: from_torch\(Adafactor\) up"):
        run(2, make)
    flat = r"rank \d: sharded_update: from_torch\(Adafactor\) .*layout='tensor'"
    with pytest.raises(ValueError, match=flat):
        run(2, update)


@pytest.mark.multiprocess
def test_an_optimizer_that_needs_whole_tensors_trains_like_torch_on_whole_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randn(4, 2, generator=g, dtype=F64) for _ in range(2)] for _ in range(3)]
    fzero.testing.assert_stages_equivalent(
        _loss, _params(), batches, (torch.optim.Adafactor, {"lr": 0.01}), layout="tensor"
    )


def test_sharded_update_of_a_full_tree_names_the_mismatched_grads_leaf() -> None:
    # Stage 0's trees: a gradient of the wrong shape or dtype, or a tree of another
    # structure, is refused by name before the optimizer sees it.
    params, opt = _params(), optim.adam(lr=0.1)
    state = opt.init(params)
    bad_shape = _params(layers__1__w=torch.ones(1, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"grads leaf 'layers\.1\.w' is \(1, 3\) torch\.float64"):
        fzero.sharded_update(opt, params, bad_shape, state)
    bad_dtype = _params(scale=torch.tensor(1.0, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"grads leaf 'scale' is \(\) torch\.float32"):
        fzero.sharded_update(opt, params, bad_dtype, state)
    missing = _params()
    del missing["scale"]
    with pytest.raises(ValueError, match=r"differ in structure .*'scale'"):
        fzero.sharded_update(opt, params, missing, state)


class _SparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = torch.nn.Embedding(10, 4, sparse=True)
        self.h = torch.nn.Linear(4, 2)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.h(self.e(i))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("hooked", [False, True])
def test_a_sparse_gradient_is_refused_naming_the_cause(
    world_size: int, stage: int, hooked: bool
) -> None:
    # Without the check: "reshape is not implemented for sparse tensors" from a view's
    # backward at every stage on 2 ranks, an Adam kernel's dispatch error on one.
    from torch.func import functional_call

    torch.manual_seed(0)
    model = _SparseEmbedding().double()

    def go(mesh: fzero.Mesh) -> None:
        opt = optim.adam(lr=0.1)
        params = {k: v.detach() for k, v in model.named_parameters()}
        state = fzero.shard_state(params, opt, mesh, stage=stage, units=["e", "h"])

        def loss_fn(p: dict, batch: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (batch,)).square().mean()

        step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, module=model if hooked else None)
        step(state, torch.tensor([1, 2, 3]))

    for message in errors_on_every_rank(world_size, go):
        assert message.startswith("TypeError: rank ") and "sparse gradient" in message, message
        assert "sparse=False" in message


@pytest.mark.parametrize("given", ["class", "instance", "other"])
def test_an_optimizer_that_is_not_fzeros_is_refused_naming_the_way_in(given: str) -> None:
    """torch's own optimizer, handed to shard_state or sharded_step, failed deep inside
    with "AttributeError: 'AdamW' object has no attribute 'whole_tensors'"."""
    w = torch.zeros(2, requires_grad=True)
    bad = {"class": torch.optim.AdamW, "instance": torch.optim.AdamW([w]), "other": "adamw"}
    hint = r"from_torch\(torch.optim.AdamW" if given != "other" else r"fzero.optim.adamw\(lr"
    with pytest.raises(
        TypeError, match=rf"sharded_update: optimizer must be an fzero.optim .*{hint}"
    ):
        fzero.sharded_update(bad[given], {"a": w.detach()}, {"a": w.detach()}, None)

    def fn(m: fzero.Mesh) -> list[str]:
        out = []
        for call in (
            lambda: fzero.shard_state({"a": torch.zeros(2)}, bad[given], m, stage=1),
            lambda: fzero.sharded_step(lambda p, b: p["a"].sum(), bad[given], m, stage=1),
        ):
            try:
                call()
            except TypeError as exc:
                out.append(str(exc))
        return out

    for said in run(2, fn):
        assert [s.split(":")[0] for s in said] == ["shard_state", "sharded_step"], said
        assert all("optimizer must be an fzero.optim optimizer" in s for s in said), said
