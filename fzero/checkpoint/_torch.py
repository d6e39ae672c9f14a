"""Import from plain torch model and torch.optim state dicts; the order torch numbers leaves."""

from __future__ import annotations

from typing import Any

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    NAMESPACE,
    STAGES,
    PyTree,
    ShardLayout,
    build_layout,
    leaf_paths,
    stage_of,
    tree_flatten,
    tree_unflatten,
)
from .._state import ShardedState, frozen_leaves
from ..optim import Optimizer
from ._build import build_state
from ._schema import CheckpointError, Key, Local, Schema, agree, merge, pieces_of, report, walk

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


@_comm.collective("checkpoint.import_torch")
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
    device: Any = None,
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
      device: where the state is built (None: `mesh.device`).

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
        lay = build_layout(params, mesh.shard_size, layout, units, frozen_leaves(params, frozen))
        order = [i for i in natural_order(lay) if not lay.frozen[i]]
        ids = [i for g in optim_state_dict["param_groups"] for i in g["params"]]
        if len(ids) != len(order):
            raise CheckpointError(
                f"optim_state_dict has {len(ids)} parameters, the model {len(order)} trainable ones"
            )
        torch_states = {leaf: optim_state_dict["state"].get(i, {}) for i, leaf in zip(ids, order)}
        src, count = _from_torch(optimizer, lay, leaves, torch_states, step)
        dev = mesh.device if device is None else torch.device(device)
        state = build_state(
            src, lay, optimizer, spec, mesh.shard_rank, count if step is None else step, dev
        )
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
        glob = {"count": torch.tensor(count, dtype=torch.int64, device="cpu")}
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
