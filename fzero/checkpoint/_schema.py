"""A ShardedState seen independently of world size: pieces, optimizer-state entries, globals."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import Bucket, ShardLayout, Stage, tree_unflatten
from .._state import digest
from ..optim._pieces import walk as walk

# An optimizer-state entry: (node, sub). `node` is the path of a subtree of the state that
# mirrors the optimizer's pieces (AdamState.mu -> "mu"; from_torch's whole state -> ""),
# `sub` the key inside one piece's state ("" when that state is the tensor itself, as for
# mu; "exp_avg" in a from_torch dict).
Key = tuple[str, str]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read or used as asked; the message says why."""


class CheckpointIOError(OSError, CheckpointError):
    """Writing or reading a file failed with the OS error it carries (`errno`: ENOSPC,
    EFBIG, EROFS, ...): an `OSError` and a `CheckpointError` alike."""


@dataclass(frozen=True)
class Piece:
    """One tensor the optimizer updates on a rank, and where it lies in its bucket.

    `owner` names it in a way that survives resharding: "l<i>" is leaf i, whole (stage 0,
    and the "tensor" layout), "b<k>" a rank's slice [lo, hi) of flat bucket k.
    """

    owner: str
    bucket: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def leaf(self) -> int:
        return int(self.owner[1:]) if self.owner[0] == "l" else -1


@dataclass(frozen=True)
class Entry:
    """How one optimizer-state entry is stored and resharded.

    kind "elem": one value per parameter element (Adam's moments, momentum buffers),
    resharded like the parameters. kind "piece": one tensor per piece (torch's "step",
    Adafactor's factored moments); `uniform` when every piece holds the same 0-d value, so
    it can be copied to pieces of any layout. `present`: leaves whose pieces have it.
    `where`: (owner, rank) of each stored per-piece value.
    """

    node: str
    sub: str
    kind: str
    dtype: str  # "param" (each piece's own dtype) or a torch dtype name
    uniform: bool
    present: frozenset[int]
    where: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        return ".".join(x for x in (self.node, self.sub) if x) or "<state>"


@dataclass(frozen=True)
class Schema:
    """Every rank's agreed description of an optimizer state (same on all ranks)."""

    kind: str  # type name of the state's root: "AdamState", "SgdState", "tuple" (from_torch)
    nodes: tuple[str, ...]
    globals: dict[str, tuple[str, tuple[int, ...]]]  # path -> (dtype name, shape)
    entries: tuple[Entry, ...]

    def index(self, key: Key) -> int:
        for j, e in enumerate(self.entries):
            if (e.node, e.sub) == key:
                return j
        return -1


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called `name` ("torch.float64" or "float64")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def pieces_of(layout: ShardLayout, stage: Stage, rank: int) -> list[Piece]:
    """The pieces `optimizer.init` saw on `rank`, in order (see `ShardLayout.pieces`)."""
    out = []
    if not stage.shards_optimizer:  # the trainable leaves, whole, in flatten order
        where = {s.index: (k, s) for k, b in enumerate(layout.buckets) for s in b.slots}
        for i, frozen in enumerate(layout.frozen):
            if not frozen:
                k, s = where[i]
                dtype = layout.buckets[k].dtype
                out.append(Piece(f"l{i}", k, s.offset, s.offset + s.numel, s.shape, dtype))
        return out
    for k, b in enumerate(layout.buckets):
        if b.frozen:
            continue
        if layout.kind == "flat":
            lo = rank * b.shard_numel
            out.append(Piece(f"b{k}", k, lo, lo + b.shard_numel, (b.shard_numel,), b.dtype))
            continue
        for s in b.slots:
            if s.owner == rank:
                out.append(Piece(f"l{s.index}", k, s.offset, s.offset + s.numel, s.shape, b.dtype))
    return out


def covered(bucket: Bucket, lo: int, hi: int) -> list[int]:
    """Indices of the non-empty leaves of `bucket` overlapping [lo, hi)."""
    return [s.index for s in bucket.slots if s.numel and s.offset < hi and s.offset + s.numel > lo]


def piece_spec(layout: ShardLayout, stage: Stage, npieces: int) -> optree.PyTreeSpec:
    """The structure the optimizer was initialised with: what per-piece subtrees look like."""
    if not stage.shards_optimizer:
        marks = [None if f else 0 for f in layout.frozen]
        spec = optree.tree_structure(tree_unflatten(layout.treedef, marks))
        if spec.num_nodes == 1:
            raise CheckpointError(
                "checkpoints need params in a container (dict, list), not a bare tensor"
            )
        return spec
    return optree.tree_structure(tuple(range(npieces)))


def piece_items(state: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """(sub, tensor) of one piece's state: the tensor itself, or a dict of tensors."""
    if isinstance(state, torch.Tensor):
        return [("", state)]
    if isinstance(state, dict):
        items = []
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {where}[{key!r}] is a {type(value).__name__}; "
                    "checkpoints hold tensors"
                )
            items.append((str(key), value))
        return items
    raise CheckpointError(
        f"optimizer state {where} is a {type(state).__name__}, not a tensor or dict"
    )


@dataclass
class Local:
    """What one rank holds of a state, named so that it means the same at any world size."""

    pieces: list[Piece]
    kind: str
    nodes: list[str]
    occ: dict[Key, list[tuple[int, torch.Tensor]]]  # entry -> (piece index, value)
    globals: dict[str, torch.Tensor]


def local_view(opt_state: Any, layout: ShardLayout, stage: Stage, rank: int) -> Local:
    """Splits this rank's optimizer state into per-piece entries and globals."""
    pieces = pieces_of(layout, stage, rank)
    spec = piece_spec(layout, stage, len(pieces))
    local = Local(pieces, type(opt_state).__name__, [], {}, {})

    def on_node(path: str, tree: Any) -> Any:
        local.nodes.append(path)
        for j, state in enumerate(spec.flatten_up_to(tree)):
            for sub, value in piece_items(state, f"{path or '<root>'}[{j}]"):
                local.occ.setdefault((path, sub), []).append((j, value))
        return tree

    def on_global(path: str, value: torch.Tensor) -> torch.Tensor:
        local.globals[path] = value
        return value

    walk(opt_state, spec, on_node, on_global)
    _check_no_leaf_among_globals(local, layout)
    return local


def _check_no_leaf_among_globals(local: Local, layout: ShardLayout) -> None:
    """Refuses a global tensor that is a whole leaf's per-parameter value: a tensor with a
    trainable leaf's shape at a path ending in that leaf's path sits in a subtree shaped
    like the parameters yet not like the pieces the optimizer was initialised with here."""
    leaves = {layout.paths[p.leaf]: p.shape for p in local.pieces if p.leaf >= 0}
    for path, value in local.globals.items():
        parts = path.split(".")
        for i in range(1, len(parts)):
            name = ".".join(parts[i:])
            if value.dim() and leaves.get(name) == tuple(value.shape):
                raise CheckpointError(
                    f"optimizer state {path!r} has the shape of leaf {name!r} "
                    f"({list(value.shape)}) but lies outside every subtree shaped like the "
                    f"{len(local.pieces)} pieces the layout gives this rank: the state "
                    f"does not line up with the layout it is saved with, and {path!r} "
                    f"would be saved as global state. {_MADE_FOR}"
                )


# How a state comes not to line up (said after what does not).
_MADE_FOR = (
    "Was it made for other parameters, units, frozen leaves or another layout? Use the "
    "optimizer state `shard_state` or `checkpoint.load` made for this state."
)


def report(local: Local, layout: ShardLayout, share: bool = True) -> dict[str, Any]:
    """A small picklable summary of `local`, from which every rank derives the Schema."""
    entries = {}
    for key, occs in local.occ.items() if share else ():
        r: dict[str, Any] = {"elem": True, "wide": False, "param_dtype": True, "dtypes": set()}
        r.update(scalars=set(), all0d=True, present=set(), owners=[])
        for j, value in occs:
            p = local.pieces[j]
            same = tuple(value.shape) == p.shape
            r["elem"] &= same
            r["wide"] |= same and len(p.shape) > 0
            r["param_dtype"] &= value.dtype == p.dtype
            r["dtypes"].add(str(value.dtype))
            if value.dim() == 0:
                r["scalars"].add((str(value.dtype), value.item()))
            else:
                r["all0d"] = False
            r["present"].update(covered(layout.buckets[p.bucket], p.lo, p.hi))
            r["owners"].append(p.owner)
        entries[key] = r
    shapes = {g: (str(t.dtype), tuple(t.shape)) for g, t in local.globals.items()}
    out = {"kind": local.kind, "nodes": list(local.nodes), "globals": shapes, "entries": entries}
    if share:  # rank 0 alone saves the globals: others' must be its (0-d ones: counts, norms)
        out["values"] = {g: digest(t) for g, t in local.globals.items() if t.dim()}
    return out


def _check_same_globals(reports: Sequence[dict[str, Any]]) -> None:
    """Every rank's per-piece subtrees and global tensors are rank 0's: rank 0 alone saves
    the globals, so a rank whose differ would lose them (its moments filed as globals)."""
    first = reports[0]
    for rank, r in enumerate(reports[1:], 1):
        got = _difference(first, r, rank)
        if got is not None:  # the same reports on every rank: raised on all of them
            raise _comm.agreed(
                CheckpointError(
                    f"the optimizer state does not line up with the layout it is saved "
                    f"with: {got}. Tensors outside the subtrees that mirror the "
                    f"optimizer's pieces are global state, saved once from rank 0. {_MADE_FOR}"
                )
            )


def _difference(first: dict[str, Any], other: dict[str, Any], rank: int) -> str | None:
    """How rank `rank`'s report differs from rank 0's in its state's structure and globals."""
    if other["nodes"] != first["nodes"]:
        nodes = other["nodes"], first["nodes"]
        return f"its per-piece subtrees are {nodes[0]} on rank {rank}, {nodes[1]} on rank 0"

    def described(report: dict[str, Any], path: str) -> str:
        if path not in report["globals"]:
            return "absent"
        dtype, shape = report["globals"][path]
        return f"{dtype.removeprefix('torch.')} {list(shape)}"

    values = other.get("values", {}), first.get("values", {})
    for g in sorted(set(other["globals"]) | set(first["globals"])):
        if other["globals"].get(g) != first["globals"].get(g):
            return f"{g!r} is {described(other, g)} on rank {rank}, {described(first, g)} on rank 0"
        if g in values[0] and g in values[1] and values[0][g] != values[1][g]:
            return f"{g!r} ({described(first, g)}) holds other values on rank {rank} than on rank 0"
    return None


def merge(reports: Sequence[dict[str, Any]]) -> Schema:
    """The Schema all ranks agree on, from every rank's `report` (in rank order)."""
    _check_same_globals(reports)
    first = reports[0]
    entries = []
    for key in sorted(set().union(*(r["entries"] for r in reports))):
        rs = [(rank, r["entries"][key]) for rank, r in enumerate(reports) if key in r["entries"]]
        dtypes = set().union(*(x["dtypes"] for _, x in rs))
        param_dtype = all(x["param_dtype"] for _, x in rs)
        elem = all(x["elem"] for _, x in rs) and any(x["wide"] for _, x in rs)
        elem &= param_dtype or len(dtypes) == 1
        scalars = set().union(*(x["scalars"] for _, x in rs))
        uniform = all(x["all0d"] for _, x in rs) and len(scalars) == 1
        where = () if elem else tuple((o, rank) for rank, x in rs for o in x["owners"])
        entries.append(
            Entry(
                key[0],
                key[1],
                "elem" if elem else "piece",
                "param" if param_dtype else sorted(dtypes)[0],
                uniform,
                frozenset().union(*(x["present"] for _, x in rs)),
                where,
            )
        )
    return Schema(first["kind"], tuple(first["nodes"]), dict(first["globals"]), tuple(entries))


def elem_slice(
    local: Local, key: Key, entry: Entry, bucket: Bucket, k: int, lo: int, hi: int
) -> torch.Tensor:
    """Elements [lo, hi) of bucket k's flat buffer of elementwise entry `key` (zeros where
    this rank has no value: padding, or leaves it does not own)."""
    dtype = bucket.dtype if entry.dtype == "param" else dtype_of(entry.dtype)
    out = torch.zeros(hi - lo, dtype=dtype, device="cpu")
    for j, value in local.occ.get(key, ()):
        p = local.pieces[j]
        a, b = max(lo, p.lo), min(hi, p.hi)
        if p.bucket == k and a < b:
            out[a - lo : b - lo] = value.detach().reshape(-1)[a - p.lo : b - p.lo]
    return out


def agree(error: BaseException | None, payload: Any, mesh: Mesh, what: str) -> list[Any]:
    """Every rank's payload, or the same CheckpointError on every rank if any rank failed.

    A rank that fails alone must not leave its peers waiting in the next collective.
    """
    problem: Any = None
    if error is not None:
        problem = (
            str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
        )
        # An OS error travels as itself, on every rank (fzero's own say more: kept).
        os_error = None if isinstance(error, CheckpointError) else find_os_error(error)
        if os_error is not None:
            problem = (os_error.errno, os_error.strerror, os_error.filename)
    everyone = _comm.all_gather_object((problem, payload), mesh)
    for rank, (prob, _) in enumerate(everyone):
        if prob is not None:
            where = f" on rank {rank} of {mesh.size}" if mesh.size > 1 else ""
            if isinstance(prob, tuple):
                number, text, filename = prob
                exc: CheckpointError = CheckpointIOError(
                    number, f"{text} ({what} failed{where})", filename
                )
            else:
                exc = CheckpointError(f"{what} failed{where}: {prob}")
            raise _comm.agreed(exc) from error
    return [p for _, p in everyone]


def find_os_error(exc: BaseException | None) -> OSError | None:
    """The OS error behind `exc` (itself, or one it was raised from or while handling):
    torch.save reports a full disk as "unexpected pos" with the OSError as its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
