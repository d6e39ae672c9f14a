"""A model's construction as recorded aten operations, replayed one tensor at a time, bitwise.

A `Recording` (filled by `_construction.record`, which builds the model on fake tensors)
holds every aten operation the construction made: what it reads, what it writes, and
which ones draw random numbers. Whatever the model does
while it is built (`reset_parameters`, `nn.Parameter(torch.randn(...))` in `__init__`,
buffers computed there, a parent re-initializing its children, Hugging Face's
`post_init`) is in the record, because it is recorded below Python.

`Recording.replay(tids, snapshots)` then makes one tensor's final value: walking back from
the tensor, it keeps the operations its value depends on (stopping at the last one that
overwrote it whole, such as `post_init`'s `normal_` after `__init__`'s `kaiming_uniform_`)
and runs them for real, with the generator set, before each random draw, to the state an
eager construction had there (`Recording.snapshots`: the construction's draws made again,
in order, on scratch tensors of the same shapes). Only that tensor and what it is computed
from exist at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

# Operations that write every element of their first argument without reading it: after
# one of them covers a storage whole, nothing before it matters to that storage's value.
_OVERWRITES = {
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_",
    "exponential_", "geometric_", "log_normal_", "cauchy_",
}  # fmt: skip
_EMPTY = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_RANDOM = torch.Tag.nondeterministic_seeded


@dataclasses.dataclass(frozen=True)
class _Meta:
    """Where a recorded tensor lives: its storage (by identity) and its view of it."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # the storage's


@dataclasses.dataclass
class _Node:
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    outs: tuple[int | None, ...]  # tensor ids of the outputs, None for other values
    reads: frozenset[int]  # storages
    writes: frozenset[int]  # storages, those created included
    kills: frozenset[int]  # storages whose earlier values this node makes irrelevant
    random: bool
    scratch: tuple  # for a random node: (size, stride, dtype) of each written argument
    dtype: torch.dtype  # the default dtype it ran under (a factory without dtype= uses it)


class _Ref:
    """A recorded tensor inside a node's arguments."""

    __slots__ = ("tid",)

    def __init__(self, tid: int):
        self.tid = tid


class Recording:
    """The operations of one construction, and the recorded tensors they touch."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.snapshots: dict[int, torch.Tensor] = {}  # random node -> its generator's state
        self.seed_bound = False  # whether the construction depends on the recorded seed
        self.nodes: list[_Node] = []
        self.metas: list[_Meta] = []
        self.constants: dict[int, torch.Tensor] = {}  # tid -> a real tensor given from outside
        self._ids: dict[int, int] = {}  # id(fake tensor) -> tid
        self._keep: list[torch.Tensor] = []  # the fakes, so that no id or storage is reused
        self._writers: dict[int, list[int]] = {}  # storage -> indices of nodes writing it
        self._storages: set[int] = set()

    # -- recording -----------------------------------------------------------------------

    def tid(self, t: torch.Tensor) -> int:
        """The id of `t` in this recording, registering it the first time it is seen, and
        again once it has changed (`param.data = ...`, as `Module.to` does, swaps a
        tensor's storage outside any operation)."""
        storage = t.untyped_storage()
        meta = _Meta(
            storage._cdata,
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
            storage.nbytes(),
        )
        i = self._ids.get(id(t))
        if i is not None and self.metas[i] == meta:
            return i
        i = len(self.metas)
        if not isinstance(t, torch._subclasses.fake_tensor.FakeTensor):
            with _disable_current_modes():
                self.constants[i] = t.detach().clone()
        self._storages.add(meta.storage)
        self.metas.append(meta)
        self._ids[id(t)] = i
        self._keep.append(t)
        return i

    def before(self, func: Any, args: tuple, kwargs: dict) -> _Node:
        """The node of `func(*args, **kwargs)` as its arguments are before it runs (an
        in-place `unsqueeze_` or `t_` changes them), its outputs still unknown."""
        written = written_by(func, args, kwargs)
        ref = lambda x: _Ref(self.tid(x)) if isinstance(x, torch.Tensor) else x  # noqa: E731
        args_r, kwargs_r = pytree.tree_map(ref, (args, kwargs))
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        name = func.__name__.split(".")[0]
        overwrite = name in _OVERWRITES and bool(written) and written[0] is tensors[0]
        reads = {self.metas[self.tid(x)].storage for x in tensors[int(overwrite) :]}
        writes = {self.metas[self.tid(x)].storage for x in written}
        kills = (
            {self.metas[self.tid(written[0])].storage}
            if overwrite and _covers(written[0])
            else set()
        )
        scratch = tuple((tuple(w.shape), tuple(w.stride()), w.dtype) for w in written)
        return _Node(
            func, args_r, kwargs_r, (), frozenset(reads), frozenset(writes), frozenset(kills),
            _RANDOM in func.tags, scratch, torch.get_default_dtype(),
        )  # fmt: skip

    def add(self, node: _Node, out: Any) -> None:
        """Records `node` (from `before`) with the outputs it made."""
        leaves = pytree.tree_leaves(out)
        created = {  # outputs on storages nothing before made: this node makes them
            o.untyped_storage()._cdata
            for o in leaves
            if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in self._storages
        }
        node.outs = tuple(self.tid(o) if isinstance(o, torch.Tensor) else None for o in leaves)
        node.writes, node.kills = node.writes | created, node.kills | created
        for s in node.writes:
            self._writers.setdefault(s, []).append(len(self.nodes))
        self.nodes.append(node)

    # -- replaying -----------------------------------------------------------------------

    def needed(self, tids: list[int], upto: int | None = None) -> list[int]:
        """Indices of the nodes (before `upto`) that the values of `tids` depend on: for
        each storage, its writers back to the last one that made it whole, and what those
        read, as of when they ran."""
        upto = len(self.nodes) if upto is None else upto
        keep: set[int] = set()
        walked: dict[int, set[int]] = {}  # storage -> its writers visited already
        todo = [(self.metas[t].storage, upto) for t in tids if t not in self.constants]
        while todo:
            storage, before = todo.pop()
            seen = walked.setdefault(storage, set())
            for i in reversed(self._writers.get(storage, ())):
                if i >= before:
                    continue
                if i in seen:  # a walk from later passed here and went on to a kill
                    break
                seen.add(i)
                keep.add(i)
                todo.extend((s, i) for s in self.nodes[i].reads)
                if storage in self.nodes[i].kills:
                    break
        return sorted(keep)

    def draw(self, i: int) -> None:
        """Makes random node `i`'s draw on scratch tensors of its shapes, after noting the
        generator's state, so the generator moves on exactly as the eager construction's
        did. Parameters of the draw that are tensors (bernoulli's p) are made for real."""
        node = self.nodes[i]
        gen = node.kwargs.get("generator") or torch.random.default_generator
        self.snapshots[i] = gen.get_state()
        env: dict[int, torch.Tensor] = {}
        for r, (size, stride, dtype) in zip(_written_refs(node), node.scratch):
            env[r.tid] = torch.empty_strided(size, stride, dtype=dtype)
        others = [r.tid for r in _refs(node) if r.tid not in env]
        if others:
            env.update(self.replay(others, upto=i))
        self._run(node, env)

    def reseeded(self, seed: int, upto: int) -> dict[int, torch.Tensor]:
        """The generator states before the random nodes under `upto` when the construction
        starts from `seed` instead of the recorded seed (its draws made again in order)."""
        if seed == self.seed:
            return self.snapshots
        if self.seed_bound:
            raise ValueError(
                f"fzero.init.from_module: the model's construction was recorded with seed "
                f"{self.seed} and depends on it (it reads random values, e.g. trunc_normal_'s "
                "rejection loop, or seeds a generator itself): pass seed="
                f"{seed} to fzero.init.deferred, or seed={self.seed} here"
            )
        recorded, self.snapshots = self.snapshots, {}
        try:
            with seeded(seed), _generators_kept(self):
                for i in range(upto):
                    if self.nodes[i].random and self.nodes[i].kwargs.get("generator") is None:
                        self.draw(i)
                    elif self.nodes[i].random:
                        self.snapshots[i] = recorded[i]
            return self.snapshots
        finally:
            self.snapshots = recorded

    def replay(
        self,
        tids: list[int],
        snapshots: dict[int, torch.Tensor] | None = None,
        upto: int | None = None,
    ) -> dict[int, torch.Tensor]:
        """The values of `tids` (as of node `upto`, default: the end), made for real on the
        CPU, each random draw from the generator state in `snapshots` (default: those of
        the recording's seed). Generators are left where they were."""
        snapshots = self.snapshots if snapshots is None else snapshots
        env: dict[int, torch.Tensor] = {}
        storages: dict[int, torch.Tensor] = {}
        with _generators_kept(self), torch.no_grad():
            for i in self.needed(tids, upto):
                self._replay_node(i, env, storages, snapshots)
        return {t: self._materialize(t, storages) if t not in env else env[t] for t in tids}

    def _replay_node(self, i: int, env: dict, storages: dict, snapshots: dict) -> None:
        node = self.nodes[i]
        if node.random:
            gen = node.kwargs.get("generator") or torch.random.default_generator
            gen.set_state(snapshots[i])
        for r in _refs(node):
            if r.tid not in env:
                env[r.tid] = self._materialize(r.tid, storages)
        outs = self._run(node, env)
        for tid, value in zip(node.outs, outs):
            if tid is None:
                continue
            meta = self.metas[tid]
            if meta.storage not in storages:
                if tuple(value.stride()) != meta.stride and value.numel() > 1:
                    raise RuntimeError(
                        f"fzero.init: replaying {node.func} made strides "
                        f"{tuple(value.stride())}, recorded {meta.stride}"
                    )
                storages[meta.storage] = value
                if _is_empty(node.func) and value.is_floating_point():
                    value.fill_(float("nan"))  # unwritten memory shows as NaN
            env[tid] = value

    def _materialize(self, tid: int, storages: dict[int, torch.Tensor]) -> torch.Tensor:
        if tid in self.constants:
            return self.constants[tid].clone()
        meta = self.metas[tid]
        base = storages.get(meta.storage)
        if base is None:  # made by a node that a later one overwrote whole: memory is enough
            base = storages[meta.storage] = torch.empty(meta.nbytes, dtype=torch.uint8)
        return torch.empty(0, dtype=meta.dtype).set_(
            base.untyped_storage(), meta.offset, meta.size, meta.stride
        )

    def _run(self, node: _Node, env: dict[int, torch.Tensor]) -> list[Any]:
        real = lambda x: env[x.tid] if isinstance(x, _Ref) else x  # noqa: E731
        args, kwargs = pytree.tree_map(real, (node.args, node.kwargs))
        with torch.no_grad(), _default_dtype(node.dtype):
            out = node.func(*args, **kwargs)
        return list(pytree.tree_leaves(out))


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """The default generators (the CPU's, and `device`'s if CUDA) seeded with `seed`, as
    `torch.manual_seed` would, and restored afterwards: the caller's RNG is untouched."""
    devices = [device] if device is not None and device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        for d in devices:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(seed)
        yield


@contextlib.contextmanager
def _generators_kept(rec: Recording) -> Iterator[None]:
    """The default generator and those the construction drew from, restored on exit."""
    gens = {id(g): g for i in rec.snapshots if (g := rec.nodes[i].kwargs.get("generator"))}
    states = [(g, g.get_state()) for g in gens.values()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for g, state in states:
            g.set_state(state)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    if dtype is before:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def written_by(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors `func` writes in place, by its schema's alias annotations."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        out.extend(x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor))
    return out


def _written_refs(node: _Node) -> list[_Ref]:
    out = []
    for i, a in enumerate(node.func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
        out.extend(x for x in pytree.tree_leaves(v) if isinstance(x, _Ref))
    return out


def _refs(node: _Node) -> Iterator[_Ref]:
    for x in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(x, _Ref):
            yield x


def _is_empty(func: Any) -> bool:
    """Whether `func` allocates without writing (what it makes is garbage until written)."""
    return func.__name__.split(".")[0] in _EMPTY


def _covers(t: torch.Tensor) -> bool:
    """Whether `t` is its whole storage, each element once."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    expected = 1  # dense: the strides, smallest first, are the running products of sizes
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
