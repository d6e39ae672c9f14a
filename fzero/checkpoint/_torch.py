"""Import from plain torch model and torch.optim state dicts; the order torch numbers leaves."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import (
    STAGES,
    PyTree,
    ShardLayout,
    build_layout,
    leaf_paths,
    stage_of,
    tree_flatten,
    tree_unflatten,
)
from .._state import (
    DynamicLossScale,
    Offload,
    Precision,
    ShardedState,
    cast_params,
    frozen_leaves,
    replicate_buffers,
)
from ..optim import Optimizer
from ._build import check_offloaded, resume
from ._chain import at, chained
from ._groups import loaded_order
from ._schema import CheckpointError, Key, Local, Schema, agree, merge, pieces_of, report, walk

# fzero state -> torch.optim state keys, per optimizer state type.
_ADAM = {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "max_exp_avg_sq"}
_SGD = {"momentum": "momentum_buffer"}


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


def _as_given(path: str, value: torch.Tensor, given: Any, masters: bool) -> torch.Tensor:
    """`value` in the dtype of the model's leaf `given`, whose shape it must have; where
    a precision may keep `masters`, in the wider of the two (an fp32 value of a bf16 leaf
    is its master, not rounded: `to_mixed` makes the compute copy)."""
    shape, dtype = getattr(given, "shape", None), getattr(given, "dtype", None)
    if shape is not None and tuple(shape) != tuple(value.shape):
        raise CheckpointError(
            f"model_state_dict's {path!r} is {tuple(value.shape)}, the model's is {tuple(shape)}"
        )
    if dtype is None:
        return value
    if masters and dtype.is_floating_point and value.is_floating_point():
        return value.to(torch.promote_types(dtype, value.dtype))
    return value.to(dtype)


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
    buffers: PyTree = None,
    precision: Precision | None = None,
    loss_scale: DynamicLossScale | None = None,
    offload: Offload | None = None,
    param_names: Sequence[Sequence[str]] | None = None,
) -> ShardedState:
    """Builds a ShardedState from a plain model state dict and a torch.optim state dict.

    Collective; every rank passes the same dicts (for example each `torch.load`s them
    with `weights_only=True`). The reverse of `export_torch`: the optimizer dict's
    parameters are matched to leaves by name where its param groups carry torch's
    `"param_names"` (an optimizer built from `model.named_parameters()`, or an
    `export_torch` given groups) or `param_names` is passed; a single group without
    names numbers the trainable leaves in the order the tree was built. Several groups
    without names are refused (a decay and a no-decay group list the parameters out of
    the model's order). Hyper-parameters come from `optimizer`, not from the param
    groups.

    Args:
      model_state_dict: leaf path -> tensor, for exactly the leaves of the parameters
        (and of `buffers`, if given without `params_like`).
      optim_state_dict: a `torch.optim` state dict (`state`, `param_groups`) of the
        optimizer `optimizer` stands for (torch.optim.Adam/AdamW for `fzero.optim.adam`/
        `adamw`, SGD for `sgd`, the wrapped class for `from_torch`).
      optimizer: the fzero optimizer to continue with.
      mesh: the mesh.
      stage: the ZeRO stage (0-3).
      params_like: the parameter tree (values ignored) when it is not the flat dict
        `model_state_dict` itself (e.g. nested dicts and lists); its leaves that do not
        require grad, where others do, are frozen (`dict(model.named_parameters())`). As
        torch's `load_state_dict`, the state dict's tensors must have its shapes, and are
        cast to its dtypes (under a `precision`, the parameters compute in them and a
        wider value is kept as the master, unrounded).
      layout: "flat" or "tensor", as in `shard_state`.
      units: as in `shard_state`.
      frozen: as in `shard_state`.
      step: the number of updates already applied. Adam's is read from its "step"; torch's
        SGD keeps none, so by default it is 1 if momentum buffers exist, else 0. It
        matters to learning-rate schedules, and to SGD: 0 with momentum buffers is
        refused (fzero's SGD would take its next update for its first).
      device: where the state is built (None: `mesh.device`).
      buffers: the module's buffers, as `shard_state(buffers=)` takes them
        (`dict(model.named_buffers())`): a buffer the state dict holds takes its value,
        cast to the given buffer's dtype; the others (non-persistent ones) keep theirs.
      precision, loss_scale, offload: as in `shard_state`: the state dict's values
        become the masters under `precision` (in the wider of their dtype and the
        model's); the scaler starts afresh.
      param_names: each param group's parameter names, in the group's order, for a
        state dict whose groups do not name them (e.g. `[[n for n, p in decay],
        [n for n, p in no_decay]]`, as the torch optimizer was built).

    Returns:
      This rank's ShardedState.
    """
    spec = stage_of(stage)
    error, state = None, None
    try:
        like = model_state_dict if params_like is None else params_like
        if params_like is None and buffers is not None:  # the state dict less its buffers
            named = set(leaf_paths(buffers))
            like = {k: v for k, v in model_state_dict.items() if k not in named}
        paths = leaf_paths(like)
        # With params_like, further keys are allowed: a plain state_dict also holds buffers
        # and every name of a tied weight, which the parameter tree holds once.
        missing = [p for p in paths if p not in model_state_dict]
        if missing:
            raise CheckpointError(
                f"model_state_dict does not match the parameters: missing {missing[:5]}"
            )
        leaves = [model_state_dict[p].detach() for p in paths]
        compute = None  # the dtypes the parameters compute in where precision names none
        if params_like is not None:
            given = tree_flatten(like)[0]
            masters = precision is not None
            leaves = [_as_given(p, x, g, masters) for p, x, g in zip(paths, leaves, given)]
            compute = [getattr(g, "dtype", x.dtype) for g, x in zip(given, leaves)]
        params = tree_unflatten(tree_flatten(like)[1], leaves)
        # Frozen from `params_like`'s requires_grad where given (the state dict's values
        # are detached), as import_dcp and load read them.
        flags = frozen_leaves(params if params_like is None else like, frozen)
        lay = build_layout(params, mesh.shard_size, layout, units, flags)
        pairs = loaded_order(optim_state_dict, lay, param_names, "checkpoint.import_torch")
        torch_states = {leaf: optim_state_dict["state"].get(i, {}) for i, leaf in pairs}
        saved = torch_states_of(optimizer, lay, leaves, torch_states, step)
        src = DictSource(saved.schema, leaves, saved.per_leaf, saved.globals)
        dev = mesh.device if device is None else torch.device(device)
        read = lambda path: model_state_dict.get(path)  # noqa: E731
        state = resume(
            src, lay, optimizer, spec, mesh, saved.count if step is None else step, dev,
            "checkpoint.import_torch", precision=precision, offload=offload,
            extras=extras(buffers, read, loss_scale, dev), compute=compute,
        )  # fmt: skip
    except Exception as exc:
        error = exc
    offloaded = agree(error, offload is not None, mesh, "checkpoint.import_torch")
    check_offloaded(offloaded, "checkpoint.import_torch")
    assert state is not None
    return replicated(state, precision, mesh, "checkpoint.import_torch")


def extras(
    buffers: PyTree,
    read: Callable[[str], torch.Tensor | None],
    loss_scale: DynamicLossScale | None,
    device: torch.device,
) -> Callable[[ShardedState], ShardedState]:
    """What an import adds to a state beside parameters and optimizer state: `buffers`
    with the values `read(path)` finds for them, and a fresh scaler under `loss_scale`."""

    def add(state: ShardedState) -> ShardedState:
        out = None
        if buffers is not None:
            values = []
            for path, given in zip(leaf_paths(buffers), tree_flatten(buffers)[0]):
                if not isinstance(given, torch.Tensor):
                    raise TypeError(
                        f"buffers leaf {path!r} is a {type(given).__name__}, expected a tensor"
                    )
                found = read(path)
                if found is None:
                    if given.device.type == "meta":
                        raise CheckpointError(
                            f"buffer {path!r} is not in the checkpoint and is given on the "
                            "meta device: give its value (a non-persistent buffer)"
                        )
                    found = given
                elif tuple(found.shape) != tuple(given.shape):
                    raise CheckpointError(
                        f"buffer {path!r} is saved as {tuple(found.shape)}, the model's is "
                        f"{tuple(given.shape)}"
                    )
                values.append(found.detach().to(device, given.dtype, copy=True))
            out = tree_unflatten(tree_flatten(buffers)[1], values)
        scaler = None if loss_scale is None else loss_scale.init(device)
        return dataclasses.replace(state, buffers=out, scaler=scaler)

    return add


def replicated(
    state: ShardedState, precision: Precision | None, mesh: Mesh, what: str
) -> ShardedState:
    """`state` with rank 0's buffers on every rank (as `shard_state` holds them), cast to
    the precision's buffer dtype: collective, after every rank has built its state."""
    if state.buffers is None:
        return state
    buffers = replicate_buffers(state.buffers, mesh, what)
    if precision is not None:
        buffers = cast_params(buffers, precision.buffer_dtype)
    return dataclasses.replace(state, buffers=buffers)


class TorchStates(NamedTuple):
    """A torch.optim state seen by leaf: the schema, per leaf its entries' values (meta
    tensors where only their shape and dtype were known), the globals, the step count and
    each entry's torch name."""

    schema: Schema
    per_leaf: dict[int, dict[Key, torch.Tensor]]
    globals: dict[str, torch.Tensor]
    count: int
    names: dict[Key, str]


def torch_states_of(
    optimizer: Optimizer,
    lay: ShardLayout,
    leaves: list[torch.Tensor],
    states: dict[int, dict[str, Any]],
    step: int | None,
) -> TorchStates:
    """torch.optim's per-parameter `states` (leaf -> {name: tensor}) as `optimizer`'s state
    entries. Only 0-d values (steps) are read; of the others only shapes and dtypes, so
    meta tensors stand for what a source reads later, range by range."""
    whole = optimizer.init(())  # the state's shape, without any parameter
    # A chain's optimizer's state, under its prefix; its transformations' globals (a
    # clip's last norm) start as their init has them.
    where, probe = chained(whole)
    nodes: list[str] = []
    globals_: list[str] = []
    spec = optree.tree_structure(())
    walk(probe, spec, lambda p, t: nodes.append(p), lambda p, t: globals_.append(p))
    kind = type(probe).__name__
    per_leaf: dict[int, dict[Key, torch.Tensor]] = {}
    names: dict[Key, str] = {}
    count = 0
    if kind in ("AdamState", "SgdState"):
        table = _ADAM if kind == "AdamState" else _SGD
        steps = {float(s["step"]) for s in states.values() if "step" in s}
        if len(steps) > 1:
            raise CheckpointError(f"parameters are at different steps {sorted(steps)}")
        stepped = any(states.values())
        if kind == "SgdState" and stepped and step == 0:
            # fzero's SGD takes step 0 for its first, which sets the buffer to the
            # gradient (torch's step without a buffer): the imported momentum would go.
            raise CheckpointError(
                "step=0 with SGD momentum buffers: fzero's SGD would take its next update "
                "for its first and replace the buffers by the gradient; pass the number of "
                "updates applied (>= 1), or leave step= out (1)"
            )
        count = int(steps.pop()) if steps else (step if step is not None else int(stepped))
        for i, st in states.items():
            per_leaf[i] = {}
            for node in nodes:
                if st and table[node] not in st:
                    raise CheckpointError(f"torch state of {lay.paths[i]!r} lacks {table[node]!r}")
                # Zeros for a parameter torch never stepped (meta where the leaf is: a
                # source reads them as zeros; 0-d ones real, for the schema's scalars).
                zeros = torch.zeros_like(leaves[i], device="cpu" if leaves[i].dim() == 0 else None)
                value = st[table[node]] if st else zeros
                per_leaf[i][node, ""] = value.detach().to(leaves[i].dtype)
                names[node, ""] = table[node]
        glob = {"count": torch.tensor(count, dtype=torch.int64, device="cpu")}
    elif nodes == [""] and not globals_:
        for i, st in states.items():
            bad = [k for k, v in st.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise CheckpointError(f"torch state of {lay.paths[i]!r} has non-tensor {bad}")
            per_leaf[i] = {("", k): v.detach() for k, v in st.items()}
            names.update({("", k): k for k in st})
        glob = {}
        # The state's step count, for schedules: torch's "step" where its optimizer keeps
        # one and every parameter agrees, as for Adam's.
        steps = {float(st["step"]) for st in states.values() if "step" in st}
        if step is None and len(steps) > 1:  # the schedules' count would restart at 0
            raise CheckpointError(
                f"parameters are at different steps {sorted(steps)}: pass step= (the "
                "updates applied, which learning-rate schedules read)"
            )
        count = step if step is not None else int(steps.pop()) if steps else 0
    else:
        raise CheckpointError(f"importing cannot map torch.optim state to a {kind}")
    if where:  # the entries and globals at their paths in the chain's state
        nodes = [at(where, n) for n in nodes]
        per_leaf = {
            i: {(at(where, n), sub): v for (n, sub), v in st.items()} for i, st in per_leaf.items()
        }
        names = {(at(where, n), sub): v for (n, sub), v in names.items()}
        glob = {at(where, g): v for g, v in glob.items()}
        walk(whole, spec, lambda p, t: t, lambda p, t: glob.setdefault(p, t))
        kind = type(whole).__name__
    pieces = pieces_of(lay, STAGES[0], 0)  # torch.optim state: whole leaves, as stage 0
    occ: dict[Key, list[tuple[int, torch.Tensor]]] = {}
    for pi, p in enumerate(pieces):
        for key, value in per_leaf.get(p.leaf, {}).items():
            occ.setdefault(key, []).append((pi, value))
    schema = merge([report(Local(pieces, kind, nodes, occ, glob), lay)])
    return TorchStates(schema, per_leaf, glob, count, names)
