"""The on-disk format: a tensor file per rank, JSON metadata, an atomically replaced LATEST."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch

from .._core import ShardLayout, TensorFile, fsync_dir, torch_writer
from ._schema import CheckpointError, Entry, Schema, dtype_of, find_os_error

FORMAT = "fzero-checkpoint"
VERSION = 1
META = "metadata.json"
LATEST = "LATEST"
_VERSION_DIR = re.compile(r"v-\d+-[0-9a-f]{12}")

# Test hook: called as `_crash_hook(point, path)` at save's crash points ("rank-file" after
# a rank's file is written but before it is fsynced, "metadata", "commit" just before
# LATEST is replaced). The crash tests make it SIGKILL the process there.
_crash_hook: Callable[[str, str], None] | None = None


def _crash_point(point: str, path: str) -> None:
    if _crash_hook is not None:
        _crash_hook(point, path)


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def start(path: str) -> str:
    """Rank 0: creates `path` if needed and a fresh temporary directory in it; its name."""
    os.makedirs(path, exist_ok=True)
    tmp = f".tmp-{uuid.uuid4().hex[:12]}"
    os.mkdir(os.path.join(path, tmp))
    fsync_dir(path)
    return tmp


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if it is a view: torch.save writes the whole storage a view belongs to.
    A device tensor is copied to the host (its view's bytes only): the files then load on
    any machine, a CPU-only one too."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.cpu()
    whole = t.is_contiguous() and t.storage_offset() == 0
    return t if whole and t.untyped_storage().nbytes() == t.nbytes else t.clone()


def write_tensors(directory: str, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Writes and fsyncs one rank's tensors; returns the file's name, size and SHA-256."""
    path = os.path.join(directory, name)
    try:
        with open(path, "wb") as f:
            torch.save({k: _compact(v) for k, v in tensors.items()}, f)
            f.flush()
            _crash_point("rank-file", path)
            os.fsync(f.fileno())
    except Exception as exc:
        # torch.save reports a full disk as "unexpected pos": the OS error is its context.
        os_error = find_os_error(exc)
        if os_error is None:
            raise
        raise OSError(os_error.errno, os_error.strerror, path) from exc
    return {"name": name, "bytes": os.path.getsize(path), "sha256": sha256(path)}


# One tensor of a streamed rank file: its key, shape and dtype, what makes its values
# when it is written, and what to call after (an offloaded state drops the pages it read).
Streamed = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor], Callable[[], None]]


def write_streamed(directory: str, name: str, entries: list[Streamed]) -> dict[str, Any]:
    """`write_tensors` of the same tensors, made one at a time as they are written: the
    file's skeleton first (torch.save of storage-less tensors), then each tensor's bytes
    at its place. The rank never holds its whole file in memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    path = os.path.join(directory, name)
    with FakeTensorMode():
        fakes = {
            key: torch.empty(shape, dtype=dtype, device="cpu")  # files hold host tensors
            for key, shape, dtype, _, _ in entries
        }
    writer = torch_writer(path, fakes)
    try:
        for key, _, _, make, after in entries:
            writer.write(id(fakes[key]), 0, make())
            after()
        _crash_point("rank-file", writer.tmp)
        writer.commit()
    except BaseException as exc:
        writer.abort()
        os_error = find_os_error(exc)
        if os_error is None or os_error.filename is not None:
            raise
        raise OSError(os_error.errno, os_error.strerror, path) from exc  # name the file
    return {"name": name, "bytes": os.path.getsize(path), "sha256": sha256(path)}


def commit(path: str, tmp: str, body: dict[str, Any]) -> str:
    """Rank 0, once every rank's file is durable: metadata, then the atomic switch.

    The new version is complete on disk before LATEST names it, and LATEST is replaced by
    one rename: a crash at any point leaves LATEST naming a complete checkpoint. Older
    versions and leftovers of interrupted saves are removed only after the switch.
    """
    tmp_dir = os.path.join(path, tmp)
    text = json.dumps(body, sort_keys=True)
    meta = json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": body})
    with open(os.path.join(tmp_dir, META), "w") as f:
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp_dir)
    _crash_point("metadata", tmp_dir)
    name = f"v-{body['step']:08d}-{tmp.removeprefix('.tmp-')}"
    os.rename(tmp_dir, os.path.join(path, name))
    fsync_dir(path)
    _crash_point("commit", path)
    pointer = os.path.join(path, f"{LATEST}{tmp}")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(path, LATEST))
    fsync_dir(path)
    for old in os.listdir(path):
        if old != name and (_VERSION_DIR.fullmatch(old) or old.startswith(".tmp-")):
            shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        elif old.startswith(f"{LATEST}.tmp-"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(path, old))
    return name


def resolve(path: str) -> str:
    """The directory of the checkpoint `path` names: its LATEST version, or `path` itself."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint at {path!r}: not a directory")
    try:
        with open(os.path.join(path, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise CheckpointError(
            f"no committed checkpoint in {path!r} (no {LATEST} file{_what_else(path)})"
        ) from None
    if not _VERSION_DIR.fullmatch(name) or not os.path.isdir(os.path.join(path, name)):
        raise CheckpointError(f"{os.path.join(path, LATEST)} names {name!r}, no checkpoint there")
    return os.path.join(path, name)


def _what_else(path: str) -> str:
    """What a directory without a committed checkpoint holds instead, for the message."""
    names = os.listdir(path)
    if ".metadata" in names:
        return "; it is a torch.distributed.checkpoint: read it with checkpoint.import_dcp"
    if any(n.endswith((".safetensors", ".bin", ".pt", ".pth")) for n in names):
        return "; it holds weights files: read them with init.from_file or import_torch"
    if any(".tmp-" in n or _VERSION_DIR.fullmatch(n) for n in names):
        return "; only an interrupted save"
    return ""


def read_metadata(directory: str) -> dict[str, Any]:
    """The metadata body, after checking its checksum, format and version."""
    where = os.path.join(directory, META)
    try:
        with open(where) as f:
            outer = json.load(f)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True)
        ok = hashlib.sha256(text.encode()).hexdigest() == outer["sha256"]
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{where} is corrupted (not fzero checkpoint metadata: {exc})"
        ) from None
    if not ok:
        raise CheckpointError(f"{where} is corrupted (checksum mismatch)")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: format {body.get('format')!r} version {body.get('version')!r}; this "
            f"fzero reads {FORMAT!r} version {VERSION}"
        )
    return body


def layout_json(layout: ShardLayout) -> dict[str, Any]:
    frozen = layout.frozen
    return {
        "kind": layout.kind,
        "units": [s if isinstance(s, str) else list(s) for s in layout.specs],
        "treedef": str(layout.treedef),
        "leaves": [
            {"path": p, "shape": list(s), "dtype": str(d), "frozen": f}
            for p, s, d, f in zip(layout.paths, layout.shapes, layout.dtypes, frozen)
        ],
        "buckets": [
            {
                "dtype": str(b.dtype),
                "unit": b.unit,
                "frozen": b.frozen,
                "shard_numel": b.shard_numel,
                "slots": [[s.index, s.offset, s.numel] for s in b.slots],
            }
            for b in layout.buckets
        ],
    }


def schema_json(schema: Schema) -> dict[str, Any]:
    return {
        "kind": schema.kind,
        "nodes": list(schema.nodes),
        "globals": [
            {"path": p, "dtype": d, "shape": list(s)} for p, (d, s) in schema.globals.items()
        ],
        "entries": [
            {
                "node": e.node,
                "sub": e.sub,
                "kind": e.kind,
                "dtype": e.dtype,
                "uniform": e.uniform,
                "present": sorted(e.present),
                "where": [list(w) for w in e.where],
            }
            for e in schema.entries
        ],
    }


def schema_from_json(d: dict[str, Any]) -> Schema:
    entries = tuple(
        Entry(
            e["node"],
            e["sub"],
            e["kind"],
            e["dtype"],
            e["uniform"],
            frozenset(e["present"]),
            tuple((o, r) for o, r in e["where"]),
        )
        for e in d["entries"]
    )
    glob = {g["path"]: (g["dtype"], tuple(g["shape"])) for g in d["globals"]}
    return Schema(d["kind"], tuple(d["nodes"]), glob, entries)


class FileSource:
    """A checkpoint directory as a `Source`: reads only the element ranges asked for.

    Each range is read from its file straight into the tensor that keeps it (no memory
    map, whose touched pages would count in the rank's resident memory), so a rank
    holds only what it loads. Each file is checked (size, SHA-256) the first time it is
    opened, and its index read with `torch.load(map_location="meta", weights_only=True)`.
    """

    def __init__(self, directory: str, body: dict[str, Any]) -> None:
        self.dir, self.body = directory, body
        self.schema = schema_from_json(body["optimizer"])
        self.world_size = body["world_size"]
        self.buckets = body["layout"]["buckets"]
        self.where = {
            slot[0]: (k, slot[1]) for k, b in enumerate(self.buckets) for slot in b["slots"]
        }
        self.globals = {g: j for j, g in enumerate(self.schema.globals)}
        self._open: dict[int, TensorFile] = {}

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, rank: int) -> TensorFile:
        if rank not in self._open:
            self._open[rank] = self._load(rank)
        return self._open[rank]

    def _load(self, rank: int) -> TensorFile:
        info = self.body["files"][rank]
        path = os.path.join(self.dir, info["name"])
        who = f"{path} (written by rank {rank} of {self.world_size})"
        if not os.path.isfile(path):
            raise CheckpointError(f"missing shard file {who}")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            how = "truncated" if size < info["bytes"] else "longer than written"
            raise CheckpointError(f"{who} is {how}: {size} bytes, {info['bytes']} were written")
        if sha256(path) != info["sha256"]:
            raise CheckpointError(f"{who} is corrupted: its SHA-256 differs from the one saved")
        try:
            data = TensorFile(path)
        except Exception as exc:
            # weights_only: a file that would run code when unpickled is refused here.
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise CheckpointError(
                f"refusing to load {who}: not a plain tensor file ({type(exc).__name__}: {first})"
            ) from None
        if not all(isinstance(k, str) for k in data.entries):
            data.close()
            raise CheckpointError(f"{who} is not a fzero shard file (expected a dict of tensors)")
        return data

    def _entry(self, rank: int, key: str) -> TensorFile:
        data = self._file(rank)
        if key not in data.entries:
            raise CheckpointError(
                f"{os.path.join(self.dir, self.body['files'][rank]['name'])} lacks tensor {key!r}"
            )
        return data

    def _tensor(self, rank: int, key: str) -> torch.Tensor:
        return self._entry(rank, key).tensor(key)

    def _range(self, key: str, k: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of saved bucket k's buffer `key`, from the files holding them."""
        n = self.buckets[k]["shard_numel"]
        out = torch.empty(max(hi - lo, 0), dtype=dtype_of(self.buckets[k]["dtype"]), device="cpu")
        for r in range(lo // n, (hi - 1) // n + 1) if hi > lo else ():
            data = self._entry(r, key)
            e = data.entries[key]
            if e.numel != n or e.dtype != out.dtype:
                raise CheckpointError(f"tensor {key!r} of rank {r}'s file has the wrong size")
            a, b = max(lo, r * n), min(hi, (r + 1) * n)
            data.read(key, a - r * n, b - r * n, out[a - lo : b - lo])
        return out

    def param(self, leaf: int, lo: int, hi: int) -> torch.Tensor:
        k, offset = self.where[leaf]
        return self._range(f"p{k}", k, offset + lo, offset + hi)

    def elem(self, entry: int, leaf: int, lo: int, hi: int) -> torch.Tensor:
        k, offset = self.where[leaf]
        return self._range(f"e{entry}.{k}", k, offset + lo, offset + hi)

    def piece(self, entry: int, leaf: int) -> torch.Tensor | None:
        for owner, rank in self.schema.entries[entry].where:
            if owner == f"l{leaf}":
                return self._tensor(rank, f"v{entry}.{owner}")
        return None

    def uniform(self, entry: int) -> torch.Tensor:
        owner, rank = self.schema.entries[entry].where[0]
        return self._tensor(rank, f"v{entry}.{owner}")

    def global_(self, path: str) -> torch.Tensor:
        return self._tensor(0, f"g{self.globals[path]}")
