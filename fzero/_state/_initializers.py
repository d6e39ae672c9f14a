"""Deferred initialization: values made a module or a leaf at a time, each rank keeping its part.

`shard_state(..., init=)` asks an `Init` to fill element ranges of leaves (`Wants`): the
ranges of every flat bucket that this rank holds (its slice at stage 3, everything at
stages 0-2) and the buffers. Generators (`ModuleInit`, `LeafInit`) make one full leaf
at a time, copy out the ranges wanted and let it go; `FileInit` reads only the ranges.
No rank ever holds the whole model, and no rank needs another's values.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._core import as_bytes, open_tensors
from ._construction import recorded_at
from ._file_names import check_unread, match_names
from ._record import seeded

# leaf path -> [(lo, hi, out)]: elements [lo, hi) of the flattened leaf go into `out`.
Wants = dict[str, list[tuple[int, int, torch.Tensor]]]


class Init(abc.ABC):
    """Makes or reads parameter and buffer values for `shard_state(..., init=)`."""

    device: torch.device

    @abc.abstractmethod
    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        """Fills every range in `wants`; checks it can make every leaf of `likes` (meta
        tensors: paths, shapes, dtypes). Returns digests that every rank must agree on."""

    def holds(self, paths: list[str]) -> set[str]:
        """Those of `paths` this init reads from a source rather than makes: none."""
        return set()


def deliver(path: str, value: torch.Tensor, wants: Wants, like: torch.Tensor, what: str) -> None:
    """Copies the wanted ranges of the full leaf `value` (checked against `like`)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: leaf {path!r} came back as a {type(value).__name__}")
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"{what}: leaf {path!r} came back with shape {tuple(value.shape)}, the "
            f"parameters have {tuple(like.shape)}"
        )
    flat = value.detach().reshape(-1)
    for lo, hi, out in wants.get(path, ()):
        out.copy_(flat[lo:hi])


def digest(value: torch.Tensor) -> str:
    return hashlib.blake2b(as_bytes(value.detach().cpu().contiguous()), digest_size=8).hexdigest()


def _leaf_seed(seed: int, path: str) -> int:
    """A seed for `path` alone: values do not depend on which other leaves exist."""
    raw = hashlib.blake2b(f"{seed}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & (2**63 - 1)


class LeafInit(Init):
    """`fn(path, like) -> Tensor` per leaf, with the generators seeded from (seed, path)."""

    def __init__(self, fn: Callable[[str, torch.Tensor], torch.Tensor], seed: int, device: Any):
        if not callable(fn):
            raise TypeError(f"fzero.init.by_leaf needs a function (path, like), got {fn!r}")
        self.fn, self.seed, self.device = fn, int(seed), torch.device(device)

    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        out = {}
        for path, like in likes.items():
            with seeded(_leaf_seed(self.seed, path), self.device), torch.no_grad():
                value = self.fn(path, like)
            deliver(path, value, wants, like, "fzero.init.by_leaf")
            out[path] = digest(value)
        return out


class RecordedInit(Init):
    """Replays a recorded construction (`fzero.init.deferred`) one leaf at a time."""

    def __init__(self, module: nn.Module, seed: int | None, device: Any):
        self.module, self.seed, self.device = module, seed, torch.device(device)

    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        named = dict(self.module.named_parameters(remove_duplicate=False))
        named.update(self.module.named_buffers(remove_duplicate=False))
        targets = {}
        for path in likes:
            t = named.get(path)
            found = None if t is None else recorded_at(self.module, path, t)
            if found is None and t is not None and t.device.type != "meta":
                raise ValueError(
                    f"fzero.init.from_module: {path!r} is on {t.device}, no longer the meta "
                    "tensor fzero.init.deferred made: the model was materialized since "
                    "(to_empty, load_state_dict(assign=True)). Pass its values as params "
                    "without init=, or give from_module the model as deferred returned it"
                )
            if found is None:
                raise ValueError(
                    f"fzero.init.from_module: the module has no recorded parameter or buffer "
                    f"{path!r}: pass the module's own dict(model.named_parameters()) / "
                    "named_buffers(), as fzero.init.deferred built them. If the model was "
                    "changed after deferred returned it (resize_token_embeddings, a new "
                    "head), its construction has no record of the new tensor: make the "
                    "change inside the function given to deferred"
                )
            targets[path] = found
        recordings = {id(rec): rec for rec, _ in targets.values()}
        if len(recordings) > 1:
            raise ValueError("fzero.init.from_module: the leaves come from several constructions")
        out: dict[str, str] = {}
        if not targets:
            return out
        rec = next(iter(recordings.values()))
        needed = rec.needed([tid for _, tid in targets.values()])
        last = max((i for i in needed if rec.nodes[i].random), default=-1)
        seed = rec.seed if self.seed is None else self.seed
        snapshots = rec.reseeded(seed, upto=last + 1)  # the draws up to the last one needed
        for path, (_, tid) in targets.items():
            value = rec.replay([tid], snapshots)[tid]
            if value.is_floating_point() and value.numel() and bool(value.isnan().any()):
                raise ValueError(
                    f"fzero.init.from_module: the model's construction leaves {path!r} "
                    "(partly) unwritten (torch.empty never filled) or NaN: eager "
                    "construction would give uninitialised memory there"
                )
            deliver(path, value, wants, likes[path], "fzero.init.from_module")
            out[path] = digest(value)
        return out


class ValuesInit(Init):
    """A module built with values (eagerly): its own tensors, the ranges each rank keeps."""

    def __init__(self, module: nn.Module, device: Any):
        self.module, self.device = module, torch.device(device)

    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        named = dict(self.module.named_parameters(remove_duplicate=False))
        named.update(self.module.named_buffers(remove_duplicate=False))
        out = {}
        for path, like in likes.items():
            if path not in named:
                raise ValueError(
                    f"fzero.init.from_module: the module has no parameter or buffer {path!r}:"
                    " pass the module's own dict(model.named_parameters()) / named_buffers()"
                )
            if named[path].is_meta:  # a buffer left on meta beside parameters with values
                raise ValueError(
                    f"fzero.init.from_module: the module's {path!r} is on the meta device, "
                    "without values, beside parameters with values"
                )
            deliver(path, named[path], wants, like, "fzero.init.from_module")
            out[path] = digest(named[path])
        return out


class ModuleInit(Init):
    """Replays a module's construction: `reset_parameters` of every submodule owning
    tensors directly, children before parents, from one seed."""

    def __init__(self, module: nn.Module, seed: int, device: Any, init: dict[Any, Callable]):
        if not isinstance(module, nn.Module):
            raise TypeError(f"fzero.init.from_module needs an nn.Module, got {type(module)}")
        self.module, self.seed, self.device = module, int(seed), torch.device(device)
        self.init = dict(init or {})

    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        # A tied tensor belongs to the first module that names it (as in named_parameters);
        # other holders' resets run on scratch copies, as they ran on their own tensors
        # before the tie in an eager construction.
        owner = {id(t): n for n, t in self.module.named_parameters()}
        owner.update({id(t): n for n, t in self.module.named_buffers()})
        out: dict[str, str] = {}
        with seeded(self.seed, self.device), torch.no_grad():
            for prefix, m in _post_order(self.module):
                own = [*m._parameters.items(), *m._buffers.items()]
                if not any(owner.get(id(t)) in likes for _, t in own if t is not None):
                    # Nothing of it is asked for (from_file's missing=: it is in the file).
                    # Its init still runs, on scratch tensors, so that later modules draw
                    # what they drew in the eager construction; torch's private
                    # `_reset_parameters` too (MultiheadAttention's xavier draws). A module
                    # with neither is taken to draw nothing (a norm's ones).
                    if self._has_init(prefix, m, private=True):
                        with contextlib.suppress(ValueError):  # its values are not used
                            for _ in self._replay(prefix, m, private=True):
                                pass
                    continue
                for name, orig, value in self._replay(prefix, m):
                    full = f"{prefix}.{name}" if prefix else name
                    if owner.get(id(orig)) != full or full not in likes:
                        continue
                    deliver(full, value, wants, likes[full], "fzero.init.from_module")
                    out[full] = digest(value)
        missing = [p for p in likes if p not in out]
        if missing:
            raise ValueError(
                f"fzero.init.from_module: the module has no parameter or buffer {missing[0]!r}"
                f" ({len(missing)} leaves missing): pass the module's own "
                "dict(model.named_parameters()) / named_buffers()"
            )
        return out

    def _replay(
        self, prefix: str, m: nn.Module, private: bool = False
    ) -> Iterator[tuple[str, torch.Tensor, Any]]:
        """Materializes `m`'s own tensors, runs its init (`private`: torch's
        `_reset_parameters` too, for its draws alone), yields (name, original, value), and
        puts the originals (meta tensors) back."""
        own = [("p", n, t) for n, t in m._parameters.items() if t is not None]
        own += [("b", n, t) for n, t in m._buffers.items() if t is not None]
        if not own:
            return
        fn = self._init_of(prefix, m, [n for _, n, _ in own], private)
        fresh = {}
        for kind, name, t in own:
            x = _poisoned(torch.empty(t.shape, dtype=t.dtype, device=self.device))
            if kind == "p":
                x = nn.Parameter(x, requires_grad=t.requires_grad)
            (m._parameters if kind == "p" else m._buffers)[name] = x
            fresh[name] = (x, x._version)
        try:
            fn(m)
            values = [(k, n, t, (m._parameters if k == "p" else m._buffers)[n]) for k, n, t in own]
        finally:
            for kind, name, t in own:
                (m._parameters if kind == "p" else m._buffers)[name] = t
        for _, name, orig, value in values:
            made, version = fresh[name]
            if value is made and value._version == version:
                raise ValueError(
                    f"fzero.init.from_module: module {prefix or '<root>'!r} "
                    f"({type(m).__name__}): its init left {name!r} unwritten, so it would "
                    "hold uninitialised memory; fill it there (reset_parameters) or pass "
                    f"init={{{prefix or type(m).__name__!r}: fn}}"
                )
            if value is made:
                _check_written(value, prefix, m, name)
            yield name, orig, value

    def _has_init(self, prefix: str, m: nn.Module, private: bool = False) -> bool:
        return (
            prefix in self.init
            or any(cls in self.init for cls in type(m).__mro__)
            or callable(getattr(m, "reset_parameters", None))
            or (private and callable(getattr(m, "_reset_parameters", None)))
        )

    def _init_of(
        self, prefix: str, m: nn.Module, names: list[str], private: bool = False
    ) -> Callable[[nn.Module], Any]:
        if prefix in self.init:
            return self.init[prefix]
        for cls in type(m).__mro__:
            if cls in self.init:
                return self.init[cls]
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            return lambda module: module.reset_parameters()
        # Not where its values are used: MultiheadAttention's also writes its child's bias,
        # which a replay of the parent alone cannot reach.
        if private and callable(getattr(m, "_reset_parameters", None)):
            return lambda module: module._reset_parameters()
        raise ValueError(
            f"fzero.init.from_module: module {prefix or '<root>'!r} ({type(m).__name__}) owns "
            f"{names} but has no reset_parameters(); define one that fills every tensor "
            f"the module owns directly, or pass init={{{prefix or type(m).__name__!r}: fn}} "
            "(fn(module) fills them in place)"
        )


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    """`x` filled with NaN where it is floating, which no init writes, so that what an
    init leaves unwritten shows afterwards (`_check_written`). Integer and bool tensors
    have no such value (0 and -128 are a mask's and a quantized weight's): they are
    checked only for being written at all (their version)."""
    return x.fill_(float("nan")) if x.is_floating_point() or x.is_complex() else x


def _check_written(value: torch.Tensor, prefix: str, m: nn.Module, name: str) -> None:
    """Raises naming the module and tensor if its init left part of it as poisoned."""
    if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
        return
    count = int(torch.isnan(value).sum())
    if count:
        raise ValueError(
            f"fzero.init.from_module: module {prefix or '<root>'!r} ({type(m).__name__}): its "
            f"init left {count} of the {value.numel()} elements of {name!r} unwritten (or "
            "wrote NaN), which would hold uninitialised memory; fill all of it there "
            f"(reset_parameters) or pass init={{{prefix or type(m).__name__!r}: fn}}"
        )


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    seen: set[int] = set()

    def visit(m: nn.Module, name: str) -> Iterator[tuple[str, nn.Module]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child_name, child in m._modules.items():
            if child is not None:
                yield from visit(child, f"{name}.{child_name}" if name else child_name)
        yield name, m

    yield from visit(module, prefix)


class FileInit(Init):
    """Reads each rank's ranges from a safetensors or torch.save file, or from the files
    of an index (a sharded checkpoint), or a directory holding either."""

    def __init__(self, path: str, key: Callable[[str], str | None] | None, missing: Init | None):
        self.path, self.key, self.missing = path, key or (lambda p: p), missing
        self.device = torch.device("cpu") if missing is None else missing.device

    def holds(self, paths: list[str]) -> set[str]:
        """Those of `paths` the file holds, named as `fill` names them."""
        f = open_tensors(self.path)
        try:
            return set(match_names({p: self.key(p) for p in paths}, f.entries))
        finally:
            f.close()

    def fill(self, wants: Wants, likes: dict[str, torch.Tensor]) -> dict[str, str]:
        f = open_tensors(self.path)
        try:
            names = {path: self.key(path) for path in likes}
            found = match_names(names, f.entries)
            names.update(found)
            absent = [p for p in likes if p not in found]
            read = set(found.values())
            unread = {n: e.shape for n, e in f.entries.items() if n not in read}
            for path, like in likes.items():
                if path not in found:
                    continue
                name = found[path]
                e = f.entries[name]
                if e.shape != tuple(like.shape):
                    raise ValueError(
                        f"fzero.init.from_file: {self.path} holds {name!r} with shape "
                        f"{e.shape}, the parameters have {tuple(like.shape)}"
                    )
                for lo, hi, out in wants.get(path, ()):
                    f.read(name, lo, hi, out)
            out = {"<file>": f.digest()}
        finally:
            f.close()
        if absent and self.missing is None and names[absent[0]] is None:
            raise ValueError(
                f"fzero.init.from_file: key= says {self.path} does not hold {absent[0]!r} "
                f"({len(absent)} leaves so, or missing): pass missing= to make them"
            )
        if absent and self.missing is None:
            some = sorted(unread or f.entries)[:3]
            held = f"{len(unread)} tensors no leaf read, e.g." if unread else "e.g."
            raise ValueError(
                f"fzero.init.from_file: {self.path} has no tensor "
                f"{names[absent[0]] or absent[0]!r} "
                f"({len(absent)} leaves missing; it holds {held} {some}); pass key= to map "
                "leaf paths to its names, or missing= to initialise what it lacks"
            )
        check_unread(self.path, {p: tuple(likes[p].shape) for p in absent}, unread, names)
        if absent:
            assert self.missing is not None
            sub = {p: wants[p] for p in absent if p in wants}
            out.update(self.missing.fill(sub, {p: likes[p] for p in absent}))
        return out
