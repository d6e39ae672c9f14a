"""The collectives a compiled step's graph runs: traceable functional collectives over a
burst's rank-major table, where they run (`Axes`) and how its bytes travel — as they
are, as gloo's all-to-all, or as ZeRO++'s int8 blocks (qwZ, qgZ: the eager engine's
`_comm.quantize` arithmetic, inside the graph; a quantized gather's blocks checked for
inf or NaN after the forward, `check_sent`). `_entries` builds the units' entries from
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed._functional_collectives as fc

from .._comm import ALL_TO_ALL_MAX_BYTES, Mesh, QuantizedComm, backend_for, dequantize, quantize
from .._core import ShardLayout, Stage, bad_loss

# torch 2.13 renamed the tensor collectives `*_single` (the old names warn, eagerly); a
# GPU image may predate that.
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


class Axes(NamedTuple):
    """Where an entry's collectives run: `group` of `rows` ranks gathers and reduces
    (the shard axis; the world's at stage 0), this rank its row `me`; `across` (None: no
    other) sums a reduced shard over the `across_rows` replicas, this rank's group its
    row `across_me` there; a gradient is the mean over `ranks` (every rank's).
    `gloo`: `group` carries the step's tensors on gloo (reductions as all-to-alls).
    `quant`: ZeRO++'s int8 traffic, if any (`sharded_step(quantize=...)`)."""

    group: Any
    rows: int
    across: Any
    ranks: int
    gloo: bool = False
    me: int = 0
    across_rows: int = 1
    across_me: int = 0
    quant: QuantizedComm | None = None

    @property
    def qw(self) -> int | None:
        """qwZ's block: the gathers' (None: they travel as they are)."""
        return self.quant.block if self.quant is not None and self.quant.weights else None

    @property
    def qg(self) -> int | None:
        """qgZ's block: the reductions' (None: they travel as they are)."""
        return self.quant.block if self.quant is not None and self.quant.grads else None


def entry_axes(mesh: Mesh, stage: Stage, quant: QuantizedComm | None = None) -> Axes:
    """Where a compiled step's entries communicate: at stage 0 the world all-reduces;
    otherwise the shard axis gathers and reduce-scatters, and on a 2-D mesh the replicas
    sum the reduced shards. A gradient is the mean over every rank."""
    world = torch.distributed.group.WORLD
    if not (stage.shards_optimizer or stage.shards_params):
        group = mesh.world.group
        return Axes(world if group is None else group, mesh.size, None, mesh.size)
    shard = world if mesh.shard.group is None else mesh.shard.group
    across = mesh.replica.group if mesh.replicas > 1 else None
    # Decided here, outside the trace: dynamo cannot call into a process group. Measured
    # on the CPU only: a CUDA mesh on gloo (staged through the host) keeps the
    # reduce-scatter.
    gloo = mesh.device.type == "cpu" and backend_for(shard, mesh.device) == "gloo"
    return Axes(
        shard, mesh.shard_size, across, mesh.size, gloo,
        mesh.shard_rank, mesh.replicas, mesh.replica_rank, quant,
    )  # fmt: skip


class Hpz(NamedTuple):
    """hpZ's two gathers of a resharded unit (`reshard_after_forward=k`): `peers`, the
    ranks at this rank's place in every group of k (the only gather crossing groups),
    then `within`, its group of k: the backward's recompute is that second gather
    alone, from the rows the first gave (`peer_gather`, `group_gather`)."""

    peers: Axes
    within: Axes

    @property
    def kept(self) -> int:
        """How many tensors the first gather gives: its table, or qwZ's codes and scales."""
        return 1 if self.peers.qw is None else 2


def hpz_axes(mesh: Mesh, k: int | bool, axes: Axes) -> Hpz | None:
    """A stage-3 step's hpZ axes for groups of `k` (`reshard_after_forward`; None where
    it is a bool), made collectively on first use (`Mesh.secondary_peers`)."""
    if isinstance(k, bool):
        return None
    world = torch.distributed.group.WORLD
    peers, within = mesh.secondary_peers(k), mesh.secondary(k)
    return Hpz(
        Axes(world if peers.group is None else peers.group, peers.size, None, axes.ranks,
             axes.gloo, peers.rank, quant=axes.quant),
        Axes(world if within.group is None else within.group, within.size, None, axes.ranks,
             axes.gloo, within.rank),
    )  # fmt: skip


def peer_gather(flat: torch.Tensor, hpz: Hpz) -> tuple[torch.Tensor, ...]:
    """hpZ's first gather: every peer's 1-D `flat` (`Hpz.peers`), as the table
    `(groups, n)`, or with qwZ as the int8 codes and float32 scales of its blocks,
    gathered as they are (each rank's values quantized once, as a gather along the whole
    axis quantizes them); 1/k of the unit, what the backward keeps of it."""
    p = hpz.peers
    if p.qw is None:
        return (gather_rows(flat, p),)
    return _gathered_codes(flat, p.group, p.rows, p.qw)


def group_gather(kept: tuple[torch.Tensor, ...], hpz: Hpz, dtype: torch.dtype) -> torch.Tensor:
    """hpZ's second gather: `peer_gather`'s rows of every rank of the group of k
    (`Hpz.within`, as they are: qwZ's blocks still int8, then dequantized to `dtype`),
    as `(k, groups, n)`, where `[m, h]` is the row of the shard axis's rank h * k + m."""
    w, groups = hpz.within, kept[0].shape[0]
    if w.rows == 1:
        # No peer: the rows themselves, copied where they would come out as they are
        # (an entry's output must not be a view of what went in).
        got = list(kept) if len(kept) == 2 else [kept[0].clone()]
    else:
        got = [_all_gather(x.reshape(-1), 0, w.group).view(w.rows * groups, -1) for x in kept]
    table = got[0] if len(got) == 1 else dequantize(got[0], got[1], hpz.peers.qw, dtype)
    return table.view(w.rows, groups, -1)


def all_reduce_sum(flat: torch.Tensor, axes: Axes) -> torch.Tensor:
    """The sum of `flat` over `axes.group` (stage 0's reduction: not quantized)."""
    return fc.all_reduce(flat, "sum", axes.group)


def gather_rows(flat: torch.Tensor, axes: Axes) -> torch.Tensor:
    """Every rank's 1-D `flat` along `axes` (the shard axis; hpZ's peers), as the
    rank-major table `(rows, n)` in `flat`'s dtype; with qwZ as int8 blocks, every rank,
    this one too, taking the dequantized values, as eagerly."""
    if axes.qw is None or not flat.is_floating_point():
        if axes.rows == 1:  # hpZ's peers where a group of k is the whole shard axis
            return flat.view(1, -1)
        return _all_gather(flat, 0, axes.group).view(axes.rows, -1)
    return _gathered_quantized(flat, axes.group, axes.rows, axes.qw)


def _gathered_quantized(flat: torch.Tensor, group: Any, rows: int, block: int) -> torch.Tensor:
    """`flat` of every rank of `group` (`rows` ranks) as int8 blocks of `block` and their
    scales, all-gathered; the rank-major table of the values they stand for."""
    codes, scales = _gathered_codes(flat, group, rows, block)
    return dequantize(codes, scales, block, flat.dtype)


def _gathered_codes(
    flat: torch.Tensor, group: Any, rows: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat`'s int8 codes and float32 scales (`quantize`) of every rank of `group` (`rows`
    ranks; one: this rank's, nothing sent), each as its rank-major table."""
    codes, scales = quantize(flat, block)
    if rows == 1:
        return codes, scales
    codes = _all_gather(codes.reshape(-1), 0, group).view(rows, -1)
    return codes, _all_gather(scales.reshape(-1), 0, group).view(rows, -1)


def reduce_rows(table: torch.Tensor, axes: Axes) -> torch.Tensor:
    """This rank's slice of the sum over the shard axis of every rank's `table` (row r:
    its part of rank r's slice), then summed across the replicas, in `table`'s dtype."""
    mine = _scatter_sum(table, axes.group, axes.rows, axes.me, axes)
    if axes.across is None:
        return mine
    if axes.qg is None:
        return fc.all_reduce(mine, "sum", axes.across)
    # qgZ across the groups, as the eager engine's: a quantized reduce-scatter, then a
    # quantized all-gather whose values every replica (the owner too) takes.
    n, r = mine.numel(), axes.across_rows
    padded = torch.nn.functional.pad(mine, (0, -n % r)) if n % r else mine
    part = _scatter_sum(padded.view(r, -1), axes.across, r, axes.across_me, axes)
    return _gathered_quantized(part, axes.across, r, axes.qg).reshape(-1)[:n]


def _scatter_sum(table: torch.Tensor, group: Any, rows: int, me: int, axes: Axes) -> torch.Tensor:
    """Row r of `table` (`rows` rows) reduced to rank r of `group`: this rank's slice."""
    if rows == 1:
        return table.reshape(-1)
    if axes.qg is not None:
        # qgZ: row r travels to rank r as int8 blocks (an all-to-all of the codes and one
        # of the scales), which sums what arrives in float32 (float64 for float64), in
        # rank order, its own row exact: the eager engine's `_reduce_scatter_quantized`.
        codes, scales = quantize(table, axes.qg)
        codes = fc.all_to_all_single(codes.reshape(-1), None, None, group).view(codes.shape)
        scales = fc.all_to_all_single(scales.reshape(-1), None, None, group).view(scales.shape)
        acc = torch.promote_types(torch.float32, table.dtype)
        vals = dequantize(codes, scales, axes.qg, acc)
        vals = torch.cat([vals[:me], table[me : me + 1].to(acc), vals[me + 1 :]])
        return vals.sum(0).to(table.dtype)
    # Not `nbytes`: a loss in pieces shared by steps of other widths may trace the
    # table with symbolic sizes, whose product (a guard) dynamo takes and `nbytes` not.
    if axes.gloo and table.numel() * table.element_size() <= ALL_TO_ALL_MAX_BYTES:
        # Gloo's reduce-scatter is an all-reduce underneath: twice the bytes, and on the
        # CPU its time is the cores' the backward computes on. An all-to-all moves the
        # reduce-scatter's volume; rank r receives every rank's row r and sums them left
        # to right, as the eager engine's gloo path does ([Note: gloo's paths]). Its
        # receive buffer is the burst's size, hence the eager path's bound on it.
        got = fc.all_to_all_single(table.reshape(-1), None, None, group).view(rows, -1)
        mine = got[0]
        for row in got[1:]:
            mine = mine + row
        return mine
    return _reduce_scatter(table.reshape(-1), "sum", 0, group)


def sent_finite(
    sent: list[tuple[tuple[str, ...], torch.Tensor]],
    axes: Axes,
    layout: ShardLayout,
    run: list[int],
    out: tuple[torch.Tensor, ...],
) -> None:
    """With qwZ, whether the gathered `out` of `run` arrived finite, with its units, for
    after the forward (`check_sent`): int8 blocks cannot carry inf or NaN, which arrive
    as NaN, and the eager engine raises for them where a gather lands."""
    if axes.qw is None:
        return
    units = tuple(dict.fromkeys(layout.buckets[i].unit for i in run))
    sent.append((units, torch.stack([torch.isfinite(x).all() for x in out]).all()))


def check_sent(sent: Any, rank: int) -> None:
    """A bad-loss ValueError (raised on every rank by the step's check) where a qwZ gather
    of `sent` (`sent_finite`'s pairs) arrived with inf or NaN: every rank gathered the
    same blocks, so every rank finds it."""
    if not sent:
        return
    finite = torch.stack([ok for _, ok in sent]).tolist()  # one host sync, not one a gather
    bad = [u for (units, _), good in zip(sent, finite) if not good for u in units]
    if bad:
        raise bad_loss(
            ValueError(
                f"rank {rank}: the parameters of unit(s) {', '.join(map(repr, bad))}: "
                "quantized communication (QuantizedComm) met inf or NaN in the values sent; "
                "int8 blocks cannot carry them. Find the overflow, or turn it off"
            )
        )
