"""assert_stages_equivalent: every ZeRO stage against one process running torch.optim."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import optim
from .._comm import Mesh
from .._core import (
    PyTree,
    UnitSpec,
    assert_trees_close,
    check_distinct,
    check_leaves,
    leaf_paths,
    tree_flatten,
    tree_map,
)
from .._engine import gather_params
from .._state import frozen_leaves, shard_state
from .._step import sharded_step
from ._reference import train_reference
from ._simulate import Simulation

# Default (rtol, atol) for float64 and float32 parameters. fzero and the reference differ
# only in the order of floating-point reductions (a mean over ranks against autograd over
# a summed loss), which a few optimizer steps amplify a little. Half precision gets no
# fixed default: its tolerance is measured on every call (`_measured_tolerance`).
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
}
# A half-precision stage may differ from the reference by this many times what the
# reference differs from itself when its gradients are reduced in the other valid order.
_MEASURED_FACTOR = 4.0


def assert_stages_equivalent(
    loss_fn: Callable[[PyTree, Any], torch.Tensor],
    params: PyTree,
    batches: Sequence[Sequence[Any]],
    optimizer: Any,
    *,
    stages: Sequence[int] = (0, 1, 2, 3),
    fzero_optimizer: optim.Optimizer | None = None,
    groups: Sequence[Mapping[str, Any]] | None = None,
    layout: str = "flat",
    units: Sequence[UnitSpec] | None = None,
    module: nn.Module | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    timeout: float | None = 600.0,
    compile: bool | str = False,
) -> None:
    """Asserts every ZeRO stage trains `params` exactly like one process with `torch.optim`.

    The reference runs here: plain autograd and `cls(params, **kwargs)`, its loss at step
    t the mean of `loss_fn` over the step's micro-batches (the loss on the concatenated
    batch, for a mean loss over equal micro-batches). A parameter the loss does not use
    gets a zero gradient there, as fzero gives it (torch.optim would skip a `.grad` of
    None; docs/training.md, "Unused parameters"). Each stage then runs on
    `fzero.simulate` with one rank per micro-batch; the parameters every rank gathers
    after the last step, and the per-step losses averaged over ranks, must match.

    Args:
      loss_fn: `(params, batch) -> scalar tensor` or `(total, weight)`, as for
        `fzero.sharded_step`; it must read every parameter from `params` (one read off
        the model itself is named: a ValueError).
      params: the initial parameter tree; not modified. Leaves that do not require grad,
        where others do, are frozen in both.
      batches: per step, one micro-batch per rank in rank order (`split_batch`).
      optimizer: a `torch.optim.Optimizer` class, or `(cls, kwargs)`: the ranks run
        `fzero.optim.from_torch(cls, **kwargs)`.
      stages: the ZeRO stages to check.
      fzero_optimizer: what the ranks run instead, to check an `fzero.optim` optimizer.
      groups: torch's param groups, each a dict whose `"params"` is a predicate on
        parameter paths or a list of paths (a leaf goes to the first that claims it;
        every trained leaf must be claimed) and whose other keys override `optimizer`'s
        kwargs for it: the reference builds its optimizer with them, and the ranks run
        `fzero.optim.param_groups` of fzero's `adam`, `adamw` or `sgd` (for
        torch.optim.Adam, AdamW or SGD) or of `from_torch(cls)` (other classes).
      layout, units, module: `shard_state`'s and `sharded_step`'s; the reference binds
        `module`'s parameters to its own tensors through each forward and backward (a
        model checkpointing with `torch.utils.checkpoint` recomputes with them) and runs
        their gradient hooks on them.
      rtol, atol: tolerances; by default 1e-7 / 1e-9 for float64, 1e-4 / 1e-5 for float32,
        and for half precision an `atol` measured on every call: 4 times what two
        reduction orders of the reference differ by (docs/testing.md).
      timeout: seconds all stages together may take (None: no limit); a rank stuck in a
        collective fails after 60 s regardless.
      compile: `sharded_step`'s: every stage's step traced by torch.compile (True:
        inductor; a string: that backend, such as "aot_eager", the same graphs without
        inductor's code generation, quicker to compile), each rank compiling its own.

    Raises:
      AssertionError: naming each failing stage with its first differing leaf, the
        largest |Δ| and the tolerance, the first step whose loss differs, or a stage whose
        parameters did not move where the reference's did.
      ValueError: if `batches` is empty or ragged, the reference moves nothing, or the
        loss reads a tensor that requires grad from outside `params`.
    """
    cls, kwargs = _optimizer_spec(optimizer)
    world_size = _world_size(batches)
    leaves, _ = tree_flatten(params)
    check_leaves(leaf_paths(params), leaves)  # before the reference trips on them
    check_distinct(leaf_paths(params), leaves, frozen_leaves(params, None))
    expected, expected_losses = train_reference(
        loss_fn, params, batches, cls, kwargs, groups, module=module
    )
    default_rtol, default_atol, loss_atol = _default_tolerance(leaves)
    per_leaf: dict[str, float] = {}  # measured atol of half-precision leaves, by path
    if rtol is None and atol is None and any(_is_half(x) for x in leaves):
        other, other_losses = train_reference(
            loss_fn, params, batches, cls, kwargs, groups, "ranks", module
        )
        per_leaf, loss_atol = _measured_tolerance(expected, other, expected_losses, other_losses)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    loss_atol = max(atol, loss_atol)
    moved = _moved(params, expected, rtol, atol, per_leaf)
    fz_opt = fzero_optimizer or _fzero_optimizer(cls, kwargs, groups)
    if compile:
        _compile_here_once()
    sim = Simulation(world_size, collective_timeout=60.0, timeout=timeout)
    per_rank = sim.run(
        _train_stages, loss_fn, params, batches, fz_opt, tuple(stages), layout, units, module,
        compile,
    )  # fmt: skip
    failures = []
    for i, stage in enumerate(stages):
        problem = _compare_stage(
            stage,
            [r[i] for r in per_rank],
            (params, moved, expected, expected_losses),
            (rtol, atol, per_leaf, loss_atol),
        )
        if problem is not None:
            failures.append(problem)
    if failures:
        how = f" compiled ({compile!r})" if compile else ""
        # A loss drawing random numbers (dropout) cannot match: say so, if the reference
        # itself trains otherwise when run again.
        again, _ = train_reference(loss_fn, params, batches, cls, kwargs, groups, module=module)
        same = all(
            torch.equal(a, b) for a, b in zip(tree_flatten(again)[0], tree_flatten(expected)[0])
        )
        raise AssertionError(
            f"{len(failures)} of {len(stages)} ZeRO stages{how} on {world_size} ranks do not train "
            f"like one process running torch.optim.{cls.__name__}({_kwargs_text(kwargs)}) on "
            "the concatenated batches:\n"
            + "\n".join(f"  {p}" for p in failures)
            + (
                ""
                if same
                else "\nThe one-process reference trains otherwise when run again: the loss "
                "is not deterministic (dropout, or another draw from torch's generator). "
                "Compare with it off (model.eval()), or draw from a generator seeded by the "
                "batch."
            )
        )


def _optimizer_spec(optimizer: Any) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if isinstance(optimizer, tuple) and len(optimizer) == 2:
        cls, kwargs = optimizer
    else:
        cls, kwargs = optimizer, {}
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer class or (class, kwargs), got {optimizer!r}"
        )
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"optimizer kwargs must be a mapping, got {kwargs!r}")
    return cls, dict(kwargs)


def _kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _world_size(batches: Sequence[Sequence[Any]]) -> int:
    lengths = {len(step) for step in batches}
    if not lengths:
        raise ValueError("batches is empty: give at least one step of per-rank micro-batches")
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"every step needs one micro-batch per rank, the same number each step; "
            f"got step lengths {sorted(lengths)}"
        )
    return lengths.pop()


def _is_half(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16)


def _default_tolerance(leaves: list[Any]) -> tuple[float, float, float]:
    """(rtol, atol, loss atol) of the least precise float32/float64 leaf (half precision
    is measured separately)."""
    worst = (0.0, 0.0)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and not _is_half(leaf):
            worst = max(worst, _TOLERANCES.get(leaf.dtype, _TOLERANCES[torch.float32]))
    return (*worst, worst[1])


def _measured_tolerance(
    expected: PyTree, other: PyTree, losses: list[float], other_losses: list[float]
) -> tuple[dict[str, float], float]:
    """Per half-precision leaf path, the atol a stage gets: `_MEASURED_FACTOR` times how far
    the reference trained in the ranks' reduction order lands from the reference, at least
    2 ulps of the leaf's largest value; and the same for the losses."""
    out = {}
    for path, a, b in zip(leaf_paths(expected), tree_flatten(expected)[0], tree_flatten(other)[0]):
        if _is_half(a) and a.numel():
            gap = float((a.double() - b.double()).abs().max())
            ulp = torch.finfo(a.dtype).eps * float(a.double().abs().max())
            out[path] = max(_MEASURED_FACTOR * gap, 2 * ulp)
    gap = max((abs(x - y) for x, y in zip(losses, other_losses)), default=0.0)
    ulp = torch.finfo(torch.bfloat16).eps * max((abs(x) for x in losses), default=0.0)
    return out, max(_MEASURED_FACTOR * gap, 2 * ulp)


def _leaf_atol(path: str, atol: float, per_leaf: dict[str, float]) -> float:
    return per_leaf.get(path, atol)


def _moved(
    initial: PyTree, expected: PyTree, rtol: float, atol: float, per_leaf: dict[str, float]
) -> dict[str, float]:
    """Per leaf path: how far the reference moved it (max |Δ|), for the leaves it moved by
    more than the tolerance. Raises ValueError if it moved none: a stage that did nothing
    would then pass."""
    out = {}
    for path, a, b in zip(leaf_paths(initial), tree_flatten(initial)[0], tree_flatten(expected)[0]):
        if a.numel():
            a = a.detach().double()
            delta = float((b.double() - a).abs().max())
            if delta > _leaf_atol(path, atol, per_leaf) + rtol * float(a.abs().max()):
                out[path] = delta
    if not out:
        raise ValueError(
            "assert_stages_equivalent: the reference moved no parameter by more than the "
            f"tolerance (rtol={rtol}, atol={atol}), so a stage that did nothing would pass; "
            "train more steps or with a larger learning rate, or tighten the tolerance"
        )
    return out


def _fzero_optimizer(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], groups: Any
) -> optim.Optimizer:
    """What the ranks run for torch's `cls(**kwargs)`: `from_torch`, with `groups` in
    `param_groups` (of fzero's own optimizer, for torch's Adam, AdamW and SGD)."""
    if groups is None:
        return optim.from_torch(cls, **kwargs)
    own = {torch.optim.Adam: optim.adam, torch.optim.AdamW: optim.adamw, torch.optim.SGD: optim.sgd}
    if cls not in own:
        return optim.param_groups(functools.partial(optim.from_torch, cls), groups, **kwargs)
    # How torch runs its kernels, not what they compute: fzero's own take none of them.
    same = {k: v for k, v in kwargs.items() if k not in _TORCH_ONLY}
    make = own[cls]
    if same.pop("decoupled_weight_decay", cls is torch.optim.AdamW):  # torch's Adam as AdamW
        make = optim.adamw
    return optim.param_groups(make, groups, **same)


_TORCH_ONLY = frozenset({"foreach", "fused", "capturable", "differentiable"})


@functools.cache
def _compile_here_once() -> None:
    """Compiles a trivial function in this process: the ranks `Simulation` forks from it
    inherit torch.compile's set-up instead of each paying it (about 2 s a rank, on every
    call of a property test)."""
    x = torch.ones(2, requires_grad=True)
    torch.compile(lambda t: (t * 2).sum(), backend="aot_eager")(x).backward()


def _train_stages(
    mesh: Mesh,
    loss_fn: Callable[[PyTree, Any], torch.Tensor],
    params: PyTree,
    batches: Sequence[Sequence[Any]],
    opt: optim.Optimizer,
    stage_list: tuple[int, ...],
    layout: str,
    units: Sequence[UnitSpec] | None,
    module: nn.Module | None,
    compile: bool | str = False,
) -> list[tuple[PyTree, list[float]]]:
    """One rank's run of every stage in turn: (gathered params, losses) per stage."""
    out = []
    for stage in stage_list:
        try:
            state = shard_state(params, opt, mesh, stage=stage, layout=layout, units=units)
            step = sharded_step(loss_fn, opt, mesh, stage=stage, module=module, compile=compile)
            losses = []
            for micro_batches in batches:
                state, loss = step(state, micro_batches[mesh.rank])
                losses.append(loss.item())
            full = tree_map(lambda x: x.detach().clone(), gather_params(state.params, mesh))
        except Exception as exc:
            how = f" compiled ({compile!r})" if compile else ""
            exc.add_note(f"while training ZeRO stage {stage}{how} under fzero.testing")
            raise
        out.append((full, losses))
    return out


def _compare_stage(
    stage: int,
    results: list[tuple[PyTree, list[float]]],
    reference: tuple[PyTree, dict[str, float], PyTree, list[float]],
    tolerance: tuple[float, float, dict[str, float], float],
) -> str | None:
    """The first discrepancy of `stage` against the reference, or None."""
    initial, moved, expected, expected_losses = reference
    rtol, atol, per_leaf, loss_atol = tolerance
    paths = leaf_paths(initial)
    for rank, (got, _) in enumerate(results):
        what = f"stage {stage}, rank {rank}"
        for path, a, b in zip(paths, tree_flatten(initial)[0], tree_flatten(got)[0]):
            if path in moved and float((b.double() - a.detach().double()).abs().max()) == 0:
                return (
                    f"{what}: leaf {path!r} did not move; the reference moved it by max "
                    f"|Δ| = {moved[path]:.3e}"
                )
        try:
            if not per_leaf:
                assert_trees_close(got, expected, rtol=rtol, atol=atol, what=what)
                continue
            assert_trees_close(got, expected, rtol=float("inf"), atol=0, what=what)  # structure
            for path, a, b in zip(paths, tree_flatten(got)[0], tree_flatten(expected)[0]):
                tol = _leaf_atol(path, atol, per_leaf)
                assert_trees_close({path: a}, {path: b}, rtol=rtol, atol=tol, what=what)
        except AssertionError as exc:
            return str(exc)
    for t, want in enumerate(expected_losses):
        got_loss = sum(losses[t] for _, losses in results) / len(results)
        if abs(got_loss - want) > loss_atol + rtol * abs(want):
            return (
                f"stage {stage}: step {t} loss (mean over ranks) {got_loss!r} != reference "
                f"{want!r} (rtol={rtol}, atol={loss_atol})"
            )
    return None
