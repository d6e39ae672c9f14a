"""Initializers for `shard_state(init=)`: models larger than a rank, never materialized whole.

Build the model on the meta device, pass its (meta) parameters and buffers to
`shard_state` with one of these, and every rank makes or reads only what it keeps:

    with torch.device("meta"):
        model = GPT(config)
    state = fzero.shard_state(
        dict(model.named_parameters()), opt, mesh, stage=3, units=units,
        buffers=dict(model.named_buffers()),
        init=fzero.init.from_module(model, seed=0),
    )
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._state import FileInit, Init, LeafInit, ModuleInit

__all__ = ["Init", "by_leaf", "from_file", "from_module"]


def from_module(
    module: nn.Module,
    *,
    seed: int = 0,
    device: Any = "cpu",
    init: dict[Any, Callable[[nn.Module], Any]] | None = None,
) -> Init:
    """Values bitwise those of `torch.manual_seed(seed); Model()` built eagerly.

    The construction is replayed one submodule at a time: each submodule that owns
    parameters or buffers directly gets them as empty tensors on `device`, its
    `reset_parameters()` runs, the ranges this rank keeps are copied out, and the
    tensors are dropped; the module is left on the meta device. Submodules run
    children first, then parents, in registration order, which is the order an eager
    construction initializes them in when each module fills what it owns at the end of
    its `__init__` (as torch's layers do). A tied tensor takes the values its first
    holder (in `named_parameters` order) gives it; later holders' inits run on scratch
    copies, as they ran on their own tensors before the tie. The seed drives every
    rank alike, so the values do not depend on the world size, stage, layout or units.

    Args:
      module: the model, built on the meta device; `shard_state`'s params and buffers
        are its `dict(model.named_parameters())` and `dict(model.named_buffers())`.
      seed: what `torch.manual_seed` would be given before the eager construction.
        The caller's generator state is left as it was.
      device: where tensors are materialized and the state is kept.
      init: per submodule path (e.g. "blocks.0.attn") or type (e.g. `RotaryEmbedding`),
        a function `fn(module)` filling that module's own tensors in place, used instead
        of its `reset_parameters`. Needed where a module owns tensors and has no
        `reset_parameters` (nn.MultiheadAttention), or computes buffers (a causal mask,
        RoPE frequencies) only in `__init__`.

    Returns:
      An initializer for `shard_state(..., init=)`. A module owning tensors without an
      init, or an init leaving one of them unwritten (uninitialised memory), raises a
      ValueError naming it.
    """
    return ModuleInit(module, seed, device, init or {})


def by_leaf(
    fn: Callable[[str, torch.Tensor], torch.Tensor], *, seed: int = 0, device: Any = "cpu"
) -> Init:
    """Values `fn(path, like)` per leaf, for parameter trees without an nn.Module.

    JAX's `init(key, shape)`: before each call the default generator is seeded from
    `seed` and the leaf's path alone, so `torch.randn(like.shape)` or
    `torch.nn.init.trunc_normal_(torch.empty_like(like, device=...))` inside `fn` gives
    values that do not depend on the world size, the unit split or the other leaves.

    Args:
      fn: `(path, like) -> Tensor` with `like`'s shape; `like` is a meta tensor with the
        leaf's shape and dtype. The result is converted to the leaf's dtype.
      seed: the base seed.
      device: where the state is kept.

    Returns:
      An initializer for `shard_state(..., init=)`; buffers on the meta device are made
      by `fn` too.
    """
    return LeafInit(fn, seed, device)


def from_file(
    path: str | os.PathLike[str],
    *,
    key: Callable[[str], str] | None = None,
    missing: Init | None = None,
) -> Init:
    """Values read from a safetensors file or a torch.save'd state dict, by range, or from
    a checkpoint sharded over several such files (Hugging Face's `save_pretrained`).

    Each rank reads only the elements it keeps (its slice of every bucket at stage 3),
    straight from the file into its shards, so a pretrained model is loaded into shards
    without any rank holding it whole. Values are converted to the parameters' dtypes,
    as `load_state_dict` does. Both `torch.save(model.state_dict())` files and fzero's
    `checkpoint.export_torch` files are read.

    Args:
      path: the file (format detected from its contents); an index of several files
        (`model.safetensors.index.json`, `pytorch_model.bin.index.json`: each tensor is
        read from the file its `weight_map` names); or a directory holding one of
        `model.safetensors.index.json`, `model.safetensors`, `pytorch_model.bin.index.json`,
        `pytorch_model.bin` (the first found, Hugging Face's order).
      key: maps a leaf path to the file's name for it (e.g. a prefix to strip or add);
        default: the path itself.
      missing: an initializer for leaves the file lacks (a new head when fine-tuning,
        non-persistent buffers such as RoPE's `inv_freq`), e.g. `from_module(...)`;
        without it a missing leaf is an error naming it.

    Returns:
      An initializer for `shard_state(..., init=)`.
    """
    if missing is not None and not isinstance(missing, Init):
        raise TypeError(f"missing must be an fzero.init initializer, got {type(missing)}")
    return FileInit(os.fspath(path), key, missing)
