"""Sharded save and resharding load: the collective protocol around the on-disk format."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from typing import Any

import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    PyTree,
    Shards,
    pack,
    stage_of,
    tree_flatten,
)
from .._state import ShardedState, cast_params, check_live
from ..optim import Optimizer
from . import _disk as disk
from ._build import check_offloaded, resume
from ._extra import (
    extra_metadata,
    extra_tensors,
    full_precision,
    load_buffers,
    load_scaler,
)
from ._schema import (
    CheckpointError,
    Local,
    Schema,
    agree,
    dtype_of,
    elem_slice,
    local_view,
    merge,
    report,
)
from ._target import as_saved, target_layout


def check_state(state: Any, mesh: Mesh, what: str) -> None:
    if not isinstance(state, ShardedState):
        raise TypeError(f"{what} expects a ShardedState, got {type(state).__name__}")
    check_live(state, mesh.rank, what)  # its buffers hold a later step's values
    if state.layout.world_size != mesh.shard_size:
        raise ValueError(
            f"{what}: the state is sharded over {state.layout.world_size} ranks, the mesh "
            f"shards over {mesh.shard_size}"
        )
    if isinstance(state.params, Shards) and state.params.rank != mesh.shard_rank:
        raise ValueError(f"{what}: the state's shards belong to rank {state.params.rank}")


@_comm.collective("checkpoint.save")
def save(state: ShardedState, path: str, mesh: Mesh) -> str:
    """Writes `state` as a sharded checkpoint at `path` (collective: every rank calls it).

    Each rank writes only what it holds; rank 0 commits once every file is durable, and
    no rank returns before the commit. The previous checkpoint at `path` stays loadable
    until then, and is deleted after.

    Args:
      state: this rank's ShardedState (any stage, layout, units; optimizers from
        `fzero.optim`, including `from_torch`). Its buffers and loss scaler are saved
        too; under mixed precision the masters are saved as the parameters (full
        precision), so `load` can resume with or without a `Precision`.
      path: the checkpoint directory (created if missing; shared by all ranks).
      mesh: the mesh `state` lives on.

    Returns:
      The directory of the version just written (inside `path`).

    Raises:
      CheckpointError: on every rank if writing failed on any rank.
    """
    path = os.fspath(path)
    check_state(state, mesh, "checkpoint.save")
    try:
        return _save(state, path, mesh)
    finally:
        if state.offload is not None:  # the disk tier's pages it read, given back
            state.offload.release_all()


def _save(state: ShardedState, path: str, mesh: Mesh) -> str:
    placement = state.offload
    extra, extra_body = extra_tensors(state), extra_metadata(state)
    state = full_precision(state, mesh)  # masters become the parameters saved
    if placement is not None:  # the disk's masters it read to gather them, dropped
        placement.release_all()
    lay, stage, rank = state.layout, stage_of(state.stage), mesh.shard_rank
    # On a 2-D mesh the first group (ranks 0..S-1, shard rank = rank) writes; the other
    # groups hold copies of the same shards and only take part in the agreement, so the
    # checkpoint is the one S ranks sharding alone would write, loadable on any mesh.
    writes, s = mesh.replica_rank == 0, mesh.shard_size
    what = f"checkpoint.save({path!r})"
    # 1. rank 0 makes the temporary directory; every rank describes its optimizer state.
    error, tmp, rep, local = None, None, None, None
    try:
        if mesh.rank == 0:
            tmp = disk.start(path)
        local = local_view(state.opt_state, lay, stage, rank)
        # Replicated optimizer state is the same on every rank: rank 0 speaks for all.
        rep = report(local, lay, share=stage.shards_optimizer or rank == 0)
    except Exception as exc:
        error = exc
    try:
        everyone = agree(error, (tmp, rep), mesh, what)
    except BaseException:  # a peer's failure may be any error (PeerError), or an interrupt
        if tmp is not None:  # rank 0 made it; another rank failed
            shutil.rmtree(os.path.join(path, tmp), ignore_errors=True)
        raise
    tmp = everyone[0][0]
    try:
        # The same reports on every rank: a state they refuse raises on all of them.
        schema = merge([r for _, r in everyone[:s]])
        # 2. every rank writes (and fsyncs) its own file.
        error, info = None, None
        try:
            assert local is not None
            if writes and placement is not None:  # made and written a tensor at a time
                entries = _rank_entries(state, local, schema, rank, placement.release)
                if rank == 0:
                    entries += [_ready(k, v) for k, v in extra.items()]
                info = disk.write_streamed(
                    os.path.join(path, tmp), disk.rank_file(rank, s), entries
                )
            elif writes:
                tensors = _rank_tensors(state, local, schema, rank)
                if rank == 0:
                    tensors.update(extra)
                info = disk.write_tensors(os.path.join(path, tmp), disk.rank_file(rank, s), tensors)
                del tensors
        except Exception as exc:
            error = exc
        files = agree(error, info, mesh, what)[:s]
        # 3. rank 0 commits; the others wait, so no rank returns before the switch.
        error, name = None, None
        if mesh.rank == 0:
            try:
                body = {
                    "format": disk.FORMAT,
                    "version": disk.VERSION,
                    "world_size": s,
                    "stage": stage.number,
                    "step": int(state.step),
                    "torch": torch.__version__,
                    "layout": disk.layout_json(lay),
                    "optimizer": disk.schema_json(schema),
                    "files": files,
                    **extra_body,
                }
                name = disk.commit(path, tmp, body)
            except Exception as exc:
                error = exc
        return os.path.join(path, agree(error, name, mesh, what)[0])
    except BaseException:
        # A failed save leaves no debris: the previous checkpoint is as it was (unless the
        # commit itself succeeded and only its agreement failed: the new one is LATEST).
        if mesh.rank == 0:
            shutil.rmtree(os.path.join(path, tmp), ignore_errors=True)
        raise


def _rank_tensors(
    state: ShardedState, local: Local, schema: Schema, rank: int
) -> dict[str, torch.Tensor]:
    """This rank's file: its slice of every bucket (parameters, elementwise optimizer state),
    its per-piece optimizer state; rank 0 adds the global state."""
    lay, stage = state.layout, stage_of(state.stage)
    slices = state.params.buffers if stage.shards_params else lay.shard(state.params, rank)
    out = {f"p{k}": t for k, t in enumerate(slices)}
    for j, e in enumerate(schema.entries):
        key = (e.node, e.sub)
        if e.kind == "elem":
            for k, b in enumerate(lay.buckets):
                if not b.frozen:
                    lo = rank * b.shard_numel
                    out[f"e{j}.{k}"] = elem_slice(local, key, e, b, k, lo, lo + b.shard_numel)
        elif stage.shards_optimizer or rank == 0:
            for pi, value in local.occ.get(key, ()):
                out[f"v{j}.{local.pieces[pi].owner}"] = value
    if rank == 0:
        out.update({f"g{j}": local.globals[g] for j, g in enumerate(schema.globals)})
    return out


def _rank_entries(
    state: ShardedState, local: Local, schema: Schema, rank: int, release: Any
) -> list[disk.Streamed]:
    """`_rank_tensors`' tensors as a streamed file's entries, bucket by bucket: each made
    when it is written, and the bucket's offloaded pages dropped after (`release`)."""
    lay, stage = state.layout, stage_of(state.stage)
    out: list[disk.Streamed] = []
    for k, b in enumerate(lay.buckets):
        lo, hi = rank * b.shard_numel, (rank + 1) * b.shard_numel
        if stage.shards_params:
            param = functools.partial(lambda k: state.params.buffers[k], k)
        else:
            param = functools.partial(
                lambda b, lo, hi: pack(b, lay.leaves(state.params), lo, hi), b, lo, hi
            )
        done = functools.partial(release, k)
        out.append((f"p{k}", (b.shard_numel,), b.dtype, param, done))
        for j, e in enumerate(schema.entries):
            if e.kind == "elem" and not b.frozen:
                dtype = b.dtype if e.dtype == "param" else dtype_of(e.dtype)
                make = functools.partial(elem_slice, local, (e.node, e.sub), e, b, k, lo, hi)
                out.append((f"e{j}.{k}", (b.shard_numel,), dtype, make, done))
    for j, e in enumerate(schema.entries):
        if e.kind != "elem" and (stage.shards_optimizer or rank == 0):
            for pi, value in local.occ.get((e.node, e.sub), ()):
                out.append(_ready(f"v{j}.{local.pieces[pi].owner}", value))
    if rank == 0:
        out += [_ready(f"g{j}", local.globals[g]) for j, g in enumerate(schema.globals)]
    return out


def _ready(key: str, value: torch.Tensor) -> disk.Streamed:
    """A streamed entry of a tensor at hand."""
    return (key, tuple(value.shape), value.dtype, lambda: value, lambda: None)


@_comm.collective("checkpoint.load")
def load(
    path: str,
    mesh: Mesh,
    optimizer: Optimizer,
    params_like: PyTree,
    *,
    stage: int,
    layout: str | None = None,
    units: Any = None,
    frozen: Any = None,
    precision: Any = None,
    loss_scale: Any = None,
    buffers_like: PyTree = None,
    device: Any = None,
    offload: Any = None,
) -> ShardedState:
    """Loads a checkpoint onto `mesh`, at any world size, stage and layout (collective).

    Args:
      path: a checkpoint directory from `save` (its LATEST version), or one version in it.
      mesh: the mesh to load onto; its size need not be the saving world size.
      optimizer: the optimizer to continue with: the saving one, or one whose state has
        the same organisation (its hyper-parameters may differ).
      params_like: the parameter tree of the model (values ignored; meta tensors do): its
        leaf paths, shapes and dtypes must be the saved ones, and the state has its
        structure.
      stage: the ZeRO stage to load into (0-3), whatever the saving stage.
      layout: "flat" or "tensor"; None keeps the saved kind.
      units: unit path prefixes, as in `shard_state`; None keeps the saved units.
      frozen: as in `shard_state`; None keeps the saved frozen flags. A leaf frozen when
        saved has no optimizer state and cannot become trainable here.
      precision: a `fzero.Precision` to continue in mixed precision: the saved values
        (saved at full precision: the masters of a mixed-precision run) become the
        masters, and the parameters their cast (to `param_dtype`, or where it names
        none, to `params_like`'s dtypes: a bfloat16 model with float32 masters). None
        loads at full precision.
      loss_scale: the `fzero.DynamicLossScale` rules to continue with; the saved scale and
        growth count are kept. None keeps the saved rules (if the run had a scaler).
      buffers_like: the structure of the saved buffers (e.g. `dict(model.named_buffers())`;
        values ignored); None rebuilds them as a dict by path.
      device: where the state is built (None: `mesh.device`, the current GPU under NCCL).
        Files are read through the host range by range, each copied to the device as it
        is read: the host never holds a whole bucket of them.
      offload: a `fzero.Offload` to continue with the optimizer's state off the device
        (as `shard_state(offload=)`); any checkpoint loads with or without one.

    Returns:
      This rank's ShardedState, with the saved step; parameters and optimizer state hold
      the saved values bitwise, on `device`.

    Raises:
      CheckpointError: on every rank, naming the file or leaf: no committed checkpoint,
        a missing, truncated or corrupted file, a file that is not plain tensors, another
        model (the first differing leaf), or an optimizer state that does not fit.
    """
    path = os.fspath(path)
    spec = stage_of(stage)
    error, state, directory = None, None, ""
    try:
        directory = disk.resolve(path)
    except Exception as exc:
        error = exc
    # Every rank must read one version: a save committing while they resolve `LATEST`, or
    # a filesystem that shows ranks other files, would mix two checkpoints' shards.
    seen = agree(
        error,
        (os.path.basename(directory), offload is not None),
        mesh,
        f"checkpoint.load({path!r})",
    )
    try:
        if len({v for v, _ in seen}) > 1:
            said = ", ".join(f"rank {r}: {v}" for r, (v, _) in enumerate(seen))
            raise CheckpointError(f"the ranks resolved different versions of {path!r} ({said})")
        check_offloaded([o for _, o in seen], f"checkpoint.load({path!r})")
        body = disk.read_metadata(directory)
        like = as_saved(directory, body, params_like, precision)
        lay = target_layout(directory, body, like, mesh.shard_size, layout, units, frozen)
        src = disk.FileSource(directory, body)
        dev = mesh.device if device is None else torch.device(device)
        try:

            def extras(state: ShardedState) -> ShardedState:
                buffers = load_buffers(src, body, buffers_like, dev)
                if buffers is not None and precision is not None:  # as shard_state's
                    buffers = cast_params(buffers, precision.buffer_dtype)
                scaler = load_scaler(src, body, loss_scale, dev)
                return dataclasses.replace(state, buffers=buffers, scaler=scaler)

            # Precision without param_dtype: the parameters compute in params_like's
            # dtypes (a bfloat16 model whose float32 masters were saved).
            compute = [getattr(x, "dtype", None) for x in tree_flatten(params_like)[0]]
            state = resume(
                src, lay, optimizer, spec, mesh, body["step"], dev, "checkpoint.load",
                precision=precision, offload=offload, extras=extras, compute=compute,
            )  # fmt: skip
        finally:
            src.close()
    except Exception as exc:
        error = exc
    # Ranks read different files: one rank's bad file must fail all of them, not hang them.
    agree(error, None, mesh, f"checkpoint.load({path!r})")
    assert state is not None
    return state
