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
from ._export import _names
from ._extra import full_precision
from ._save import check_state
from ._schema import agree
from ._stream import gather_leaves


@_comm.collective("checkpoint.export_dcp")
def export_dcp(
    state: ShardedState,
    directory: str | os.PathLike[str],
    mesh: Mesh,
    *,
    module: nn.Module | None = None,
) -> None:
    """Writes the model's weights (and persistent buffers) as a `torch.distributed.checkpoint`
    directory, so that an FSDP2 or torchtitan job resumes from it:
    `dcp.load(model.state_dict(), checkpoint_id=directory)` after `fully_shard`.

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
        parameter, and no non-persistent buffer. Without it, every leaf and buffer.
    """
    check_state(state, mesh, "checkpoint.export_dcp")
    directory = os.fspath(directory)
    aliases, transient = _names(module)
    full = full_precision(state, mesh)
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

    def add(self, unit: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Tensors of `unit` (views valid during the call: copied)."""
        if self.error is not None:
            return
        if self.pending is not None and self.pending[0] != unit:
            self._flush()
        if self.pending is None:
            self.pending = (unit, {})
        self.pending[1].update({n: t.detach().clone() for n, t in tensors.items()})

    def _flush(self) -> None:
        import torch.distributed.checkpoint as dcp

        assert self.pending is not None
        part = f"part-{len(self.parts):05d}"
        tensors, self.pending = self.pending[1], None
        try:
            writer = dcp.FileSystemWriter(os.path.join(self.tmp, part), sync_files=True)
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(tensors, storage_writer=writer, no_dist=True)
            self.parts.append(part)
        except BaseException as exc:
            self.error = exc

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
