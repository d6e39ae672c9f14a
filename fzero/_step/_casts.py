"""Forward casts: the floating-point inputs of `module=` and of its units' submodules cast
to the compute dtype as each forward starts (FSDP2's `cast_forward_inputs`, at the same
places), and `module=`'s outputs to `Precision.output_dtype`.

A mixed-precision state's loss computes with `param_dtype` parameters; a float32 batch
reaching the first `nn.Linear` would fail there ("mat1 and mat2 must have the same
dtype"). FSDP2, FairScale and DeepSpeed cast the model's floating-point inputs for the
user, and so does a step given `module=`: a forward pre-hook on the module and on every
hooked unit's submodules, live through the backward (a checkpoint's recompute casts
again, as the forward did). Without `module=` the step cannot tell the model's inputs
from the loss's targets and casts nothing: the loss casts (`x.to(param_dtype)`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .._engine import AsForward, forward_methods
from .._state import Precision


def cast_floating(x: Any, dtype: torch.dtype) -> Any:
    """`x` with each floating-point tensor in it cast to `dtype`: tensors, and tensors
    inside tuples, lists, namedtuples (`PackedSequence`), `torch.return_types`, dicts
    (Hugging Face's `ModelOutput` among them) and dataclasses, as FSDP2 walks them.
    Anything else (a cache object, an integer tensor) is returned as it is, and so is a
    container with nothing to cast."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        items = [cast_floating(v, dtype) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        if hasattr(type(x), "_fields"):  # a namedtuple
            return type(x)(*items)
        if type(x) in (tuple, list) or hasattr(type(x), "n_fields"):  # or torch.return_types
            return type(x)(items)
        return x
    if isinstance(x, dict):
        values = {k: cast_floating(v, dtype) for k, v in x.items()}
        if all(values[k] is v for k, v in x.items()):
            return x
        if type(x) in (dict, OrderedDict):
            return type(x)(values)
        out = copy.copy(x)  # keeps the class: a ModelOutput
        for k, v in values.items():
            out[k] = v
        return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
        changed = {k: c for k, v in fields.items() if (c := cast_floating(v, dtype)) is not v}
        return dataclasses.replace(x, **changed) if changed else x
    return x


# One hook object per dtype, reused by every step: a compiled loss traces the hooks it
# finds, and the same objects each call keep its guards satisfied.
_INPUT_HOOKS: dict[torch.dtype, Any] = {}
_OUTPUT_HOOKS: dict[torch.dtype, Any] = {}


def _input_hook(dtype: torch.dtype) -> Any:
    if dtype not in _INPUT_HOOKS:

        def cast_inputs(module: nn.Module, args: Any, kwargs: Any) -> Any:
            return cast_floating(args, dtype), cast_floating(kwargs, dtype)

        _INPUT_HOOKS[dtype] = cast_inputs
    return _INPUT_HOOKS[dtype]


def _output_hook(dtype: torch.dtype) -> Any:
    if dtype not in _OUTPUT_HOOKS:

        def cast_outputs(module: nn.Module, args: Any, output: Any) -> Any:
            return cast_floating(output, dtype)

        _OUTPUT_HOOKS[dtype] = cast_outputs
    return _OUTPUT_HOOKS[dtype]


@contextlib.contextmanager
def forward_casts(
    module: nn.Module | None, hooked: Mapping[str, Any], precision: Precision | None
) -> Iterator[None]:
    """For the block, `module`'s and the hooked units' submodules' floating-point forward
    inputs cast to `precision.param_dtype` (where `cast_forward_inputs`), and `module`'s
    outputs to `precision.output_dtype` (where set). Nothing without `module` or without
    either dtype.

    Args:
      module: `module=`, the root (None: no casts).
      hooked: the units its hooks enter, `{unit: ((submodule, slots), ...)}`.
      precision: the state's (None: no casts).
    """
    inputs = (
        None if precision is None or not precision.cast_forward_inputs else precision.param_dtype
    )
    outputs = None if precision is None else precision.output_dtype
    if module is None or (inputs is None and outputs is None):
        yield
        return
    subs = dict.fromkeys([module, *(sub for members in hooked.values() for sub, _ in members)])
    handles = []
    try:
        if inputs is not None:
            for sub in subs:
                # First, as FSDP2's: the module's own pre-hooks see the cast inputs.
                hook = _input_hook(inputs)
                handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
                # A method run as the forward (`register_forward_method`) casts alike.
                handles += [AsForward(sub, n, (hook,)) for n in forward_methods(sub)]
        if outputs is not None:  # the root's alone: see Precision.output_dtype
            handles.append(module.register_forward_hook(_output_hook(outputs), prepend=True))
        yield
    finally:
        for h in handles:
            h.remove()
