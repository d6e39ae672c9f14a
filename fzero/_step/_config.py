"""The step's configuration, agreed among the ranks on its first call.

Everything a step's collectives depend on must be the same on every rank: a rank built
with another stage, unit list, `quantize=` or `reshard_after_forward=` issues other
collectives, which hang or, on gloo, abort the process ("Received data size doesn't match
expected size"). The first call compares them, with what each rank's first step has to
say (an error of its own checks, whether it has a batch), in one exchange before its first
collective, and every rank raises the same error if they differ (docs/design.md, [Note:
failing together]). Later steps agree on their micro-batch count in the call check.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import warnings
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import leaf_paths, stage_of, tree_map
from .._engine import micro_batches_differ
from .._state import ShardedState, init_optimizer
from ..optim import Optimizer
from ..optim._groups import unlisted
from ._options import StepOptions


def configuration(o: StepOptions, state: ShardedState, optimizer: Optimizer) -> dict[str, str]:
    """What must be equal on every rank, each as a readable string."""
    lay, mesh = state.layout, o.mesh
    shapes = "|".join(f"{p}:{s}:{d}" for p, s, d in zip(lay.paths, lay.shapes, lay.dtypes))
    return {
        "stage": str(o.stage.number),
        "mesh": f"{mesh.size} ranks, shard_size {mesh.shard_size}",
        "layout": repr(lay.kind),
        "units": repr(list(lay.members)),
        "parameters": f"{len(lay.paths)} leaves, digest {_digest(shapes)}",
        "frozen": repr([b.frozen for b in lay.buckets]),
        "precision": repr(state.precision),
        "offloaded": repr(state.offload is not None),  # its masters are gathered to export
        "loss scaler": type(state.scaler).__name__,
        "buffers": "none" if state.buffers is None else _digest(str(leaf_paths(state.buffers))),
        "optimizer": optimizer_kind(optimizer),
        "reshard_after_forward": repr(o.reshard),
        "quantize": repr(o.quantize),
        "accumulate": repr(o.accumulate),
        "just_in_time": repr(o.just_in_time),
        "module": "given" if o.module is not None else "none",
        "prefetch": repr(o.prefetch),
        "overlap_reduce": repr(o.overlap_reduce),
        "reduce_bucket_bytes": repr(o.reduce_bucket_bytes),
        "buffer_sync": repr(o.buffer_sync),
        "compile": repr(o.compile),
        "has_aux": repr(o.has_aux),
    }


def optimizer_kind(optimizer: Optimizer) -> str:
    """The optimizer's kind and hyperparameters: its in-place update's name and the
    immutable values its closure holds (numbers, names, the torch class and options of
    `from_torch`, the optimizers a `chain` or `param_groups` holds); a function of the
    user's by its name. Every fzero optimizer's `update` is `from_inplace`'s: its name
    alone told no two apart (ranks at other learning rates trained on, each its own
    shard)."""
    return _described(optimizer.update_ or optimizer.update, 0)


def _described(fn: Any, depth: int) -> str:
    said = getattr(fn, "fzero_description", None)  # what fzero's own object says it holds
    if isinstance(said, str):
        return said
    fn = inspect.unwrap(fn)  # torch.no_grad's wrapper: the function it wraps
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    # A function of the user's (a schedule, a transform) by its name only: what it holds
    # may differ by rank and rightly so (the rank, for logging).
    if code is None or not cells or depth > 3 or not name.startswith("fzero."):
        return name
    held = []
    for var, cell in zip(code.co_freevars, cells, strict=True):
        with contextlib.suppress(ValueError):  # a cell not yet filled
            held.append(f"{var}={_value(cell.cell_contents, depth + 1)}")
    return f"{name}({', '.join(held)})"


def _stepper(v: Any) -> bool:
    """An fzero optimizer or gradient transformation: a NamedTuple with an `update`."""
    return isinstance(v, tuple) and hasattr(v, "_fields") and "update" in v._fields


def _value(v: Any, depth: int) -> str:
    """`v` as every rank holding the same would write it: no addresses, no tensor data
    but a single number's."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        return repr(v.item()) if v.numel() == 1 and v.device.type != "meta" else "Tensor"
    if isinstance(v, type):
        return v.__qualname__
    if _stepper(v):  # an Optimizer, a GradientTransformation
        return _described(getattr(v, "update_", None) or v.update, depth)
    # A tuple's contents, and a list of optimizers or transformations (param_groups',
    # chain's); not a dict, a set or another list's: a cache of what this rank holds.
    steppers = isinstance(v, list) and all(map(_stepper, v))
    if (isinstance(v, tuple) or steppers) and depth <= 3:
        return "(" + ", ".join(_value(x, depth + 1) for x in v) + ")"
    if isinstance(v, (dict, list, set)):
        return type(v).__name__
    if callable(v):
        return _described(v, depth)
    return type(v).__name__


def check_optimizer_state(
    optimizer: Optimizer, state: ShardedState, rank: int, shard_rank: int
) -> None:
    """Raises a ValueError if a param group of `optimizer` lists a path that is no leaf of
    the state, and a TypeError naming both if `state.opt_state` was not made by `optimizer`:
    its structure against what `optimizer.init` makes of the same parameters (on the
    meta device: nothing is allocated) for this rank's place on the shard axis,
    `shard_rank` (its rank but on a 2-D mesh). A state another optimizer made would
    otherwise step silently (SGD reading an Adam state) or fail deep inside the update."""

    said = unlisted(optimizer, getattr(getattr(state, "layout", None), "paths", ()))
    if said:
        raise ValueError(f"rank {rank}: {said}")

    def meta(tree: Any) -> Any:
        return tree_map(lambda x: torch.empty_like(x, device="meta"), tree)

    try:
        stage, lay = stage_of(state.stage), state.layout
        master = None if state.master is None else meta(state.master)
        expected = init_optimizer(meta(state.params), optimizer, stage, lay, shard_rank, master)
    except Exception:
        return
    want, got = _skeleton(expected), _skeleton(state.opt_state)
    if want != got:
        raise TypeError(
            f"rank {rank}: the state's optimizer state is not this step's optimizer's: it "
            f"holds {_short(got)}, while the step's optimizer "
            f"({_short(optimizer_kind(optimizer))}) "
            f"makes {_short(want)}. Build the state with the optimizer that steps it "
            "(shard_state(..., optimizer) and sharded_step(..., optimizer) take the same one)"
        )


def check_module(module: Any, state: ShardedState, rank: int) -> None:
    """Raises a ValueError naming the first of `module`'s parameters and buffers that is on
    the meta device and not supplied by the state: the forward would read it as it is
    (torch's "Cannot copy out of meta tensor", from deep inside the model)."""
    if module is None:
        return
    have = set(state.layout.paths)
    have.update(leaf_paths(state.buffers) if state.buffers is not None else ())
    named = {
        "parameter": list(module.named_parameters(remove_duplicate=False)),
        "buffer": list(module.named_buffers(remove_duplicate=False)),
    }
    # A tied tensor is supplied under any of its names (functional_call ties them).
    supplied = {id(t) for pairs in named.values() for n, t in pairs if n in have}
    for kind, pairs in named.items():
        left = [n for n, t in pairs if t.device.type == "meta" and id(t) not in supplied]
        if left:
            raise ValueError(
                f"rank {rank}: module= has {kind} {left[0]!r} on the meta device, and the "
                f"state has no leaf of that path ({len(left)} such {kind}s): pass "
                "shard_state(dict(model.named_parameters()), ..., buffers="
                "dict(model.named_buffers()), init=fzero.init.from_module(model)) so that "
                "the state makes and holds them (non-persistent buffers such as RoPE's "
                "inv_freq included)"
            )


def say_frozen_trained(module: Any, state: ShardedState, rank: int) -> None:
    """Warns where `module=` freezes some of its parameters (`requires_grad=False`, others
    not) that the state trains under the same paths: a tree made by `v.detach().clone()`
    drops the flag, and a table the model keeps fixed (Whisper's sinusoidal positions, a
    LoRA base) would train, unlike under torch.optim over the trainable parameters.
    Once per step function, at its first step (under warnings-as-errors, an error every
    rank raises there)."""
    if module is None:
        return
    pairs = list(module.named_parameters(remove_duplicate=False))
    fixed = {n for n, p in pairs if not p.requires_grad}
    if not fixed or len(fixed) == len(pairs):  # all or nothing: no choice was made
        return
    lay = state.layout
    paths = [p for i, p in enumerate(lay.paths) if not lay.frozen[i] and p in fixed]
    if paths:
        more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        warnings.warn(
            f"fzero: rank {rank}: the state trains {len(paths)} parameter(s) that module= "
            f"freezes (requires_grad=False): {paths[:3]}{more}. The state's leaves were made "
            "without the flag (v.detach().clone() drops it): pass shard_state(..., "
            "frozen=[...]), or keep it (v.detach().clone().requires_grad_(v.requires_grad)). "
            "Said once",
            RuntimeWarning,
            stacklevel=5,
        )


def flag_changed_said(path: str, module: Any, rank: int) -> str:
    """Why this rank refuses a step ("" if it does not): `module=`'s parameter `path` was
    frozen or unfrozen (`requires_grad_`) since the step function's first step, so that
    it now disagrees with the state's frozen leaves."""
    if not path:
        return ""
    now = dict(module.named_parameters(remove_duplicate=False))[path].requires_grad
    how = (
        "was unfrozen (requires_grad_(True)): the state holds it frozen, with no optimizer "
        "state; make a new state from fzero.master_params with shard_state(..., frozen=...)"
        if now
        else "was frozen (requires_grad_(False)): the state still trains it; save a "
        "checkpoint and load it with checkpoint.load(..., frozen=...)"
    )
    return (
        f"fzero: rank {rank}: module='s parameter {path!r} {how}. A state's frozen leaves "
        "are fixed when it is made, and torch.optim would now train it otherwise"
    )


def _skeleton(x: Any) -> Any:
    """The containers of an optimizer state, without what fills in as it steps: a dict
    (torch's per-parameter state, empty until the first step) counts as any dict."""
    if isinstance(x, dict):
        return "dict"
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_skeleton(v) for v in x))
    return "tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _short(skeleton: Any) -> str:
    text = str(skeleton).replace("'", "")
    return text if len(text) <= 160 else text[:157] + "..."


def agree(
    mesh: Mesh, config: dict[str, str] | None, error: BaseException | None, present: bool
) -> list[bool]:
    """Compares this rank's `config` (None when its own checks raised `error`) with every
    other rank's; raises the same error on every rank when a rank's checks failed or the
    configurations differ. Returns per rank whether it has a batch."""
    mine = {
        "config": config,
        "error": None if error is None else (type(error).__name__, str(error)),
        "present": present,
    }
    everyone = _comm.all_gather_object(mine, mesh)
    errors = [(r, e["error"]) for r, e in enumerate(everyone) if e["error"] is not None]
    if errors:
        cls = {"TypeError": TypeError}.get(errors[0][1][0], ValueError)
        said = "; ".join(_naming(r, message) for r, (_, message) in errors)
        raise _comm.agreed(cls(said)) from error  # the cause, on the rank that had it
    configs = [e["config"] for e in everyone]
    differ = [k for k in configs[0] if len({repr(c.get(k)) for c in configs}) > 1]
    if differ == ["micro-batches"]:  # a short rank's list, as at any later step
        raise micro_batches_differ([c["micro-batches"] for c in configs])
    if differ:
        lines = "; ".join(
            f"{k}: "
            + ", ".join(
                f"rank {r}: {v}" for r, v in enumerate(_where_differ([c.get(k) for c in configs]))
            )
            for k in differ
        )
        raise _comm.agreed(
            ValueError(
                f"the ranks' steps differ ({lines}). Every rank must build its state and "
                "sharded_step alike: their collectives pair up only if each rank issues the "
                "same ones"
            )
        )
    return [bool(e["present"]) for e in everyone]


def _where_differ(values: list[Any], width: int = 100) -> list[Any]:
    """Long values (an optimizer's chain of transformations and hyper-parameters) cut to
    where the ranks' first differ, with a few characters of context: a common start cut
    at a fixed length hid the difference itself (clipping's max_norm behind Adam's)."""
    texts = [str(v) for v in values]
    if max(map(len, texts)) <= width:
        return values
    first = next((i for i, cs in enumerate(zip(*texts)) if len(set(cs)) > 1), min(map(len, texts)))
    lo = max(0, first - 30)
    return [
        ("..." if lo else "") + t[lo : lo + width] + ("..." if lo + width < len(t) else "")
        for t in texts
    ]


def _naming(rank: int, message: str) -> str:
    """`message`, beginning with the rank that said it."""
    return message if message.startswith(f"rank {rank}") else f"rank {rank}: {message}"


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
