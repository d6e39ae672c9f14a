"""A model built on fake tensors while its construction is recorded (`fzero.init.deferred`).

The construction runs under torch's FakeTensorMode, which keeps shapes, dtypes and devices
but no values, with `_Recorder` above it (it sees each operation first) noting every aten
operation in a `Recording`.
Random draws are made again on scratch tensors as they happen, so the generator moves as
in an eager construction and the recording notes its state before each (`Recording.draw`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ._record import Recording, seeded, written_by


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording
        self.expected = torch.random.default_generator.get_state()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.recording
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._scalar(args[0])
        writes = bool(written_by(func, args, kwargs))
        node = rec.before(func, args, kwargs) if writes or _makes_tensors(func) else None
        out = func(*args, **kwargs)
        tensors_out = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not (tensors_out or writes):
            return out
        rec.add(node if node is not None else rec.before(func, args, kwargs), out)
        if rec.nodes[-1].random:
            _check_cpu(func, [*tensors_out, *pytree.tree_leaves((args, kwargs))])
            default = kwargs.get("generator") is None
            with _disable_current_modes():
                if default and not torch.equal(self.expected, _default_state()):
                    rec.seed_bound = True  # seeded or drawn outside the recorded operations
                rec.draw(len(rec.nodes) - 1)
                if default:
                    self.expected = _default_state()
        return out

    def _scalar(self, t: torch.Tensor) -> Any:
        """`.item()` during construction: the value is made now, from the record so far;
        if it depends on random draws, the recording holds for its seed only."""
        rec = self.recording
        tid = rec.tid(t)
        rec.seed_bound |= any(rec.nodes[i].random for i in rec.needed([tid]))
        with _disable_current_modes():
            return rec.replay([tid])[tid].item()


def record(fn: Callable[[], Any], seed: int) -> tuple[Any, Recording]:
    """Runs `fn()` on fake tensors, recording its operations, the default generator seeded
    with `seed` for its draws (made on scratch tensors) and restored afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recording = Recording(seed)
    with seeded(seed), FakeTensorMode(allow_non_fake_inputs=True), _Recorder(recording):
        try:
            out = fn()
        except RuntimeError as exc:
            # torch swaps a fake parameter for its converted one, which FakeTensorMode's
            # own references to it forbid (torch 2.13, without fzero too).
            if not str(exc).startswith("_apply(): Couldn't swap"):
                raise
            raise RuntimeError(
                f"fzero.init.deferred: the construction converts a module ({exc}): "
                "Module.to(dtype), .double() or .half() cannot run on the fake tensors a "
                "deferred model is built on. Convert the model deferred returns instead "
                "(fzero.init.deferred(Model, ...).to(torch.bfloat16): from_module then "
                "makes the converted values, bitwise), or build it in that dtype"
            ) from exc
    return out, recording


def _makes_tensors(func: Any) -> bool:
    """Whether `func`'s schema returns tensors (known before it runs)."""
    return any("Tensor" in str(r.type) for r in func._schema.returns)


def _check_cpu(func: Any, values: list[Any]) -> None:
    """A draw on another device used that device's generator, which the replay (on the
    CPU) cannot follow: refused, naming it."""
    for x in values:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            raise ValueError(
                f"fzero.init.deferred: the construction draws random numbers on {x.device} "
                f"({func}); deferred construction replays CPU draws only: build the model on "
                "the CPU (the default device) and pass device= to fzero.init.from_module"
            )


def _default_state() -> torch.Tensor:
    return torch.random.default_generator.get_state()


def recorded(t: torch.Tensor) -> tuple[Recording, int] | None:
    """The recording and tensor id a deferred model's parameter or buffer was made by."""
    return getattr(t, "_fzero_recorded", None)


_SLOTS = "_fzero_recorded_slots"  # a module's: name -> (recording, tid, shape, dtype)


def is_deferred(module: torch.nn.Module) -> bool:
    """Whether `module` (or a submodule) was built by `deferred`."""
    return any(_SLOTS in m.__dict__ for m in module.modules())


def recorded_at(
    module: torch.nn.Module, path: str, t: torch.Tensor
) -> tuple[Recording, int] | None:
    """`recorded(t)`, or what `deferred` left at `path` of `module` where a conversion
    since (`model.to(torch.bfloat16)`: a buffer, a parameter under torch's
    `overwrite_module_params_on_conversion`) put a meta tensor of its shape and another
    dtype there; `from_module` casts the replayed value to it. One of the same dtype is
    a replacement, not a conversion: not the recorded tensor."""
    found = recorded(t)
    if found is not None or t.device.type != "meta":
        return found
    slot = slot_at(module, path)
    if slot is None or slot[2:] == (tuple(t.shape), t.dtype) or slot[2] != tuple(t.shape):
        return None
    return slot[:2]


def slot_at(module: torch.nn.Module, path: str) -> tuple[Any, ...] | None:
    """What `deferred` recorded at `path` of `module` (None: nothing)."""
    head, _, name = path.rpartition(".")
    return getattr(module.get_submodule(head), _SLOTS, {}).get(name)


def deferred(fn: Callable[..., Any], *args: Any, seed: int = 0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` recorded, its modules' parameters and buffers left on the meta
    device, each remembering how the construction made it (`recorded`). Tensors a module
    holds outside its parameters and buffers are made now (they must not depend on random
    draws)."""
    out, rec = record(lambda: fn(*args, **kwargs), seed)
    modules = [out] if isinstance(out, torch.nn.Module) else []
    metas: dict[int, torch.Tensor] = {}

    def meta_of(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in metas:
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if param:
                m = torch.nn.Parameter(m, requires_grad=t.requires_grad)
            m._fzero_recorded = (rec, rec.tid(t))  # type: ignore[attr-defined]
            metas[id(t)] = m
        return metas[id(t)]

    for root in modules:
        for m in root.modules():
            slots = {}
            for name, t in m._parameters.items():
                if t is not None:
                    m._parameters[name] = meta_of(t, True)
                    slots[name] = (*recorded(m._parameters[name]), tuple(t.shape), t.dtype)
            for name, t in m._buffers.items():
                if t is not None:
                    m._buffers[name] = meta_of(t, False)
                    slots[name] = (*recorded(m._buffers[name]), tuple(t.shape), t.dtype)
            m.__dict__[_SLOTS] = slots
            for name, v in list(vars(m).items()):
                if isinstance(v, torch._subclasses.fake_tensor.FakeTensor):
                    tid = rec.tid(v)
                    setattr(m, name, rec.replay([tid])[tid])
    return out
