"""Initializers for `shard_state(init=)`: models larger than a rank, never materialized whole.

Build the model without memory (`deferred`: its construction recorded on fake tensors,
or on the meta device), pass its (meta) parameters and buffers to `shard_state` with one
of these, and every rank makes or reads only what it keeps:

    model = fzero.init.deferred(GPT, config)
    state = fzero.shard_state(
        dict(model.named_parameters()), opt, mesh, stage=3, units=units,
        buffers=dict(model.named_buffers()),
        init=fzero.init.from_module(model, seed=0),  # or from_file(pretrained_dir, ...)
    )
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._state import FileInit, Init, LeafInit, ModuleInit, RecordedInit, ValuesInit, is_deferred
from ._state import deferred as _deferred

__all__ = ["Init", "by_leaf", "deferred", "from_file", "from_module"]


def deferred(fn: Callable[..., Any], *args: Any, seed: int = 0, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a model's constructor) built without memory, recorded so that
    `from_module` makes bitwise the values an eager `torch.manual_seed(seed); fn(...)` makes.

    The construction runs on fake tensors (shapes, dtypes and devices, no values) while
    every aten operation it makes is recorded, so whatever the model does to its tensors
    while it is built is kept: `reset_parameters`, `nn.Parameter(torch.randn(...))` in
    `__init__`, buffers computed there (RoPE's `inv_freq`), parents re-initializing their
    children, Hugging Face's `post_init`. The random draws are made on scratch tensors, one
    at a time, to note the generator's state before each; nothing of the model's size is
    ever held. `from_module` later replays, per leaf, only the operations its final value
    depends on (a weight drawn in `__init__` and drawn again in `post_init` costs one draw).

    Args:
      fn: the constructor, e.g. `GPT` or `transformers.AutoModelForCausalLM.from_config`.
      *args, **kwargs: its arguments.
      seed: the seed of the eager construction to reproduce (what `torch.manual_seed` would
        be given). `from_module(seed=)` may ask for another, unless the construction read
        random values (`trunc_normal_`'s rejection loop, `.item()` of a draw), which ties
        the recording to this seed.

    Returns:
      `fn`'s result, with every parameter and buffer of its modules on the meta device,
      ready for `shard_state(dict(model.named_parameters()), ..., buffers=
      dict(model.named_buffers()), init=fzero.init.from_module(model))`. Tensors that
      modules hold outside their parameters and buffers are made for real. The caller's
      generator is left as it was.
    """
    return _deferred(fn, *args, seed=seed, **kwargs)


def from_module(
    module: nn.Module,
    *,
    seed: int | None = None,
    device: Any = "cpu",
    init: dict[Any, Callable[[nn.Module], Any]] | None = None,
) -> Init:
    """Values bitwise those of `torch.manual_seed(seed); Model()` built eagerly.

    For a module from `fzero.init.deferred` (any model: Hugging Face's included), each
    leaf's value is its recorded construction replayed, one leaf at a time: only the
    operations its final value depends on run, with the generator as the eager
    construction had it before each draw.

    For a module built on the meta device (`with torch.device("meta"): Model()`), whose
    construction left no record, the construction is replayed one submodule at a time:
    each submodule owning parameters or buffers directly gets them as empty tensors, its
    `reset_parameters()` runs, the ranges this rank keeps are copied out and the tensors
    are dropped. Submodules run children first, then parents, in registration order: the
    order an eager construction initializes them in when each module fills what it owns
    at the end of its `__init__`, as torch's layers do (models that initialize otherwise,
    such as Hugging Face's, need `deferred`). A tied tensor takes the values its first
    holder in `named_parameters()` gives it: the eager values where the tie hands that
    holder's tensor to the later one (`head.weight = tok.weight`, GPT-2's); a model tied
    the other way (`tok.weight = head.weight`) needs `deferred`, which sees the tie. A
    submodule owning no leaf asked for (with `from_file`'s `missing=`, one the file
    holds) runs its init on scratch tensors, so that later submodules draw what they drew
    eagerly (torch's private `_reset_parameters` too: MultiheadAttention's); one with no
    init at all is taken to draw nothing (a norm's ones), and one that draws in its
    `__init__` needs `init=` naming it (or `deferred`).

    Either way every rank makes the same values, whatever the world size, stage, layout
    or units, and the module is left on the meta device. A module built with values
    (eagerly) gives its own: each rank copies out the ranges it keeps (`missing=` of a
    file read into a model built as usual).

    Args:
      module: the model, from `deferred`, built on the meta device, or with values; `shard_state`'s
        params and buffers are its `dict(model.named_parameters())` and
        `dict(model.named_buffers())`.
      seed: what `torch.manual_seed` would be given before the eager construction;
        default: `deferred`'s seed, or 0. The caller's generator state is left as it was.
      device: where the state is kept. A recorded construction is replayed on the CPU,
        as the eager one ran, and copied there; a meta-device module's submodules are
        materialized there.
      init: for meta-device modules only: per submodule path (e.g. "blocks.0.attn") or
        type (e.g. `RotaryEmbedding`), a function `fn(module)` filling that module's own
        tensors in place, used instead of its `reset_parameters`.

    Returns:
      An initializer for `shard_state(..., init=)`. A leaf the construction leaves
      unwritten (uninitialised memory), or a meta-device module owning tensors without
      an init, raises a ValueError naming it.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.init.from_module needs an nn.Module, got {type(module)}")
    if is_deferred(module):
        if init:
            raise ValueError(
                "fzero.init.from_module: init= is for modules built on the meta device; a "
                "module from fzero.init.deferred replays its own construction"
            )
        return RecordedInit(module, seed, device)
    # By the parameters: buffers with values beside meta parameters (accelerate's
    # init_empty_weights) are kept as given, as any buffer off the meta device.
    tensors = list(module.parameters())
    if tensors and not any(t.is_meta for t in tensors):
        if seed is not None or init:
            raise ValueError(
                "fzero.init.from_module: the module was built with values, which are read "
                "as they are; seed= and init= are for a module from fzero.init.deferred or "
                "built on the meta device"
            )
        return ValuesInit(module, device)
    if not all(t.is_meta for t in tensors):
        raise ValueError(
            "fzero.init.from_module: the module holds parameters with values beside "
            "parameters on the meta device (partly materialized): build them all on the "
            "meta device, or with fzero.init.deferred, or all with values"
        )
    return ModuleInit(module, 0 if seed is None else seed, device, init or {})


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
    key: Callable[[str], str | None] | None = None,
    missing: Init | None = None,
) -> Init:
    """Values read from a safetensors file or a torch.save'd state dict, by range, or from
    a checkpoint sharded over several such files (Hugging Face's `save_pretrained`).

    Each rank reads only the elements it keeps (its slice of every bucket at stage 3),
    straight from the file into its shards, so a pretrained model is loaded into shards
    without any rank holding it whole. Values are converted to the parameters' dtypes,
    as `load_state_dict` does. Both `torch.save(model.state_dict())` files and fzero's
    `checkpoint.export_torch` files are read. Buffers the file holds are read from it,
    also those of a model built with values (its BatchNorm statistics, as
    `from_pretrained` reads them); buffers with values that it lacks keep them.

    Args:
      path: the file (format detected from its contents); an index of several files
        (`model.safetensors.index.json`, `pytorch_model.bin.index.json`: each tensor is
        read from the file its `weight_map` names); or a directory holding one of
        `model.safetensors`, `model.safetensors.index.json`, `pytorch_model.bin`,
        `pytorch_model.bin.index.json` (the first found, Hugging Face's order); or a
        `torch.distributed.checkpoint` directory (FSDP2's or torchtitan's `dcp.save` of a
        model's state dict, or `checkpoint.export_dcp`'s), read through torch's DCP reader, each
        rank the rows that hold its ranges (its metadata is a pickle: read checkpoints
        you trust).
      key: maps a leaf path to the file's name for it, or to None for a leaf the file is
        not meant to hold (an adapter the model adds); default: the path itself. A
        base model's file read into a model with a head, or the reverse, needs none:
        the one prefix that lines their names up (`transformer.`, `bert.`) is added or
        stripped, as Hugging Face does with `base_model_prefix`.
      missing: an initializer for leaves the file lacks (a new head when fine-tuning,
        non-persistent buffers such as RoPE's `inv_freq`), e.g. `from_module(...)`;
        without it a missing leaf is an error naming it. Layer matrices the file lacks
        while as many elements of its layers' matrices go unread are an error even so
        (the same weights under other names, as `transformers` renames some
        architectures' on load); tensors left unread beside leaves made afresh of their
        shapes, or of other counts in the layers, are a warning naming both.

    Returns:
      An initializer for `shard_state(..., init=)`.
    """
    if missing is not None and not isinstance(missing, Init):
        raise TypeError(f"missing must be an fzero.init initializer, got {type(missing)}")
    return FileInit(os.fspath(path), key, missing)
