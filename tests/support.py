"""Test support: random MLP-like parameter trees, optimizers, the single-process reference."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

import fzero
from fzero import optim


def on_matrices(path: str) -> bool:
    """The usual weight-decay mask: the layers' matrices ("layers.i.w"), not their biases
    or the scale and shift, so that a flat piece of a layer mixes the two."""
    return path.endswith(".w")


# name -> (fzero optimizer factory, torch.optim class, kwargs shared by both; a `mask`
# is fzero's, and torch's two parameter groups, `make_torch_optimizer`)
OPTIMIZERS: dict[str, tuple[Any, type, dict[str, Any]]] = {
    "sgd": (optim.sgd, torch.optim.SGD, {"lr": 0.1}),
    "momentum": (optim.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "nesterov": (optim.sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adam": (optim.adam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adamw": (optim.adamw, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "adamw_matrices": (
        optim.adamw,
        torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.3, "mask": on_matrices},
    ),
    "torch_rmsprop": (None, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "torch_adamw": (None, torch.optim.AdamW, {"lr": 0.01}),
}


def make_optimizer(name: str) -> optim.Optimizer:
    factory, cls, kwargs = OPTIMIZERS[name]
    return factory(**kwargs) if factory is not None else optim.from_torch(cls, **kwargs)


def make_torch_optimizer(
    name: str, tensors: list[torch.Tensor], paths: list[str] | None = None
) -> torch.optim.Optimizer:
    """torch's optimizer for `name` over `tensors`; with a `mask` (decay by path), two
    parameter groups, the second without weight decay (`paths`: the tensors' paths)."""
    _, cls, kwargs = OPTIMIZERS[name]
    if "mask" not in kwargs:
        return cls(tensors, foreach=False, **kwargs)
    if paths is None:
        raise TypeError(f"{name!r} decays by path: make_torch_optimizer needs the paths")
    mask, rest = kwargs["mask"], {k: v for k, v in kwargs.items() if k != "mask"}
    groups = [
        {"params": [t for t, p in zip(tensors, paths, strict=True) if mask(p)]},
        {"params": [t for t, p in zip(tensors, paths) if not mask(p)], "weight_decay": 0.0},
    ]
    return cls(groups, foreach=False, **rest)


def mlp_loss(params: dict[str, Any], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An MLP over a nested tree: tanh layers, then a 0-d scale and a 1-element shift."""
    x, y = batch
    h = x
    for layer in params["layers"]:
        h = torch.tanh(h @ layer["w"] + layer["b"])
    out = h * params["scale"] + params["shift"]
    return ((out - y) ** 2).mean()


@dataclass
class Case:
    """One parity experiment: initial params, per-step global batches, optimizer, ranks."""

    params: dict[str, Any]
    xs: torch.Tensor  # (steps, world_size * micro, d_in)
    ys: torch.Tensor  # (steps, world_size * micro, d_out)
    world_size: int
    optimizer: str = "adam"
    stage: int = 0
    layout: str = "flat"
    extra: dict[str, Any] = field(default_factory=dict)

    def micro_batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        micro = self.xs.shape[1] // self.world_size
        sl = slice(rank * micro, (rank + 1) * micro)
        return self.xs[step, sl], self.ys[step, sl]


def make_params(dims: list[int], dtype: torch.dtype, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=dtype) * 0.5

    layers = [{"w": rnd(a, b), "b": rnd(b)} for a, b in itertools.pairwise(dims)]
    return {"layers": layers, "scale": rnd(), "shift": rnd(1)}


@st.composite
def cases(
    draw: Any,
    *,
    world_sizes: Any = st.integers(1, 8),
    dtype: torch.dtype = torch.float64,
    optimizers: Any = None,
    stages: Any = st.sampled_from([0, 1, 2, 3]),
    layouts: Any = st.sampled_from(["flat", "tensor"]),
) -> Case:
    """Random MLP-like trees (odd shapes, 0-d and 1-element leaves) with random data."""
    n = draw(world_sizes)
    dims = draw(st.lists(st.integers(1, 6), min_size=2, max_size=4))
    steps = draw(st.integers(1, 3))
    micro = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    opt = draw(optimizers if optimizers is not None else st.sampled_from(sorted(OPTIMIZERS)))
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(steps, n * micro, dims[0], generator=g, dtype=dtype)
    ys = torch.randn(steps, n * micro, dims[-1], generator=g, dtype=dtype)
    return Case(make_params(dims, dtype, seed), xs, ys, n, opt, draw(stages), draw(layouts))


def dims_and_units() -> Any:
    """MLP layer widths, and any subset of its layers ("layers.i") as units."""
    return st.lists(st.integers(1, 5), min_size=2, max_size=5).flatmap(
        lambda dims: st.tuples(
            st.just(dims),
            st.lists(st.sampled_from([f"layers.{i}" for i in range(len(dims) - 1)]), unique=True),
        )
    )


def train_reference(case: Case) -> dict[str, Any]:
    """Plain torch.optim on one process over the concatenated batch: the ground truth."""
    leaves, treedef = fzero._core._tree.tree_flatten(case.params)
    tensors = [x.detach().clone().requires_grad_() for x in leaves]
    opt = make_torch_optimizer(case.optimizer, tensors, fzero._core._tree.leaf_paths(case.params))
    for t in range(case.xs.shape[0]):
        opt.zero_grad()
        mlp_loss(
            fzero._core._tree.tree_unflatten(treedef, tensors), (case.xs[t], case.ys[t])
        ).backward()
        opt.step()
    return fzero._core._tree.tree_unflatten(treedef, [x.detach() for x in tensors])


def train_fzero(mesh: fzero.Mesh, case: Case) -> tuple[Any, list[float]]:
    """The same run under fzero on `mesh`; returns the gathered params and this rank's losses."""
    opt = make_optimizer(case.optimizer)
    state = fzero.shard_state(case.params, opt, mesh, stage=case.stage, layout=case.layout)
    step = fzero.sharded_step(mlp_loss, opt, mesh, stage=case.stage)
    losses = []
    for t in range(case.xs.shape[0]):
        state, loss = step(state, case.micro_batch(t, mesh.rank))
        losses.append(loss.item())
    return fzero.gather_params(state.params, mesh), losses


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """float64: exactness up to reduction order; float32: round-off over a few steps."""
    return (
        {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    )


def run(world_size: int, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
    """fzero.simulate with short timeouts: a collective bug fails the test, never hangs it."""
    return fzero.Simulation(world_size, collective_timeout=30, timeout=120).run(fn, *args, **kwargs)


@contextlib.contextmanager
def counting(names: tuple[str, ...]) -> Iterator[list[int]]:
    """Counts the elements passed to fzero._comm's `names` within the block (then restores)."""
    seen: list[int] = []
    originals = {name: getattr(fzero._comm, name) for name in names}

    def wrap(f: Any) -> Any:
        def counted(t: Any, *args: Any, **kwargs: Any) -> Any:
            # A tensor, or the list of shards `all_gather_many_async` sends as one.
            seen.append(t.numel() if isinstance(t, torch.Tensor) else sum(x.numel() for x in t))
            return f(t, *args, **kwargs)

        return counted

    for name, f in originals.items():
        setattr(fzero._comm, name, wrap(f))
    try:
        yield seen
    finally:
        for name, f in originals.items():
            setattr(fzero._comm, name, f)


@contextlib.contextmanager
def fused_kernels() -> Iterator[list[tuple[int, ...]]]:
    """Records the shape of every tensor a fused optimizer kernel (`fzero.optim._fused`)
    updates within the block, one entry a call (then restores)."""
    from fzero.optim import _fused

    calls: list[tuple[int, ...]] = []
    original = _fused.kernel

    def spy(*args: Any, **kwargs: Any) -> Any:
        compiled = original(*args, **kwargs)

        def call(p: torch.Tensor, *rest: Any) -> Any:
            calls.append(tuple(p.shape))
            return compiled(p, *rest)

        return call

    _fused.kernel = spy
    try:
        yield calls
    finally:
        _fused.kernel = original


@contextlib.contextmanager
def fused_lists() -> Iterator[list[int]]:
    """Records how many tensors each call of torch's fused list kernels (`_fused_adam_`,
    `_fused_adamw_`, `_fused_sgd_`, which `fzero.optim._fused.listed` hands a group of
    small leaves) updates within the block (then restores)."""
    names = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_")
    originals = {name: getattr(torch, name) for name in names}
    calls: list[int] = []

    def spy(kernel: Callable[..., Any]) -> Callable[..., Any]:
        def call(params: list[torch.Tensor], *rest: Any, **kwargs: Any) -> Any:
            calls.append(len(params))
            return kernel(params, *rest, **kwargs)

        return call

    for name, kernel in originals.items():
        setattr(torch, name, spy(kernel))
    try:
        yield calls
    finally:
        for name, kernel in originals.items():
            setattr(torch, name, kernel)


def with_fused_kinds(
    mesh: fzero.Mesh, large: bool, fn: Callable[..., Any], *args: Any
) -> tuple[Any, int, int]:
    """A rank's `fn(mesh, *args)`, every piece large (`_base._SMALL` 0: a compiled kernel
    each) or as it is, and its compiled kernels' and list kernels' calls (`run` it)."""
    if large:
        fzero.optim._base._SMALL = 0  # this rank process's own copy
    with fused_kernels() as kernels, fused_lists() as lists:
        out = fn(mesh, *args)
    return out, len(kernels), len(lists)


def with_fused_updates(mesh: fzero.Mesh, fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """A rank's `fn(mesh, *args)` and how many fused calls it made: compiled kernels and
    torch's fused list kernels (`run` it)."""
    with fused_kernels() as kernels, fused_lists() as lists:
        out = fn(mesh, *args)
    return out, len(kernels) + len(lists)


def with_fused_calls(
    mesh: fzero.Mesh, fn: Callable[..., Any], *args: Any
) -> tuple[Any, list[tuple[int, ...]]]:
    """A rank's `fn(mesh, *args)` and the shape each fused kernel call updated."""
    with fused_kernels() as calls:
        out = fn(mesh, *args)
    return out, calls


def map_every_allocation() -> None:
    """Makes glibc serve every allocation of 64 KiB or more with its own mapping, unmapped
    on free (`mallopt(M_MMAP_THRESHOLD)`), so resident memory follows live tensors rather
    than the allocator's high-water mark. Call it first thing in a rank process (`run`):
    memory freed into the heap before the call is reused without showing in RSS."""
    import ctypes

    if ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024) != 1:  # M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


@contextlib.contextmanager
def peak_rss_rise() -> Iterator[dict[str, int]]:
    """Measures, in bytes, how far this process's resident set rose above its level at the
    start of the block: what the block allocated at its peak (Linux only; after
    `map_every_allocation`). The kernel's peak (VmHWM) is reset at the start
    (`/proc/self/clear_refs`), so the peak is the block's own."""
    from pathlib import Path

    def status() -> dict[str, int]:
        lines = Path("/proc/self/status").read_text().splitlines()
        return {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in lines if ln.startswith("Vm")}

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    out = {"before": status()["VmRSS"]}
    yield out
    out["rise"] = status()["VmHWM"] - out["before"]


def errors_on_every_rank(world_size: int, fn: Callable[[fzero.Mesh], Any]) -> list[str]:
    """Runs `fn` on every rank; each rank must raise, and returns "Type: message" instead."""

    def catch(mesh: fzero.Mesh) -> str:
        try:
            fn(mesh)
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    return run(world_size, catch)


def module_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by name, detached copies."""
    return {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}


def state_values(state: fzero.ShardedState, mesh: fzero.Mesh) -> dict[str, torch.Tensor]:
    """A state's full parameters (gathered at stage 3) and its buffers, by path."""
    params = fzero.gather_params(state.params, mesh) if state.stage == 3 else state.params
    out = {k: v.detach().clone() for k, v in params.items()}
    out.update(state.buffers or {})
    return out


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose tensors are not bitwise equal (dtype included), or the key sets'."""
    if set(got) != set(want):
        return [f"keys {sorted(set(got) ^ set(want))}"]
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def torchrun(script: Any, *args: str, nproc: int = 2, timeout: float = 240) -> Any:
    """`torchrun --nproc-per-node=nproc script *args` on 127.0.0.1 (gloo over loopback, a
    free port, no restarts); the finished `subprocess.CompletedProcess`, output captured."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [
        str(Path(sys.executable).parent / "torchrun"), f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
        str(script), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def graphs_made() -> int:
    """How many graphs dynamo has made in this process. Rank processes fork from a parent
    that may have compiled already and inherit its count: diff it inside the rank."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def tensor_bytes() -> Iterator[dict[str, int]]:
    """Measures the tensor memory the block allocates, from torch.profiler's record of
    every allocation and free (the allocator's own events, not fzero's accounting):
    `peak`, the most bytes allocated in the block alive at once, and `live`, those still
    alive at its end. Frees of tensors made before the block are not counted."""
    from torch.profiler import ProfilerActivity, profile

    from fzero._tools._memory import profiled_bytes

    out: dict[str, int] = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    out["peak"], out["live"] = profiled_bytes(prof)


def least_live(make: Callable[[], Any], times: int = 6) -> tuple[Any, int]:
    """`make()`'s last result, and the fewest bytes one call of it left alive (tensor_bytes'
    `live`) over `times` calls. gloo frees a collective's buffer on its worker thread when
    that thread drops the last reference after `wait()` returned, and the profiler does not
    see that free (measured: shard_state's broadcast bucket, counted as kept in 1 call in
    3 to 12, and once in 3 calls of 3: a CI run failed on it with 3). What a call truly
    keeps alive it keeps in every call, so the least keeps the measure's power."""
    least, out = None, None
    for _ in range(times):
        out = None  # the last call's result is not kept alive beside the next
        with tensor_bytes() as made:
            out = make()
        least = made["live"] if least is None else min(least, made["live"])
    assert least is not None
    return out, least
