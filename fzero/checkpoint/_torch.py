"""Consolidated export to, and import from, plain torch model and torch.optim state dicts."""

from __future__ import annotations

import os
from typing import Any

import optree
import torch

from .. import _comm
from .._layout import ShardLayout, build_layout
from .._mesh import Mesh
from .._stages import STAGES, Stage, stage_of
from .._state import ShardedState, _frozen_leaves
from .._tree import NAMESPACE, PyTree, leaf_paths, tree_flatten, tree_unflatten
from ..optim import Optimizer
from ._build import build_state
from ._schema import (
    CheckpointError,
    Key,
    Local,
    Schema,
    agree,
    elem_slice,
    local_view,
    merge,
    pieces_of,
    report,
    walk,
)

# fzero state -> torch.optim state keys, per optimizer state type.
_ADAM = {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}
_SGD = {"momentum": "momentum_buffer"}


def natural_order(layout: ShardLayout) -> list[int]:
    """Leaf indices in the order the parameter tree was built (a module's parameter order).

    optree flattens dicts in sorted key order ("layers.10" before "layers.2"), but a torch
    optimizer numbers parameters in `model.parameters()` order, which is the insertion
    order of `dict(model.named_parameters())`; unflattening the indices recovers it.
    """
    out: list[int] = []

    def visit(node: Any) -> None:
        if isinstance(node, int) and not isinstance(node, bool):
            out.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)
        elif node is not None:
            for value in optree.tree_flatten_one_level(node, namespace=NAMESPACE)[0]:
                visit(value)

    visit(tree_unflatten(layout.treedef, list(range(len(layout.paths)))))
    return out


def _scalar_dtype() -> torch.dtype:
    # torch.optim's own choice for its "step" tensors.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def export_torch(
    state: ShardedState,
    path: str | None,
    mesh: Mesh,
    hyperparams: dict[str, Any] | None,
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """See `fzero.checkpoint.export_torch`; `aliases` maps a tied name to its leaf's path."""
    lay, stage, rank = state.layout, stage_of(state.stage), mesh.rank
    error, rep, local = None, None, None
    try:
        local = local_view(state.opt_state, lay, stage, rank)
        rep = report(local, lay, share=stage.shards_optimizer or rank == 0)
    except Exception as exc:
        error = exc
    schema = merge(agree(error, rep, mesh, "checkpoint.export_torch"))
    assert local is not None
    pieces = _piece_values(local, schema, stage, mesh)
    params, elems = _gather_leaves(state, local, schema, mesh)
    error, out = None, None
    if rank == 0:
        try:
            out = _to_torch(lay, schema, local, params, elems, pieces, hyperparams)
            model_sd = out[0]
            if state.buffers is not None:  # a plain state_dict holds buffers too
                for name, buf in zip(leaf_paths(state.buffers), tree_flatten(state.buffers)[0]):
                    model_sd[name] = buf.detach().clone()
            for name, canonical in (aliases or {}).items():  # tied weights: every name
                if name not in model_sd and canonical in model_sd:
                    model_sd[name] = model_sd[canonical]
            if path is not None:
                _write_atomically(out, os.fspath(path))
        except Exception as exc:
            error = exc
    agree(error, None, mesh, "checkpoint.export_torch")
    return out


def _gather_leaves(
    state: ShardedState, local: Local, schema: Schema, mesh: Mesh
) -> tuple[dict[int, torch.Tensor], dict[tuple[int, int], torch.Tensor]]:
    """On rank 0: leaf -> parameter, (entry, leaf) -> elementwise optimizer state.

    Bucket by bucket, unit by unit: a rank holds one bucket's full buffer at a time
    besides rank 0's output. Replicated values (parameters at stages 0-2, all of stage 0's
    optimizer state) are read where they are, without communication.
    """
    lay, stage, rank = state.layout, stage_of(state.stage), mesh.rank
    params: dict[int, torch.Tensor] = {}
    elems: dict[tuple[int, int], torch.Tensor] = {}
    replicated = None if stage.shards_params else tree_flatten(state.params)[0]
    piece_of = {p.leaf: pi for pi, p in enumerate(local.pieces)}
    for unit in lay.units:
        for k in lay.unit_buckets(unit):
            b = lay.buckets[k]
            full = _comm.all_gather(state.params.buffers[k], mesh) if replicated is None else None
            for s in b.slots if rank == 0 else ():
                leaf = replicated[s.index] if full is None else full[s.offset : s.offset + s.numel]
                params[s.index] = leaf.detach().reshape(s.shape).clone()
            del full
            for j, e in enumerate(schema.entries):
                if b.frozen or e.kind != "elem":
                    continue
                key = (e.node, e.sub)
                if not stage.shards_optimizer:
                    values = dict(local.occ.get(key, ()))
                    for s in b.slots if rank == 0 else ():
                        if piece_of[s.index] in values:
                            elems[j, s.index] = values[piece_of[s.index]].detach().clone()
                    continue
                lo = rank * b.shard_numel
                shard = elem_slice(local, key, e, b, k, lo, lo + b.shard_numel)
                full_e = _comm.all_gather(shard, mesh)
                for s in b.slots if rank == 0 else ():
                    cut = full_e[s.offset : s.offset + s.numel]
                    elems[j, s.index] = cut.reshape(s.shape).clone()
    return params, elems


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
    return {k: v for part in _comm.all_gather_object(mine, mesh) for k, v in part.items()}


def _to_torch(
    lay: ShardLayout,
    schema: Schema,
    local: Local,
    params: dict[int, torch.Tensor],
    elems: dict[tuple[int, int], torch.Tensor],
    pieces: dict[tuple[int, str], torch.Tensor],
    hyperparams: dict[str, Any] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    order = natural_order(lay)
    trainable = [i for i in order if not lay.frozen[i]]
    model = {lay.paths[i]: params[i] for i in order}

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
    for idx, i in enumerate(trainable):
        if schema.kind in ("AdamState", "SgdState"):
            names = _ADAM if schema.kind == "AdamState" else _SGD
            st = {names[e.node]: value(j, i) for j, e in enumerate(schema.entries) if count}
            if st and schema.kind == "AdamState":
                st = {"step": torch.tensor(float(count), dtype=_scalar_dtype()), **st}
        elif schema.nodes == ("",) and schema.kind in ("tuple", "dict", "list"):
            st = {e.sub: value(j, i) for j, e in enumerate(schema.entries) if i in e.present}
        else:
            raise CheckpointError(
                f"export_torch maps fzero.optim adam/adamw/sgd and from_torch states to "
                f"torch.optim's format; this state is a {schema.kind}"
            )
        states[idx] = st
    group = {**(hyperparams or {}), "params": list(range(len(trainable)))}
    return model, {"state": states, "param_groups": [group]}


def _write_atomically(obj: Any, path: str) -> None:
    from ._disk import fsync_dir

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save({"model": obj[0], "optimizer": obj[1]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class DictSource:
    """In-memory per-leaf tensors as a `Source` (see `_build`)."""

    def __init__(
        self,
        schema: Schema,
        leaves: list[torch.Tensor],
        per_leaf: dict[int, dict[Key, torch.Tensor]],
        globals_: dict[str, torch.Tensor],
    ) -> None:
        self.schema, self.leaves, self.per_leaf, self.globals = schema, leaves, per_leaf, globals_

    def param(self, leaf: int, lo: int, hi: int) -> torch.Tensor:
        return self.leaves[leaf].detach().reshape(-1)[lo:hi]

    def elem(self, entry: int, leaf: int, lo: int, hi: int) -> torch.Tensor:
        # A copy: the state built from it is updated in place, the caller's dict must not be.
        return self.per_leaf[leaf][self._key(entry)].detach().reshape(-1)[lo:hi].clone()

    def piece(self, entry: int, leaf: int) -> torch.Tensor | None:
        return self.per_leaf.get(leaf, {}).get(self._key(entry))

    def uniform(self, entry: int) -> torch.Tensor:
        key = self._key(entry)
        return next(d[key] for d in self.per_leaf.values() if key in d)

    def global_(self, path: str) -> torch.Tensor:
        return self.globals[path]

    def _key(self, entry: int) -> Key:
        e = self.schema.entries[entry]
        return (e.node, e.sub)


def import_torch(
    model_state_dict: dict[str, torch.Tensor],
    optim_state_dict: dict[str, Any],
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    stage: int,
    params_like: PyTree = None,
    layout: str = "flat",
    units: Any = None,
    frozen: Any = None,
    step: int | None = None,
) -> ShardedState:
    """Builds a ShardedState from a plain model state dict and a torch.optim state dict.

    Collective; every rank passes the same dicts (for example each `torch.load`s them
    with `weights_only=True`). The reverse of `export_torch`: parameter i of the optimizer
    dict (param groups concatenated) is the i-th trainable leaf in the order the tree was
    built. Hyper-parameters come from `optimizer`, not from the param groups.

    Args:
      model_state_dict: leaf path -> tensor, for exactly the leaves of the parameters.
      optim_state_dict: a `torch.optim` state dict (`state`, `param_groups`) of the
        optimizer `optimizer` stands for (torch.optim.Adam/AdamW for `fzero.optim.adam`/
        `adamw`, SGD for `sgd`, the wrapped class for `from_torch`).
      optimizer: the fzero optimizer to continue with.
      mesh: the mesh.
      stage: the ZeRO stage (0-3).
      params_like: the parameter tree (values ignored) when it is not the flat dict
        `model_state_dict` itself (e.g. nested dicts and lists).
      layout: "flat" or "tensor", as in `shard_state`.
      units: as in `shard_state`.
      frozen: as in `shard_state`.
      step: the number of updates already applied. Adam's is read from its "step"; torch's
        SGD keeps none, so by default it is 1 if momentum buffers exist, else 0 (it only
        matters to learning-rate schedules).

    Returns:
      This rank's ShardedState.
    """
    spec = stage_of(stage)
    error, state = None, None
    try:
        like = model_state_dict if params_like is None else params_like
        paths = leaf_paths(like)
        missing = [p for p in paths if p not in model_state_dict]
        # With params_like, further keys are allowed: a plain state_dict also holds buffers
        # and every name of a tied weight, which the parameter tree holds once.
        extra = [] if params_like is not None else sorted(set(model_state_dict) - set(paths))
        if missing or extra:
            raise CheckpointError(
                f"model_state_dict does not match the parameters: missing {missing[:5]}, "
                f"unexpected {extra[:5]}"
            )
        leaves = [model_state_dict[p].detach() for p in paths]
        params = tree_unflatten(tree_flatten(like)[1], leaves)
        lay = build_layout(params, mesh.size, layout, units, _frozen_leaves(params, frozen))
        order = [i for i in natural_order(lay) if not lay.frozen[i]]
        ids = [i for g in optim_state_dict["param_groups"] for i in g["params"]]
        if len(ids) != len(order):
            raise CheckpointError(
                f"optim_state_dict has {len(ids)} parameters, the model {len(order)} trainable ones"
            )
        torch_states = {leaf: optim_state_dict["state"].get(i, {}) for i, leaf in zip(ids, order)}
        src, count = _from_torch(optimizer, lay, leaves, torch_states, step)
        state = build_state(src, lay, optimizer, spec, mesh.rank, count if step is None else step)
    except Exception as exc:
        error = exc
    agree(error, None, mesh, "checkpoint.import_torch")
    return state


def _from_torch(
    optimizer: Optimizer,
    lay: ShardLayout,
    leaves: list[torch.Tensor],
    states: dict[int, dict[str, Any]],
    step: int | None,
) -> tuple[DictSource, int]:
    probe = optimizer.init(())  # the state's shape, without any parameter
    nodes: list[str] = []
    globals_: list[str] = []
    spec = optree.tree_structure(())
    walk(probe, spec, lambda p, t: nodes.append(p), lambda p, t: globals_.append(p))
    kind = type(probe).__name__
    per_leaf: dict[int, dict[Key, torch.Tensor]] = {}
    count = 0
    if kind in ("AdamState", "SgdState"):
        names = _ADAM if kind == "AdamState" else _SGD
        steps = {float(s["step"]) for s in states.values() if "step" in s}
        if len(steps) > 1:
            raise CheckpointError(f"parameters are at different steps {sorted(steps)}")
        stepped = any(states.values())
        count = int(steps.pop()) if steps else (step if step is not None else int(stepped))
        for i, st in states.items():
            per_leaf[i] = {}
            for node in nodes:
                if st and names[node] not in st:
                    raise CheckpointError(f"torch state of {lay.paths[i]!r} lacks {names[node]!r}")
                value = st[names[node]] if st else torch.zeros_like(leaves[i])
                per_leaf[i][node, ""] = value.detach().to(leaves[i].dtype)
        glob = {"count": torch.tensor(count, dtype=torch.int64)}
    elif nodes == [""] and not globals_:
        for i, st in states.items():
            bad = [k for k, v in st.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise CheckpointError(f"torch state of {lay.paths[i]!r} has non-tensor {bad}")
            per_leaf[i] = {("", k): v.detach() for k, v in st.items()}
        glob = {}
    else:
        raise CheckpointError(f"import_torch cannot map torch.optim state to a {kind}")
    pieces = pieces_of(lay, STAGES[0], 0)  # torch.optim state: whole leaves, as stage 0
    occ: dict[Key, list[tuple[int, torch.Tensor]]] = {}
    for pi, p in enumerate(pieces):
        for key, value in per_leaf.get(p.leaf, {}).items():
            occ.setdefault(key, []).append((pi, value))
    schema = merge([report(Local(pieces, kind, nodes, occ, glob), lay)])
    return DictSource(schema, leaves, per_leaf, glob), count
