"""Consolidated export: a plain torch model and torch.optim state dict, or a safetensors file,
gathered unit by unit from the shards and, to a file, written as they come."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    OffsetWriter,
    ShardLayout,
    Stage,
    leaf_paths,
    safetensors_writer,
    stage_of,
    torch_writer,
    tree_flatten,
)
from .._state import ShardedState
from ._chain import chained
from ._groups import Hyperparams, natural_order, param_groups
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
from ._torch import _ADAM, _SGD

Spec = tuple[torch.dtype, tuple[int, ...]]


def _scalar_dtype() -> torch.dtype:
    # torch.optim's own choice for its "step" tensors.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def export_torch(
    state: ShardedState,
    path: str | None,
    mesh: Mesh,
    hyperparams: Hyperparams,
    aliases: dict[str, str] | None = None,
    transient: frozenset[str] = frozenset(),
    sink: Callable[[dict[str, Any]], Any] | None = None,
    where: str = "checkpoint.export_torch",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """See `fzero.checkpoint.export_torch`; `aliases` maps a tied name to its leaf's path,
    `transient` names buffers left out (non-persistent). With `sink`, rank 0 hands the
    skeleton (`{"model": ..., "optimizer": ...}`, storage-less tensors where values are
    gathered later) to `sink(skeleton)` instead of a torch file writer: the result gets
    `write(id(tensor), 0, value)` for every tensor of the skeleton, then `commit()` (or
    `abort()`), as an `OffsetWriter` would. `where` names the caller in errors."""
    lay, stage, rank = state.layout, stage_of(state.stage), mesh.rank
    error, rep, local, grouping = None, None, None, None
    try:
        grouping = param_groups(hyperparams, lay, aliases, where)
        # A chain's transformations (clipping) are not torch.optim's: its optimizer's.
        local = local_view(chained(state.opt_state)[1], lay, stage, mesh.shard_rank)
        rep = report(local, lay, share=stage.shards_optimizer or rank == 0)
    except Exception as exc:
        error = exc
    # The first group's reports (ranks 0..S-1, in shard order): the others hold copies.
    schema = merge(agree(error, rep, mesh, where)[: mesh.shard_size])
    assert local is not None and grouping is not None
    pieces = _piece_values(local, schema, stage, mesh)

    def build(params: Any, elems: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model_sd, optim_sd = _to_torch(lay, schema, local, params, elems, pieces, grouping)
        if state.buffers is not None:  # a plain state_dict holds buffers too
            for name, buf in zip(leaf_paths(state.buffers), tree_flatten(state.buffers)[0]):
                if name not in transient:
                    model_sd[name] = buf.detach().clone()
        for name, canonical in (aliases or {}).items():  # tied weights: every name
            if name not in model_sd and canonical in model_sd:
                model_sd[name] = model_sd[canonical]
        return model_sd, optim_sd

    error, out, writer = None, None, None
    params: dict[int, torch.Tensor] = {}
    elems: dict[tuple[int, int], torch.Tensor] = {}
    if path is not None and rank == 0:
        # Streamed: the file's skeleton (every tensor's bytes reserved) is written first,
        # then each leaf as its unit is gathered; rank 0 never holds the whole model.
        try:
            params, elems = _fakes(lay, schema)
            skeleton = build(params, elems)
            tree = {"model": skeleton[0], "optimizer": skeleton[1]}
            writer = torch_writer(os.fspath(path), tree) if sink is None else sink(tree)
            fake = {id(t) for t in (*params.values(), *elems.values())}
            for t in optree.tree_leaves(skeleton):
                if isinstance(t, torch.Tensor) and id(t) not in fake:
                    writer.write(id(t), 0, t)  # real values: steps, buffers
        except Exception as exc:
            error = exc

    latch = _Latch(writer)

    def put_param(leaf: int, value: torch.Tensor) -> None:
        if writer is None:
            params[leaf] = value.clone()
        elif leaf in params:
            latch.write(id(params[leaf]), value)

    def put_elem(entry: int, leaf: int, value: torch.Tensor) -> None:
        if writer is None:
            elems[entry, leaf] = value.clone()
        elif (entry, leaf) in elems:
            latch.write(id(elems[entry, leaf]), value)

    if error is None:
        # Only the writes' errors wait for the agreement below; anything else raised
        # inside the gathers (out of memory, ...) leaves them half-done: it is published.
        _gathering(writer, lambda: gather_leaves(state, local, schema, mesh, put_param, put_elem))
        try:
            if latch.error is not None:
                error = latch.error
            elif rank == 0 and writer is not None:
                writer.commit()
            elif rank == 0:
                out = build(params, elems)
        except Exception as exc:
            error = exc
    else:  # a rank 0 that failed still takes part in every gather: no rank hangs
        _gathering(writer, lambda: gather_leaves(state, local, schema, mesh, _none, _none))
    if error is not None and writer is not None:
        writer.abort()
    agree(error, None, mesh, where)
    return out


def _none(*args: Any) -> None:
    return None


def _gathering(writer: Any, gather: Any) -> None:
    """Runs the export's gathers; if they raise, removes the file being written first."""
    try:
        gather()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


class _Latch:
    """Rank 0's writes during the gathers: the first that fails stops the writing, not the
    gathers, which every other rank is in too; the error is agreed on after the last."""

    def __init__(self, writer: OffsetWriter | None) -> None:
        self.writer, self.error = writer, None

    def write(self, key: Any, value: torch.Tensor) -> None:
        if self.error is not None or self.writer is None:
            return
        try:
            self.writer.write(key, 0, value)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.filename is None:
                exc.filename = self.writer.path  # os.pwrite names no file
            self.error = exc


def _fakes(lay: ShardLayout, schema: Schema) -> tuple[Any, Any]:
    """Dicts of storage-less tensors for the parameters and elementwise optimizer state,
    made when `_to_torch` asks for one (so exactly the tensors the export holds)."""

    def elem_spec(key: tuple[int, int]) -> tuple[tuple[int, ...], torch.dtype]:
        e = schema.entries[key[0]]
        return lay.shapes[key[1]], lay.dtypes[key[1]] if e.dtype == "param" else dtype_of(e.dtype)

    return _Fakes(lambda i: (lay.shapes[i], lay.dtypes[i])), _Fakes(elem_spec)


class _Fakes(dict):
    """Storage-less tensors made on first use (`_to_torch` asks for the ones it needs)."""

    def __init__(self, spec: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        super().__init__()
        self.spec, self.mode = spec, FakeTensorMode()

    def __missing__(self, key: Any) -> torch.Tensor:
        shape, dtype = self.spec(key)
        with self.mode:  # shapes and dtypes, no memory: torch_writer reserves the bytes
            t = torch.empty(shape, dtype=dtype, device="cpu")
        self[key] = t
        return t


def gather_leaves(
    state: ShardedState,
    local: Local | None,
    schema: Schema | None,
    mesh: Mesh,
    put_param: Any,
    put_elem: Any,
) -> None:
    """Calls, on rank 0, `put_param(leaf, value)` for every parameter and `put_elem(entry,
    leaf, value)` for every elementwise optimizer-state entry; `value` is a view valid
    during the call.

    Bucket by bucket, unit by unit: a rank holds one bucket's full buffer at a time.
    Replicated values (parameters at stages 0-2, all of stage 0's optimizer state) are
    read where they are, without communication.
    """
    lay, stage, rank = state.layout, stage_of(state.stage), mesh.rank
    replicated = None if stage.shards_params else tree_flatten(state.params)[0]
    piece_of = {} if local is None else {p.leaf: pi for pi, p in enumerate(local.pieces)}
    entries = () if schema is None else schema.entries
    for unit in lay.units:
        for k in lay.unit_buckets(unit):
            b = lay.buckets[k]
            full = _comm.all_gather(state.params.buffers[k], mesh) if replicated is None else None
            for s in b.slots if rank == 0 else ():
                leaf = replicated[s.index] if full is None else full[s.offset : s.offset + s.numel]
                put_param(s.index, leaf.detach().reshape(s.shape))
            del full
            for j, e in enumerate(entries):
                assert local is not None
                if b.frozen or e.kind != "elem":
                    continue
                key = (e.node, e.sub)
                if not stage.shards_optimizer:
                    values = dict(local.occ.get(key, ()))
                    for s in b.slots if rank == 0 else ():
                        if piece_of[s.index] in values:
                            put_elem(j, s.index, values[piece_of[s.index]].detach())
                    continue
                lo = mesh.shard_rank * b.shard_numel
                shard = elem_slice(local, key, e, b, k, lo, lo + b.shard_numel)
                full_e = _comm.all_gather(shard, mesh)
                for s in b.slots if rank == 0 else ():
                    put_elem(j, s.index, full_e[s.offset : s.offset + s.numel].reshape(s.shape))
                del full_e


def _piece_values(
    local: Local, schema: Schema, stage: Stage, mesh: Mesh
) -> dict[tuple[int, str], torch.Tensor]:
    """(entry, owner) -> per-piece value, on rank 0. These are small (steps, factors)."""
    mine = {}
    for j, e in enumerate(schema.entries):
        if e.kind == "piece" and (stage.shards_optimizer or mesh.rank == 0):
            for pi, value in local.occ.get((e.node, e.sub), ()):
                mine[j, local.pieces[pi].owner] = value.detach().clone()
    if not stage.shards_optimizer or not any(e.kind == "piece" for e in schema.entries):
        return mine
    parts = _comm.all_gather_object(mine, mesh)[: mesh.shard_size]  # the first group's
    return {k: v for part in parts for k, v in part.items()}


def _to_torch(
    lay: ShardLayout,
    schema: Schema,
    local: Local,
    params: dict[int, torch.Tensor],
    elems: dict[tuple[int, int], torch.Tensor],
    pieces: dict[tuple[int, str], torch.Tensor],
    grouping: tuple[list[int], list[dict[str, Any]]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    numbered, groups = grouping  # torch's numbering of the leaves
    model = {lay.paths[i]: params[i] for i in natural_order(lay)}

    def value(j: int, i: int) -> torch.Tensor:
        e = schema.entries[j]
        if e.kind == "elem":
            return elems[j, i]
        if (j, f"l{i}") in pieces:
            return pieces[j, f"l{i}"]
        if e.uniform:
            return next(v for (jj, _), v in pieces.items() if jj == j).clone()
        raise CheckpointError(
            f"optimizer state {e.name!r} is kept per flat shard and differs between shards: "
            "it has no per-parameter form (export from layout='tensor')"
        )

    count = int(local.globals["count"]) if "count" in local.globals else 0
    states: dict[int, dict[str, Any]] = {}
    for idx, i in enumerate(numbered):
        if lay.frozen[i]:  # numbered by a group that lists it; torch keeps no state for it
            continue
        if schema.kind in ("AdamState", "SgdState"):
            names = _ADAM if schema.kind == "AdamState" else _SGD
            st = {names[e.node]: value(j, i) for j, e in enumerate(schema.entries) if count}
            if st and schema.kind == "AdamState":
                step = torch.tensor(float(count), dtype=_scalar_dtype(), device="cpu")
                st = {"step": step, **st}
        elif schema.nodes == ("",) and schema.kind in ("tuple", "dict", "list"):
            st = {e.sub: value(j, i) for j, e in enumerate(schema.entries) if i in e.present}
        else:
            raise CheckpointError(
                f"export_torch maps fzero.optim adam/adamw/sgd and from_torch states to "
                f"torch.optim's format; this state is a {schema.kind}"
            )
        states[idx] = st
    return model, {"state": states, "param_groups": groups}


def export_safetensors(
    state: ShardedState,
    path: str,
    mesh: Mesh,
    aliases: dict[str, str] | None,
    transient: frozenset[str],
    dtype: torch.dtype | None,
    metadata: dict[str, str] | None,
    split: Callable[[dict[str, Spec]], dict[str, list[str]]] | None = None,
    finish: Callable[[dict[str, list[str]]], None] | None = None,
    what: str = "checkpoint.export_safetensors",
) -> None:
    """See `fzero.checkpoint.export_safetensors` (`what` names the caller in errors).
    With `split`, the tensors (name -> dtype, shape, in the file order) go to several
    files, `{file: names}`, all written in the same pass over the units; `finish(files)`
    then runs on rank 0 once every file is in place (an index, say), and its error is
    every rank's. `transient` names what is left out: non-persistent buffers, and for
    `export_pretrained` a model's `_keys_to_ignore_on_save`."""
    lay, rank = state.layout, mesh.rank
    names: dict[int, list[str]] = {i: [lay.paths[i]] for i in range(len(lay.paths))}
    for name, canonical in (aliases or {}).items():
        if name != canonical and canonical in lay.path_index:
            names[lay.path_index[canonical]].append(name)
    names = {i: [n for n in ns if n not in transient] for i, ns in names.items()}
    error, writers, where = None, [], {}
    if rank == 0:
        try:
            specs = {
                n: (dtype or lay.dtypes[i], lay.shapes[i])
                for i in natural_order(lay)
                for n in names[i]
            }
            buffers = {}
            if state.buffers is not None:
                leaves = tree_flatten(state.buffers)[0]
                named = zip(leaf_paths(state.buffers), leaves)
                buffers = {n: b for n, b in named if n not in transient}
                specs.update({n: (b.dtype, tuple(b.shape)) for n, b in buffers.items()})
            files = {os.fspath(path): list(specs)} if split is None else split(specs)
            for file, members in files.items():
                writer = safetensors_writer(file, {n: specs[n] for n in members}, metadata or {})
                writers.append(writer)
                where.update((n, writer) for n in members)
            for n, b in buffers.items():
                where[n].write(n, 0, b)
        except Exception as exc:
            error = exc
    latches = {id(w): _Latch(w) for w in writers}

    def put_param(leaf: int, value: torch.Tensor) -> None:
        for n in names[leaf] if where else ():
            latches[id(where[n])].write(n, value.to(dtype) if dtype is not None else value)

    _gathering(_All(writers), lambda: gather_leaves(state, None, None, mesh, put_param, None))
    error = error or next((la.error for la in latches.values() if la.error), None)
    try:
        # Every file durable before the first replaces an older one: a disk filling, or a
        # failing fsync, leaves an earlier export's files all as they were, not some new.
        for writer in writers if error is None else ():
            writer.flush()
        for writer in writers if error is None else ():
            writer.commit()
        if finish is not None and rank == 0 and error is None:
            finish(files)
    except Exception as exc:
        error = exc
    if error is not None:
        _All(writers).abort()
    agree(error, None, mesh, what)


class _All:
    """Several writers aborted as one (each removes its temporary file)."""

    def __init__(self, writers: list[OffsetWriter]) -> None:
        self.writers = writers

    def abort(self) -> None:
        for w in self.writers:
            w.abort()
