"""Norm dtypes: a norm layer whose weight a Precision casts away from the dtype of its
running statistics, named where torch's batch_norm refuses the pair."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch
from torch import nn

from .._core import leaf_paths, tree_flatten
from .._state import ShardedState

# Where torch's norms reach the kernel that wants weight and statistics in one dtype.
_KERNEL_CALLERS = frozenset({"batch_norm", "instance_norm"})
_DTYPE_WORDS = ("expected scalar type", "dtype", "data type")


@contextlib.contextmanager
def norm_dtypes_named(module: nn.Module | None, state: ShardedState, rank: int) -> Iterator[None]:
    """Within the block, a RuntimeError raised inside torch's `batch_norm` or
    `instance_norm` becomes a ValueError naming the first of `module`'s norm layers whose
    weight computes in `Precision.param_dtype` while its running statistics are in
    another dtype (torch's "expected scalar type BFloat16 but found Float" names
    neither), with the remedies; other errors pass as they are."""
    try:
        yield
    except RuntimeError as exc:
        said = _said(exc, module, state, rank)
        if said is None:
            raise
        raise ValueError(said) from exc


def _said(
    exc: RuntimeError, module: nn.Module | None, state: ShardedState, rank: int
) -> str | None:
    precision = getattr(state, "precision", None)
    if module is None or precision is None or precision.param_dtype is None:
        return None
    # torch's words for a dtype it did not expect, on the CPU and CUDA; anything else (a
    # shape, out of memory) passes as it is.
    said = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or not any(w in said for w in _DTYPE_WORDS):
        return None
    if not _inside_a_norm(exc.__traceback__):
        return None
    cast = set(state.layout.paths)
    held = {}
    if state.buffers is not None:
        held = dict(zip(leaf_paths(state.buffers), tree_flatten(state.buffers)[0]))
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.modules.batchnorm._NormBase):
            continue
        at = f"{name}." if name else ""
        mean = sub.running_mean
        if sub.weight is None or mean is None or f"{at}weight" not in cast:
            continue
        in_state = f"{at}running_mean" in held
        stats = mean.dtype  # the module's own; else as the state holds them, or casts them
        if in_state:
            stats = precision.buffer_dtype or held[f"{at}running_mean"].dtype
        if stats == precision.param_dtype:
            continue
        p = precision.param_dtype
        keep = (
            f"Precision(param_dtype={p}, buffer_dtype={p})"
            if in_state
            else f"the norm's own .to({p}), or hand them to the state (shard_state(buffers="
            f"...)) with Precision(buffer_dtype={p})"
        )
        return (
            f"rank {rank}: module= has {type(sub).__name__} {name or '(the root)'!r}, whose "
            f"weight computes in {p} (Precision.param_dtype) and whose running statistics "
            f"are {stats}: torch's batch_norm takes them in one dtype (it said: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). Keep the "
            f"statistics in the compute dtype, {keep}; or keep the norms' parameters in "
            f"float32: hold the model in {p} except its norm layers and pass "
            "Precision(master_dtype=torch.float32) without param_dtype (a norm then takes "
            f"{p} inputs with float32 weight and statistics, as under autocast)"
        )
    return None


def _inside_a_norm(tb: types.TracebackType | None) -> bool:
    """Whether the traceback passes through torch.nn.functional's batch or instance norm
    (eagerly), or calls a batch norm operator (from a compiled graph)."""
    while tb is not None:
        code = tb.tb_frame.f_code
        where = code.co_filename.replace("\\", "/")
        if code.co_name in _KERNEL_CALLERS and where.endswith("nn/functional.py"):
            return True
        # A graph calls the operator (`aten._native_batch_norm_legit...`) through its
        # OpOverload's __call__; instance norm is batch norm there.
        op = tb.tb_frame.f_locals.get("self") if where.endswith("torch/_ops.py") else None
        if op is not None and "batch_norm" in str(op):
            return True
        tb = tb.tb_next
    return False
