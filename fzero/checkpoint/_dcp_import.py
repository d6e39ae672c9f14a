"""import_dcp: an FSDP2 or torchtitan checkpoint read into this rank's shards, range by range."""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    DcpFiles,
    ShardLayout,
    build_layout,
    leaf_paths,
    stage_of,
    tree_flatten,
    tree_unflatten,
)
from .._state import DynamicLossScale, Offload, Precision, ShardedState, frozen_leaves
from ..optim import Optimizer
from ._build import check_offloaded, resume
from ._groups import natural_order
from ._schema import CheckpointError, Key, agree
from ._torch import TorchStates, extras, replicated, torch_states_of


class DcpSource:
    """A DCP checkpoint's weights and torch.optim state as a `Source` (see `_build`): every
    read is a range of one saved tensor, so a rank reads about what it keeps.

    Args:
      files: the checkpoint.
      paths: per leaf, its weight's key.
      dtypes: per leaf, the dtype its weight is read in.
      saved: the optimizer state seen by leaf (`torch_states_of`), its tensors meta
        where they are read later.
      prefix: per leaf, the keys' prefix of its optimizer state ("optim.state.<fqn>.").
    """

    def __init__(
        self,
        files: DcpFiles,
        paths: list[str],
        dtypes: list[torch.dtype],
        saved: TorchStates,
        prefix: dict[int, str],
    ) -> None:
        self.files, self.paths, self.dtypes = files, paths, dtypes
        self.saved, self.prefix, self.schema = saved, prefix, saved.schema

    def param(self, leaf: int, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=self.dtypes[leaf])
        self.files.read(self.paths[leaf], lo, hi, out)
        return out

    def elem(self, entry: int, leaf: int, lo: int, hi: int) -> torch.Tensor:
        key = self._key(entry)
        like = self.saved.per_leaf[leaf][key]
        out = torch.empty(hi - lo, dtype=like.dtype)
        name = self._name(leaf, key)
        if like.device.type != "meta":  # read already (a 0-d value)
            out.copy_(like.reshape(-1)[lo:hi])
        elif name not in self.files.entries:  # a parameter torch never stepped: zeros
            out.zero_()
        else:
            self.files.read(name, lo, hi, out)
        return out

    def piece(self, entry: int, leaf: int) -> torch.Tensor | None:
        key = self._key(entry)
        like = self.saved.per_leaf.get(leaf, {}).get(key)
        if like is None or like.device.type != "meta":
            return like
        return self.files.tensor(self._name(leaf, key)).to(like.dtype, copy=True)

    def uniform(self, entry: int) -> torch.Tensor:
        key = self._key(entry)
        return next(d[key] for d in self.saved.per_leaf.values() if key in d)  # 0-d: read

    def global_(self, path: str) -> torch.Tensor:
        return self.saved.globals[path]

    def _key(self, entry: int) -> Key:
        e = self.schema.entries[entry]
        return (e.node, e.sub)

    def _name(self, leaf: int, key: Key) -> str:
        return self.prefix[leaf] + self.saved.names[key]


@_comm.collective("checkpoint.import_dcp")
def import_dcp(
    directory: str | os.PathLike[str],
    optimizer: Optimizer,
    mesh: Mesh,
    params_like: dict[str, torch.Tensor],
    *,
    stage: int,
    optimizer_key: str | None = "optim",
    layout: str = "flat",
    units: Any = None,
    frozen: Any = None,
    step: int | None = None,
    device: Any = None,
    buffers: Any = None,
    precision: Precision | None = None,
    loss_scale: DynamicLossScale | None = None,
    offload: Offload | None = None,
) -> ShardedState:
    """Builds a ShardedState from a `torch.distributed.checkpoint` holding a model's weights
    and its optimizer's state: an FSDP2 or torchtitan job's
    `dcp.save({**model.state_dict(), "optim": get_optimizer_state_dict(model, opt)})`, or
    `export_dcp(..., optimizer_key="optim")`. Training goes on where it stopped: Adam's
    moments and step (torch.optim.Adam/AdamW for `fzero.optim.adam`/`adamw`), SGD's
    momentum, a `from_torch` optimizer's state.

    Collective. Each rank reads only the ranges it keeps: at stage 3 its slice of the
    weights, at stages 1-3 its slice of the moments (DCP reads the saved chunks that
    overlap them), so a model whose state fits the ranks only sharded imports as it
    trains, and with `offload` the moments go to the host or to disk a unit at a time.

    Args:
      directory: the DCP checkpoint.
      optimizer: the fzero optimizer to continue with (hyper-parameters come from it).
      mesh: the mesh.
      params_like: the parameter tree, `dict(model.named_parameters())` (meta tensors
        will do): its paths are the checkpoint's keys for the weights, and its shapes
        must be the saved ones. The weights keep the checkpoint's dtype; under a
        `precision`, the wider of it and the model's (an fp32 weight of a bf16 leaf is
        its master), computing in the narrower.
      stage: the ZeRO stage (0-3).
      optimizer_key: the key the optimizer state was saved under ("optim" above;
        torchtitan: "optimizer"); a key the checkpoint holds nothing under is refused.
        None: the weights alone, the optimizer started afresh.
      layout, units, frozen, step, device: as in `import_torch`.
      buffers: the module's buffers (`dict(model.named_buffers())`): those the checkpoint
        holds (persistent ones) take its values, the others keep theirs.
      precision, loss_scale, offload: as in `shard_state`: the checkpoint's weights
        become the masters under `precision` (FSDP2 keeps them in fp32 beside its
        `MixedPrecisionPolicy`); the scaler starts afresh.

    Returns:
      This rank's ShardedState.

    Raises:
      CheckpointError: on every rank: a weight the checkpoint lacks or holds in another
        shape, ranks that see different checkpoints, an optimizer state that does not fit
        or is not under `optimizer_key`.
    """
    spec = stage_of(stage)
    where = f"checkpoint.import_dcp({os.fspath(directory)!r})"
    error, state, files, digest = None, None, None, None
    try:
        files = DcpFiles(os.fspath(directory))
        digest = files.digest()
    except Exception as exc:
        error = exc
    try:
        if len(set(agree(error, digest, mesh, where))) > 1:
            raise CheckpointError(f"{where} failed: the ranks see different checkpoints")
        assert files is not None
        try:
            masters = precision is not None
            lay, src, count = _source(files, optimizer, mesh, params_like, optimizer_key,
                                      layout, units, frozen, step, masters)  # fmt: skip
            saved = [files.entries[path].dtype for path in lay.paths]
            compute = [_computed_in(g, d) for g, d in zip(tree_flatten(params_like)[0], saved)]
            dev = mesh.device if device is None else torch.device(device)

            def buffer(path: str) -> torch.Tensor | None:
                return files.tensor(path) if path in files.entries else None  # `extras` copies

            state = resume(
                src, lay, optimizer, spec, mesh, count, dev, "checkpoint.import_dcp",
                precision=precision, offload=offload,
                extras=extras(buffers, buffer, loss_scale, dev), compute=compute,
            )  # fmt: skip
        except Exception as exc:
            error = exc
        check_offloaded(agree(error, offload is not None, mesh, where), where)
    finally:
        if files is not None:
            files.close()
    assert state is not None
    return replicated(state, precision, mesh, "checkpoint.import_dcp")


def _computed_in(given: Any, saved: torch.dtype) -> torch.dtype:
    """Under a precision, the dtype a weight computes in: the checkpoint's, unless the
    model's leaf is narrower (a bf16 leaf's fp32 master; a model built on meta in the
    default fp32 still computes a bf16 checkpoint in bf16, over fp32 masters)."""
    mine = getattr(given, "dtype", None)
    if mine is None or not (mine.is_floating_point and saved.is_floating_point):
        return saved
    return saved if torch.promote_types(mine, saved) == mine else mine


def _check_key(files: DcpFiles, key: str, weights: set[str]) -> None:
    """Refuses an `optimizer_key` the checkpoint holds nothing under: the optimizer would
    start afresh (zero moments, step 0) without a word where the key was only misspelt
    (torchtitan saves under "optimizer"). Under it, state or param groups: a torch
    optimizer that never stepped saves its groups alone."""
    if any(name.startswith(f"{key}.") for name in files.entries):
        return
    others = sorted({n.split(".", 1)[0] for n in files.entries if n not in weights})
    held = f"keys other than the weights under {others}" if others else "the weights alone"
    raise CheckpointError(
        f"{files.path} holds no optimizer state under optimizer_key={key!r} (it holds "
        f"{held}): pass the key it was saved under, or optimizer_key=None to start the "
        "optimizer afresh from the weights"
    )


def _source(
    files: DcpFiles,
    optimizer: Optimizer,
    mesh: Mesh,
    params_like: dict[str, torch.Tensor],
    optimizer_key: str | None,
    layout: str,
    units: Any,
    frozen: Any,
    step: int | None,
    masters: bool = False,
) -> tuple[ShardLayout, DcpSource, int]:
    """The layout, the checkpoint as a source and the step count; only the 0-d values
    (steps) are read here. Where a precision may keep `masters`, a weight is read in the
    wider of its saved dtype and the model's."""
    paths = leaf_paths(params_like)
    leaves = []
    for path, given in zip(paths, tree_flatten(params_like)[0]):
        if path not in files.entries:
            raise CheckpointError(
                f"{files.path} has no weight {path!r} (it holds e.g. {sorted(files.entries)[:3]})"
            )
        saved = files.entries[path]
        shape = getattr(given, "shape", None)
        if shape is not None and tuple(shape) != tuple(saved.shape):
            raise CheckpointError(
                f"weight {path!r} is saved as {tuple(saved.shape)}, the model's is {tuple(shape)}"
            )
        dtype, mine = saved.dtype, getattr(given, "dtype", None)
        if masters and mine is not None and mine.is_floating_point and dtype.is_floating_point:
            dtype = torch.promote_types(mine, dtype)
        leaves.append(torch.empty(saved.shape, dtype=dtype, device="meta"))
    params = tree_unflatten(tree_flatten(params_like)[1], leaves)
    # Frozen as the model's parameters say (their requires_grad), not the meta stand-ins.
    lay = build_layout(params, mesh.shard_size, layout, units, frozen_leaves(params_like, frozen))
    # The optimizer state's entries by parameter, in one pass over the checkpoint's keys:
    # "<key>.state.<fqn>.<name>" (FSDP2's get_optimizer_state_dict, flattened by DCP).
    head = f"{optimizer_key}.state."
    by_fqn: dict[str, dict[str, Any]] = {}
    for name, e in files.entries.items():
        if optimizer_key is not None and name.startswith(head) and "." in name[len(head) :]:
            fqn, sub = name[len(head) :].rsplit(".", 1)
            by_fqn.setdefault(fqn, {})[sub] = e
    if optimizer_key is not None:
        _check_key(files, optimizer_key, set(paths))
    prefix: dict[int, str] = {}
    states: dict[int, dict[str, torch.Tensor]] = {}
    for i in (i for i in natural_order(lay) if not lay.frozen[i]):
        prefix[i] = f"{head}{lay.paths[i]}."
        states[i] = {
            sub: torch.empty(e.shape, dtype=e.dtype, device="meta")
            for sub, e in by_fqn.get(lay.paths[i], {}).items()
        }
    # Every 0-d value (torch's per-parameter "step") in one read; the rest range by range.
    small = [prefix[i] + sub for i, st in states.items() for sub, x in st.items() if x.dim() == 0]
    read = files.tensors(small)
    for i, st in states.items():
        st.update({sub: read[prefix[i] + sub] for sub, x in st.items() if x.dim() == 0})
    saved = torch_states_of(optimizer, lay, leaves, states, step)
    src = DcpSource(files, paths, [x.dtype for x in leaves], saved, prefix)
    return lay, src, saved.count if step is None else step
