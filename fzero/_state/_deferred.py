"""shard_state's deferred path: this rank's buckets and buffers filled by an `Init`, checked
to agree across ranks (values are made on every rank, never broadcast)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _comm
from .._comm import Mesh
from .._core import PyTree, ShardLayout, Stage, leaf_paths, tree_flatten, tree_unflatten
from ._initializers import Init, Wants
from ._precision import Precision, check_castable, gathered_leaves


def materialize(
    init: Init,
    layout: ShardLayout,
    mesh: Mesh,
    stage: Stage,
    buffers: PyTree,
    precision: Precision | None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> tuple[tuple[torch.Tensor, ...], PyTree]:
    """This rank's bucket buffers (its slices at stage 3, else full) and `buffers`, with
    the values `init` makes; buffers not on the meta device are kept as given, unless
    the init reads them from a file that holds them. `dtypes`, per leaf, what `init` makes
    the values in where the buckets hold another (a bf16 model's fp32 masters); None: the
    layout's.

    Collective: raises on every rank if any rank's init failed, made other values than
    rank 0's, or made values that overflow the precision's dtypes.
    """
    rank, error, digests = mesh.shard_rank, None, {}
    flats: tuple[torch.Tensor, ...] = ()
    try:
        flats, buffers, digests = _fill(init, layout, rank, stage.shards_params, buffers, dtypes)
        if precision is not None:
            values = _leaf_values(flats, layout, rank, stage)
            check_castable(values, precision.param_dtype, rank, "param_dtype")
            gathered = gathered_leaves(stage, layout.frozen)
            check_castable(values, precision.gather_dtype, rank, "gather_dtype", gathered)
    except Exception as exc:  # every rank must learn of it before it is raised
        error = exc
    _agree(error, digests, mesh)
    return flats, buffers


def check_init(params: PyTree, init: Init | None) -> None:
    if init is not None:
        if not isinstance(init, Init):
            raise TypeError(
                f"init must come from fzero.init (from_module, by_leaf, from_file), got {init!r}"
            )
        return
    for path, x in zip(leaf_paths(params), tree_flatten(params)[0]):
        if x.device.type == "meta":
            raise ValueError(
                f"params leaf {path!r} is on the meta device (no values): pass init= "
                "(fzero.init.from_module, by_leaf or from_file) to materialize it sharded"
            )


def _fill(
    init: Init,
    layout: ShardLayout,
    rank: int,
    sharded: bool,
    buffers: PyTree,
    dtypes: Sequence[torch.dtype] | None = None,
) -> tuple[tuple[torch.Tensor, ...], PyTree, dict[str, str]]:
    """This rank's bucket buffers (its slices if `sharded`, else full) and `buffers`, with
    the values `init` makes. Buffers that are not on the meta device are kept as given,
    unless the init reads them from a file that holds them.

    Returns:
      `(bucket buffers, buffers, digests)`.
    """
    wants: Wants = {}
    flats = []
    for b in layout.buckets:
        lo, hi = (0, b.full_numel)
        if sharded:
            lo, hi = rank * b.shard_numel, (rank + 1) * b.shard_numel
        out = torch.zeros(hi - lo, dtype=b.dtype, device=init.device)  # padding stays zero
        for s in b.slots:
            a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < z:
                want = (a - s.offset, z - s.offset, out[a - lo : z - lo])
                wants.setdefault(s.path, []).append(want)
        flats.append(out)
    likes = {
        p: torch.empty(shape, dtype=dtype, device="meta")
        for p, shape, dtype in zip(layout.paths, layout.shapes, dtypes or layout.dtypes)
    }
    held = None
    if buffers is not None:
        leaves, treedef = tree_flatten(buffers)
        paths = leaf_paths(buffers)
        real = [p for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor) and not x.is_meta]
        # A buffer with values of its own is still read from a file holding it (a
        # pretrained model's BatchNorm statistics, Marian's `final_logits_bias`), as
        # `from_pretrained` reads it; one the init would make afresh keeps its values.
        read = init.holds([*layout.paths, *real]) if real else set()
        values = []
        for path, x in zip(paths, leaves):
            if not isinstance(x, torch.Tensor) or not (x.is_meta or path in read):
                values.append(x)
                continue
            if path in likes:
                raise ValueError(f"buffer {path!r} has the path of a parameter")
            v = torch.empty(x.shape, dtype=x.dtype, device=init.device)
            wants[path] = [(0, v.numel(), v.view(-1))]
            likes[path] = torch.empty(x.shape, dtype=x.dtype, device="meta")
            values.append(v)
        held = tree_unflatten(treedef, values)
    return tuple(flats), held, init.fill(wants, likes)


def _leaf_values(
    flats: tuple[torch.Tensor, ...], lay: ShardLayout, rank: int, stage: Stage
) -> PyTree:
    """The parameter values a rank holds, by leaf path (its parts of them at stage 3)."""
    if not stage.shards_params:
        return lay.unflatten(flats)
    out = {}
    for b, flat in zip(lay.buckets, flats):
        lo = rank * b.shard_numel
        for s in b.slots:
            a, z = max(lo, s.offset), min(lo + b.shard_numel, s.offset + s.numel)
            if a < z:
                out[s.path] = flat[a - lo : z - lo]
    return out


def _agree(error: Exception | None, digests: dict[str, str], mesh: Mesh) -> None:
    """Raises on every rank if any rank's init failed or made other values than rank 0's
    (agreed: what the exchange says; an error of the exchange itself is this rank's)."""
    mine = (None if error is None else f"{type(error).__name__}: {error}", digests)
    everyone = _comm.all_gather_object(mine, mesh)
    for rank, (problem, _) in enumerate(everyone):
        if problem is not None:  # the same error on every rank, its cause on the failing one
            said = f"shard_state: rank {rank}'s init failed: {problem}"
            raise _comm.agreed(_kind(problem)(said)) from error
    ref = everyone[0][1]
    for rank, (_, theirs) in enumerate(everyone[1:], start=1):
        for path in ref:
            if theirs.get(path) != ref[path] and path == "<file>":
                raise _comm.agreed(
                    ValueError(
                        f"shard_state: rank {rank} read a file with other contents than rank "
                        "0's (its index or a sample of its tensors' bytes differ): every rank "
                        "must read the same file (a copy on each machine must be byte for byte "
                        "the same)"
                    )
                )
            if theirs.get(path) != ref[path]:
                raise _comm.agreed(
                    ValueError(
                        f"shard_state: rank {rank}'s init made other values than rank 0's for "
                        f"{path!r}: the init is not deterministic across ranks (draw random "
                        "numbers only from the default generator, which fzero seeds, and read "
                        "the same file on every rank)"
                    )
                )


def _kind(problem: str) -> type[Exception]:
    name = problem.split(":", 1)[0]
    return {"TypeError": TypeError, "ValueError": ValueError}.get(name, RuntimeError)
