"""export_dcp: a state written as a `torch.distributed.checkpoint` that FSDP2 loads."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import uuid
import warnings
from typing import Any

import torch
from torch import nn

from .. import _comm
from .._comm import Mesh
from .._core import fsync_dir, leaf_paths, tree_flatten
from .._state import ShardedState
from ._export import _names, exported
from ._groups import Hyperparams, param_groups
from ._save import check_state
from ._schema import agree
from ._stream import export_torch as stream_torch
from ._stream import gather_leaves


@_comm.collective("checkpoint.export_dcp")
def export_dcp(
    state: ShardedState,
    directory: str | os.PathLike[str],
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
    optimizer_key: str | None = None,
    hyperparams: Hyperparams = None,
) -> None:
    """Writes the model's weights (and persistent buffers) as a `torch.distributed.checkpoint`
    directory, so that an FSDP2 or torchtitan job resumes from it:
    `dcp.load(model.state_dict(), checkpoint_id=directory)` after `fully_shard`; with
    `optimizer_key`, the optimizer state too, in `get_optimizer_state_dict`'s form:

        sd, osd = model.state_dict(), get_optimizer_state_dict(model, opt)
        dcp.load({**sd, "optim": osd}, checkpoint_id=directory)
        model.load_state_dict(sd); set_optimizer_state_dict(model, opt, osd)

    Collective. Units are all-gathered one at a time; rank 0 hands each unit's tensors to
    torch's own DCP writer (`dcp.save(..., no_dist=True)`) as one sub-checkpoint in its own
    folder, then writes the checkpoint's `.metadata`: every sub-checkpoint's merged, each
    tensor pointing into its folder's file. The data files are torch's, so DCP's readers
    (and their resharding onto any DTensor placement) take them as their own. No rank holds
    more than two units' full tensors. The directory appears whole or not at all (written
    beside it, then renamed); it must not exist yet.

    Args:
      state: this rank's ShardedState.
      directory: the checkpoint to create (rank 0 writes; every rank must see it after).
      mesh: the mesh.
      module: the model, so the keys are its `state_dict()`'s: every name of a tied
        parameter, and no non-persistent buffer (persistent ones the state does not
        hold, from the module). Without it, every leaf and buffer of the state.
      optimizer_key: where the optimizer state goes (e.g. "optim"): `{key: {"state":
        {fqn: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{**hyperparams,
        "params": [fqn, ...]}]}}`, as `export_torch` maps fzero's adam/adamw/sgd and
        `from_torch` states (Adam's moments per parameter). None: weights only.
      hyperparams: the param group's hyper-parameters, all that the loading optimizer
        holds (DCP loads strictly), e.g. `torch.optim.AdamW([torch.zeros(1)], lr=1e-2,
        weight_decay=0.1).defaults`; or, for an optimizer of several groups, its groups
        with their parameters' names: `get_optimizer_state_dict(model, opt)["param_groups"]`
        (as `export_torch`).
    """
    check_state(state, mesh, "checkpoint.export_dcp")
    directory = os.fspath(directory)
    aliases, transient = _names(module)
    full = exported(state, mesh, module, transient)
    if optimizer_key is not None:
        writer = _Writer(directory) if mesh.rank == 0 else None

        def sink(skeleton: dict[str, Any]) -> _Sink:
            assert writer is not None
            # torch's numbering of the trainable leaves (checked by `stream_torch` first)
            order, _ = param_groups(hyperparams, full.layout, aliases, "checkpoint.export_dcp")
            fqns = [full.layout.paths[i] for i in order]
            return _Sink(writer, skeleton, fqns, optimizer_key, unit_bytes(full.layout))

        try:
            stream_torch(full, directory, mesh, hyperparams, aliases, transient, sink,
                         "checkpoint.export_dcp")  # fmt: skip
        except BaseException:
            if writer is not None:  # after a rename there is nothing left to remove
                writer.abort()
            raise
        return
    lay = full.layout
    names: dict[int, list[str]] = {i: [p] for i, p in enumerate(lay.paths)}
    for name, canonical in (aliases or {}).items():
        if name != canonical and canonical in lay.path_index:
            names[lay.path_index[canonical]].append(name)
    unit_of = {
        s.index: u for u in lay.units for k in lay.unit_buckets(u) for s in lay.buckets[k].slots
    }
    writer = _Writer(directory) if mesh.rank == 0 else None
    if writer is not None and full.buffers is not None:
        pairs = zip(leaf_paths(full.buffers), tree_flatten(full.buffers)[0])
        writer.add("buffers", {n: b for n, b in pairs if n not in transient})

    def put_param(leaf: int, value: torch.Tensor) -> None:
        if writer is not None:
            writer.add(unit_of[leaf], {n: value for n in names[leaf]})

    try:
        gather_leaves(full, None, None, mesh, put_param, None)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    error = None
    if writer is not None:
        error = writer.finish()
    agree(error, None, mesh, "checkpoint.export_dcp")


class _Writer:
    """Rank 0's side: one sub-checkpoint per unit, then the merged metadata. The first
    error stops the writing (the gathers go on, every rank being in them); it is returned
    by `finish` for every rank to raise."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.tmp = f"{directory.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"
        self.parts: list[str] = []
        self.pending: tuple[Any, dict[str, torch.Tensor]] | None = None
        self.error: BaseException | None = None
        try:
            if os.path.lexists(directory):
                raise FileExistsError(
                    f"checkpoint.export_dcp: {directory} exists; a DCP checkpoint is "
                    "written once, into a new directory"
                )
            os.makedirs(self.tmp)
        except BaseException as exc:
            self.error = exc

    def add(self, unit: Any, tensors: dict[Any, Any], limit: int | None = None) -> None:
        """Tensors (or other values) by key (a name, or a path of nested keys) of `unit`
        (views valid during the call: copied). A part is written when the unit changes,
        or, with `limit`, once it holds that many bytes."""
        if self.error is not None:
            return
        if self.pending is not None and self.pending[0] != unit:
            self._flush()
        if self.pending is None:
            self.pending = (unit, {})
        for n, t in tensors.items():
            self.pending[1][n] = t.detach().clone() if isinstance(t, torch.Tensor) else t
        held = sum(t.nbytes for t in self.pending[1].values() if isinstance(t, torch.Tensor))
        if limit is not None and held >= limit:
            self._flush()

    def _flush(self) -> None:
        import torch.distributed.checkpoint as dcp

        assert self.pending is not None
        part = f"part-{len(self.parts):05d}"
        tensors, self.pending = _nested(self.pending[1]), None
        try:
            writer = dcp.FileSystemWriter(os.path.join(self.tmp, part), sync_files=True)
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(tensors, storage_writer=writer, no_dist=True)
            self.parts.append(part)
        except BaseException as exc:
            self.error = exc

    def commit(self) -> None:
        """The last part, the merged metadata, the rename: raises what failed."""
        error = self.finish()
        if error is not None:
            raise error

    def finish(self) -> BaseException | None:
        if self.error is None and self.pending is not None:
            self._flush()
        if self.error is None:
            try:
                self._merge()
                os.rename(self.tmp, self.directory)
                fsync_dir(os.path.dirname(os.path.abspath(self.directory)))
            except BaseException as exc:
                self.error = exc
        if self.error is not None:
            self.abort()
        return self.error

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _merge(self) -> None:
        """One `.metadata` over the parts: their tensors, each pointing into its part."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import Metadata

        merged: Metadata | None = None
        for part in self.parts:
            md = FileSystemReader(os.path.join(self.tmp, part)).read_metadata()
            storage = {
                index: dataclasses.replace(info, relative_path=f"{part}/{info.relative_path}")
                for index, info in md.storage_data.items()
            }
            if merged is None:
                merged = dataclasses.replace(md, storage_data=storage)
                merged.state_dict_metadata = dict(md.state_dict_metadata)
                merged.planner_data = dict(md.planner_data or {})
                continue
            merged.state_dict_metadata.update(md.state_dict_metadata)
            merged.storage_data.update(storage)
            merged.planner_data.update(md.planner_data or {})
        if merged is None:
            merged = Metadata(state_dict_metadata={}, planner_data={}, storage_data={})
        path = os.path.join(self.tmp, ".metadata")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(merged, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        for part in self.parts:  # each part's own metadata would only confuse a reader
            os.remove(os.path.join(self.tmp, part, ".metadata"))


class _Sink:
    """`export_torch`'s skeleton streamed into DCP parts: each tensor, as it arrives, goes
    under its keys in `get_optimizer_state_dict`'s form (the model's at the top)."""

    def __init__(
        self, writer: _Writer, skeleton: dict[str, Any], fqns: list[str], key: str, limit: int
    ) -> None:
        self.writer, self.limit, self.path = writer, limit, writer.directory
        if writer.error is not None:
            raise writer.error
        self.where: dict[int, list[tuple[str, ...]]] = {}
        for name, t in skeleton["model"].items():
            self.where.setdefault(id(t), []).append((name,))
        for index, entries in skeleton["optimizer"]["state"].items():
            for name, t in entries.items():
                self.where.setdefault(id(t), []).append((key, "state", fqns[index], name))
        groups = skeleton["optimizer"]["param_groups"]
        self.groups = [{**g, "params": [fqns[i] for i in g["params"]]} for g in groups]
        self.key = key

    def write(self, key: int, lo: int, value: torch.Tensor) -> None:
        self.writer.add(None, {path: value for path in self.where[key]}, self.limit)
        if self.writer.error is not None:
            raise self.writer.error

    def commit(self) -> None:
        groups = {(self.key, "param_groups", str(i)): g for i, g in enumerate(self.groups)}
        self.writer.add(None, groups)
        self.writer.commit()

    def abort(self) -> None:
        self.writer.abort()


def _nested(flat: dict[Any, Any]) -> dict[str, Any]:
    """`{("optim", "state", fqn, "exp_avg"): t, "w": t}` as nested dicts, which DCP flattens
    back to "optim.state.<fqn>.exp_avg" (param groups: a list, "optim.param_groups.0.lr")."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        path = (path,) if isinstance(path, str) else path
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return _lists(out)


def _lists(node: Any) -> Any:
    """Dicts keyed "0".."n-1" under "param_groups" become lists."""
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    groups = out.get("param_groups")
    if isinstance(groups, dict):
        out["param_groups"] = [groups[str(i)] for i in range(len(groups))]
    return out


def unit_bytes(lay: Any) -> int:
    """The largest unit's full bytes: how much a part holds before it is written."""
    return max(
        (sum(lay.buckets[k].full_numel * lay.buckets[k].dtype.itemsize for k in lay.unit_buckets(u))
         for u in lay.units),
        default=1,
    )  # fmt: skip
