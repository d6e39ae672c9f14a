"""ShardLayout: which rank owns which elements of every parameter.

Leaves are packed, per dtype, into flat buckets of `world_size * shard_numel` elements;
rank r owns elements `[r * shard_numel, (r + 1) * shard_numel)` of every bucket. Two
packings share that one mechanism, so gather and reduce-scatter never care which is used:

- "flat" (default): leaves back to back, zero padding (< world_size elements) at the end.
  Leaves may straddle ranks, so the optimizer sees 1-D slices: exact for pointwise
  optimizers (SGD, Adam, ...), not for per-tensor ones (Adafactor factors a 2-D matrix's
  second moment by rows and columns, which a slice of the flattened matrix does not have).
- "tensor": whole tensors, assigned greedily to the least-loaded rank, largest first
  (FairScale OSS); each rank's segment is padded to the largest load. The optimizer sees
  whole tensors in their own shapes, so any optimizer gives exactly the unsharded result.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import optree
import torch

from . import _unitspec as unitspec
from ._flat import Bucket, Slot, cut, pack
from ._leaves import check_leaves
from ._tree import NAMESPACE, PyTree, leaf_paths, tree_flatten, tree_unflatten
from ._unitspec import UnitSpec, spec_of

KINDS = ("flat", "tensor")


@dataclass(frozen=True)
class ShardLayout:
    """How a parameter tree is packed into buckets and split over `world_size` ranks."""

    kind: str
    world_size: int
    treedef: optree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    buckets: tuple[Bucket, ...]
    units: tuple[str, ...] = ("",)  # names (`_unitspec`), the root "" first
    members: tuple[tuple[str, ...], ...] = ((),)  # per unit, its path prefixes

    @property
    def specs(self) -> tuple[UnitSpec, ...]:
        """The `units=` entries this layout was built from (to build it again)."""
        return tuple(spec_of(m) for m in self.members[1:])

    def unit_buckets(self, unit: str) -> tuple[int, ...]:
        """Indices of the buckets of `unit` (one per dtype it holds)."""
        return self._unit_index.get(unit, ())

    @functools.cached_property
    def _unit_index(self) -> dict[str, tuple[int, ...]]:
        # Asked several times per unit per step: computed once per layout.
        out: dict[str, tuple[int, ...]] = {}
        for i, b in enumerate(self.buckets):
            out[b.unit] = (*out.get(b.unit, ()), i)
        return out

    def unit_members(self, unit: str) -> tuple[str, ...]:
        """The path prefixes of `unit` (one, or a group's)."""
        return self._members[unit]

    @functools.cached_property
    def _members(self) -> dict[str, tuple[str, ...]]:
        return dict(zip(self.units, self.members, strict=True))

    def unit_numel(self, unit: str) -> int:
        """Full (padded) elements of `unit` over all its buckets."""
        return sum(self.buckets[i].full_numel for i in self.unit_buckets(unit))

    @property
    def numel(self) -> int:
        """Number of parameters (without padding)."""
        return sum(b.numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns, padding included."""
        return sum(b.shard_numel for b in self.buckets)

    @functools.cached_property
    def frozen(self) -> tuple[bool, ...]:
        """Per leaf, in flatten order: is it frozen?"""
        out = [False] * len(self.paths)
        for b in self.buckets:
            for s in b.slots:
                out[s.index] = b.frozen
        return tuple(out)

    def trainable(self, tree: PyTree) -> PyTree:
        """`tree` with None in place of frozen leaves: what optimizers and gradients see."""
        leaves = self.leaves(tree)
        return tree_unflatten(self.treedef, [None if f else x for x, f in zip(leaves, self.frozen)])

    def merge(self, tree: PyTree, trainable: PyTree) -> PyTree:
        """The leaves of `trainable` where trainable, those of `tree` where frozen."""
        pairs = zip(self.leaves(tree), self.leaves(trainable), self.frozen)
        return tree_unflatten(self.treedef, [old if f else n for old, n, f in pairs])

    def fingerprint(self) -> tuple[Any, ...]:
        """Everything ranks must agree on, as plain picklable values."""
        leaves = tuple(zip(self.paths, self.shapes, map(str, self.dtypes)))
        return (self.kind, self.world_size, str(self.treedef), leaves, self.members, self.frozen)

    def leaves(self, tree: PyTree, what: str = "tree") -> list[Any]:
        """The leaves of `tree` in layout order, after checking its structure.

        `tree` has the parameters' structure, or their trainable structure (None where a
        leaf is frozen, as gradients are); frozen positions then come back as None.
        """
        leaves, treedef = tree_flatten(tree)
        if treedef == self.treedef:
            return leaves
        frozen = self.frozen
        if any(frozen) and len(leaves) == frozen.count(False):
            it = iter(leaves)
            full = [None if f else next(it) for f in frozen]
            if tree_flatten(tree_unflatten(self.treedef, full))[1] == treedef:
                return full
        # A trainable leaf given as None (`autograd.grad(..., allow_unused=True)`): named.
        # Flattened with None as a leaf: a None of the parameters' own tree holds a place.
        given, spec = optree.tree_flatten(tree, none_is_leaf=True, namespace=NAMESPACE)
        like = tree_unflatten(self.treedef, list(range(len(self.paths))))
        index, like_spec = optree.tree_flatten(like, none_is_leaf=True, namespace=NAMESPACE)
        unused = []
        if spec == like_spec:
            unused = [
                self.paths[i]
                for i, x in zip(index, given)
                if i is not None and x is None and not self.frozen[i]
            ]
        if unused:
            raise ValueError(
                f"{what}: leaf {unused[0]!r} is None ({len(unused)} trainable leaves so): a "
                "trainable leaf needs a tensor (torch.zeros_like for a gradient never reached)"
            )
        raise ValueError(f"{what} has structure {treedef}, the layout expects {self.treedef}")

    def flatten(self, tree: PyTree, what: str = "tree") -> tuple[torch.Tensor, ...]:
        """Packs `tree` into fresh full padded flat buffers, one per bucket."""
        leaves = self.leaves(tree, what)
        return tuple(pack(b, leaves, 0, b.full_numel) for b in self.buckets)

    def unflatten(self, flats: Sequence[torch.Tensor]) -> PyTree:
        """The parameter tree whose leaves are views into the full flat buffers `flats`."""
        leaves: list[Any] = [None] * len(self.paths)
        for bucket, flat in zip(self.buckets, flats):
            for slot, view in cut(bucket, flat):
                leaves[slot.index] = view
        return tree_unflatten(self.treedef, leaves)

    def unflatten_unit(self, unit: str, fulls: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Views of `unit`'s leaves, by path, into its full flat buckets `fulls`."""
        return dict(zip(self.unit_paths(unit), self.cut_unit(unit, fulls), strict=True))

    def unit_paths(self, unit: str) -> tuple[str, ...]:
        """`unit`'s leaf paths, in the order `cut_unit` returns their views."""
        return self._unit_paths.get(unit, ())

    @functools.cached_property
    def _unit_paths(self) -> dict[str, tuple[str, ...]]:
        return {
            u: tuple(s.path for i in idx for s in self.buckets[i].ordered)
            for u, idx in self._unit_index.items()
        }

    def unit_leaf_buckets(self, unit: str) -> tuple[int, ...]:
        """The bucket of each of `unit`'s leaves, in `unit_paths` order."""
        return self._unit_leaf_buckets.get(unit, ())

    @functools.cached_property
    def _unit_leaf_buckets(self) -> dict[str, tuple[int, ...]]:
        return {
            u: tuple(i for i in idx for _ in self.buckets[i].slots)
            for u, idx in self._unit_index.items()
        }

    def units_at(self, path: str) -> tuple[str, ...]:
        """The units holding the leaves under the dotted `path` (those inside it, or the
        one it lies in), in layout order."""
        found = self._units_at.get(path)
        if found is None:
            hit = {
                b.unit
                for b in self.buckets
                for s in b.slots
                if s.path == path or s.path.startswith(path + ".")
            }
            found = self._units_at[path] = tuple(u for u in self.units if u in hit)
        return found

    @functools.cached_property
    def _units_at(self) -> dict[str, tuple[str, ...]]:
        return {}  # filled by `units_at`: a loss asks for the same paths every step

    @functools.cached_property
    def path_index(self) -> dict[str, int]:
        """Each leaf path's position in the flattened tree."""
        return {p: i for i, p in enumerate(self.paths)}

    def cut_unit(self, unit: str, fulls: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Views of `unit`'s leaves into its full flat buckets `fulls` (`unit_paths` order)."""
        return [
            view
            for i, full in zip(self.unit_buckets(unit), fulls, strict=True)
            for _, view in cut(self.buckets[i], full)
        ]

    def shard(self, tree: PyTree, rank: int) -> tuple[torch.Tensor, ...]:
        """Rank `rank`'s slice of every bucket of `tree` (a copy; no communication)."""
        leaves = self.leaves(tree)
        return tuple(
            pack(b, leaves, rank * b.shard_numel, (rank + 1) * b.shard_numel) for b in self.buckets
        )

    def pieces(self, shards: Sequence[torch.Tensor], rank: int) -> tuple[torch.Tensor, ...]:
        """What the optimizer updates on `rank`: views into its shard buffers.

        "flat": the shard buffers themselves. "tensor": the owned leaves, in their shapes.
        """
        return tuple(p for k, x in enumerate(shards) for p in self.bucket_pieces(k, x, rank))

    def bucket_pieces(self, k: int, shard: torch.Tensor, rank: int) -> tuple[torch.Tensor, ...]:
        """Bucket k's part of `pieces`, from its shard buffer on `rank` (none if frozen)."""
        bucket = self.buckets[k]
        if bucket.frozen:
            return ()
        if self.kind == "flat":
            return (shard,)
        base = rank * bucket.shard_numel
        return tuple(
            shard[s.offset - base : s.offset - base + s.numel].view(s.shape)
            for s in bucket.slots
            if s.owner == rank
        )

    def piece_paths(self, rank: int) -> tuple[str, ...]:
        """A name for each of `pieces(..., rank)`: a bucket name or the leaf's path."""
        if self.kind == "flat":
            return tuple(
                f"<bucket {i}: {b.unit or 'root'} {b.dtype}>"
                for i, b in enumerate(self.buckets)
                if not b.frozen
            )
        return tuple(
            s.path for b in self.buckets if not b.frozen for s in b.slots if s.owner == rank
        )

    def piece_segments(self, rank: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
        """Per piece of `rank`: (leaf path, first element, end) of each parameter it holds."""
        out = []
        for bucket in self.buckets:
            if bucket.frozen:
                continue
            lo, hi = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
            if self.kind == "tensor":
                out += [((s.path, 0, s.numel),) for s in bucket.slots if s.owner == rank]
                continue
            out.append(
                tuple(
                    (s.path, max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo)
                    for s in bucket.slots
                    if max(s.offset, lo) < min(s.offset + s.numel, hi)
                )
            )
        return tuple(out)

    def from_pieces(
        self, pieces: Sequence[torch.Tensor], rank: int, old: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """Inverse of `pieces`: shard buffers holding the (possibly new) pieces.

        Frozen buckets, which have no pieces, are taken from `old`.
        """
        out, it = [], iter(pieces)
        for bucket, prev in zip(self.buckets, old, strict=True):
            if bucket.frozen:
                out.append(prev)
                continue
            if self.kind == "flat":
                out.append(next(it))
                continue
            owned = [next(it).reshape(-1) for s in bucket.slots if s.owner == rank]
            used = sum(p.numel() for p in owned)
            pad = torch.zeros(bucket.shard_numel - used, dtype=bucket.dtype, device=prev.device)
            out.append(torch.cat([*owned, pad]))
        return tuple(out)


def build_layout(
    params: PyTree,
    world_size: int,
    kind: str = "flat",
    units: Sequence[UnitSpec] | None = None,
    frozen: Sequence[bool] | None = None,
) -> ShardLayout:
    """Computes the layout of `params` over `world_size` ranks.

    Args:
      params: a pytree whose leaves are floating-point tensors, all on one device.
      world_size: number of ranks.
      kind: "flat" or "tensor" (see the module docstring).
      units: parameter-path prefixes, each gathered and reduced as its own buffers, or
        tuples of them, each one unit (FSDP2's `fully_shard([m1, m2])`). A prefix covers
        the paths it matches on whole dotted components ("layers.1" covers "layers.1.w",
        not "layers.10.w"); a leaf belongs to the unit of its longest matching prefix;
        leaves matching none form the root unit "".
      frozen: per leaf (flatten order), whether it is frozen: frozen leaves get buckets of
        their own, which are gathered but never reduced, updated or given optimizer state.

    Returns:
      The ShardLayout; it depends only on the leaves' paths, shapes and dtypes and `units`.
    """
    if kind not in KINDS:
        raise ValueError(f"layout must be one of {KINDS}, got {kind!r}")
    leaves, treedef = tree_flatten(params)
    paths = leaf_paths(params)
    check_leaves(paths, leaves)
    members = unitspec.members_of(units)
    names = unitspec.check(members, paths)
    owners = unitspec.owner_index(members)
    frozen = [False] * len(leaves) if frozen is None else list(frozen)
    if len(frozen) != len(leaves):
        raise ValueError(f"frozen has {len(frozen)} entries for {len(leaves)} leaves")
    bins: dict[tuple[str, bool, torch.dtype], list[int]] = {}
    for i, leaf in enumerate(leaves):
        k = unitspec.owner(paths[i], owners)
        unit = "" if k is None else names[k]
        bins.setdefault((unit, bool(frozen[i]), leaf.dtype), []).append(i)
    place = _place_flat if kind == "flat" else _place_greedy
    order = {u: k for k, u in enumerate(("", *names))}  # root first, then units as given
    buckets = tuple(
        replace(place(dtype, idx, paths, leaves, world_size), unit=unit, frozen=fz)
        for (unit, fz, dtype), idx in sorted(
            bins.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])
        )
    )
    return ShardLayout(
        kind,
        world_size,
        treedef,
        tuple(paths),
        tuple(tuple(x.shape) for x in leaves),
        tuple(x.dtype for x in leaves),
        buckets,
        ("", *names),
        ((), *members),
    )


def _place_flat(
    dtype: torch.dtype, idx: list[int], paths: list[str], leaves: list[Any], n: int
) -> Bucket:
    slots, offset = [], 0
    for i in idx:
        numel = leaves[i].numel()
        slots.append(Slot(i, paths[i], tuple(leaves[i].shape), offset, numel, -1))
        offset += numel
    return Bucket(dtype, tuple(slots), -(-offset // n), n)


def _place_greedy(
    dtype: torch.dtype, idx: list[int], paths: list[str], leaves: list[Any], n: int
) -> Bucket:
    load = [0] * n
    owner: dict[int, int] = {}
    for i in sorted(idx, key=lambda i: -leaves[i].numel()):  # stable: ties keep tree order
        rank = min(range(n), key=lambda r: load[r])
        owner[i] = rank
        load[rank] += leaves[i].numel()
    shard = max(load)
    cursor = [r * shard for r in range(n)]
    slots = []
    for i in idx:  # within a rank's segment, tree order
        r, numel = owner[i], leaves[i].numel()
        slots.append(Slot(i, paths[i], tuple(leaves[i].shape), cursor[r], numel, r))
        cursor[r] += numel
    return Bucket(dtype, tuple(slots), shard, n)
