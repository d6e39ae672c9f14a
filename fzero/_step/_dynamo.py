"""Dynamo's side of compiled steps: a code object per compiled function, the exception
a traced function raised, as itself, what broke a graph, what a recompile is said as,
and the warnings of torch's own that a compiled call silences."""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import re
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from .. import _comm
from .._comm import Mesh
from .._core import NAMESPACE

_INSTANTIATED = r".*autograd\.function\.Function'> should not be instantiated"
# Seen with torch 2.11 on a GPU, not with 2.13: the filter (process-wide while it lasts)
# is set only where it is needed.
_DYNAMO_WARNS = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
# Dynamo's own, resuming a frame after a graph break inside `functional_call` (it reads
# `.grad` of the swapped-in tensors); seen with torch 2.13.
_NON_LEAF_GRAD = r"The \.grad attribute of a Tensor that is not a leaf Tensor"


@contextlib.contextmanager
def quiet(pieces: bool) -> Iterator[None]:
    """Around a compiled call: torch's own warnings of tracing ignored, where they occur
    (torch 2.11's dynamo instantiates autograd.Function itself to trace one; a graph
    traced in `pieces` reads `.grad` of non-leaf tensors), not the user's."""
    if not (_DYNAMO_WARNS or pieces):
        yield
        return
    with warnings.catch_warnings():
        if _DYNAMO_WARNS:
            warnings.filterwarnings("ignore", _INSTANTIATED, DeprecationWarning)
        if pieces:
            warnings.filterwarnings("ignore", _NON_LEAF_GRAD, UserWarning)
        yield


def graph_break(exc: BaseException) -> str:
    """What broke the graph, from dynamo's report: its first line and the innermost line
    of the user's code it names."""
    lines = str(exc).splitlines()
    where = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
    at = ""
    if where:
        k = max(i for i, ln in enumerate(lines) if ln.strip() == where[-1])
        code = lines[k + 1].strip() if k + 1 < len(lines) else ""
        at = f" at {where[-1]}" + (f": {code}" if code else "")
    return f"{lines[0].strip() if lines else type(exc).__name__}{at}"


def raised_in_trace(exc: BaseException) -> BaseException | None:
    """The exception a traced function raised (a ValueError of `fzero.gathered`, the
    user's own), rebuilt from dynamo's report of it: with `fullgraph=True` dynamo raises
    `Unsupported` ("Observed exception") carrying only its repr. None where that is not
    what happened, or the repr is not a builtin exception of literal arguments."""
    cause = exc.__cause__
    if not isinstance(cause, torch._dynamo.exc.ObservedException) or not cause.args:
        return None
    said = str(cause.args[0]).removeprefix("raised exception ")
    try:
        call = ast.parse(said, mode="eval").body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            return None
        kind = getattr(builtins, call.func.id, None)
        if not (isinstance(kind, type) and issubclass(kind, Exception)) or call.keywords:
            return None
        return kind(*(ast.literal_eval(a) for a in call.args))
    except (SyntaxError, ValueError, TypeError):
        return None


def own_code(method: Any) -> Any:
    """`method` with a code object of its own: torch.compile keeps its compiled graphs,
    and counts recompilations against its limit, per code object, so each step
    function's compiled loss gets its own count (with `fullgraph=True` the limit raises
    rather than falls back to eager)."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


# Inductor's passes that move a collective's start earlier and its wait later, so that
# compute runs while it is in flight (torch's recommended list; the pass flag alone, with
# its default empty list, runs no pass in torch 2.13). Measured on the benchmark GPT at stage 3, two
# ranks on this CPU: 1.38 x DDP without them, 1.20 x with (units before the loss); 1.57
# x against 1.25 x with units entered where their blocks run (benchmarks/compiled.py).
OVERLAP = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_communication_preserving_peak_memory",
        "sink_waits_iterative",
        "reorder_communication_preserving_peak_memory",
    ],
}


def compile_loss(
    fn: Any,
    backend: str,
    fullgraph: bool,
    fixed: tuple[str, ...] = (),
    before_run: Callable[[], None] | None = None,
) -> Any:
    """`torch.compile(fn)` for a compiled step: inductor with its overlap passes
    (`OVERLAP`, those this torch has), another backend as it is. `fixed`: attributes of
    `fn`'s `self` that never change after it is made, whose guards are dropped.
    `before_run`: called before each run of a compiled graph that holds a collective,
    after its trace (`_arriving`).

    Dynamo guards every Python value the trace reads: a step's layout (each slot's
    offset, size and shape, read to cut the flat buffers) came to some 7,000 guards for
    the deep benchmark model, checked before every call: 2.6 ms a call, a tenth of its
    step. A compiled loss is made for one layout and never sees another (the step's
    cache keys it by layout), so those guards can only pass. The user's loss keeps all
    of its guards: what it reads may change between calls."""
    if fixed and hasattr(torch._dynamo.types, "GuardFilterEntry"):  # torch >= 2.8
        roots = tuple(f"self.{name}" for name in fixed)
        make = functools.partial(_compile, fn, backend, fullgraph, before_run)
        return _Filtered(make, functools.partial(_unfixed, roots))
    return _compile(fn, backend, fullgraph, before_run, None)


class _Filtered:
    """A compiled function whose fixed guards are dropped, and, where torch cannot build
    the guards under a filter, kept: with a `guard_filter_fn`, torch 2.13 builds a
    `torch.from_numpy` guard twice and compares two tensors (`InternalTorchDynamoError`:
    a loss reading numpy arrays from its batch could not compile). That trace ran
    nothing, so it is traced again keeping every guard."""

    def __init__(self, make: Callable[[Any], Any], guard_filter: Any) -> None:
        self.make, self.fn = make, make(guard_filter)

    def __call__(self, *args: Any) -> Any:
        try:
            return self.fn(*args)
        except torch._dynamo.exc.InternalTorchDynamoError as exc:
            if self.make is None or "Boolean value of Tensor" not in str(exc):
                raise
            self.fn, self.make = self.make(None), None
            return self.fn(*args)


def _compile(fn: Any, backend: str, fullgraph: bool, before_run: Any, guard_filter: Any) -> Any:
    """`compile_loss`'s torch.compile, with `guard_filter` (None: every guard kept)."""
    options: dict[str, Any] = {} if guard_filter is None else {"guard_filter_fn": guard_filter}
    patches: dict[str, Any] = {}
    if backend == "inductor":
        import torch._inductor.comms as comms  # inductor's, loaded only where it compiles

        wanted = OVERLAP["reorder_for_compute_comm_overlap_passes"]
        passes = [p for p in wanted if hasattr(comms, p)]
        patches["reorder_for_compute_comm_overlap"] = bool(passes)
        patches["reorder_for_compute_comm_overlap_passes"] = passes
    if before_run is None:
        options.update(patches)
        return torch.compile(fn, fullgraph=fullgraph, backend=backend, options=options or None)
    arriving = functools.partial(_arriving, backend, patches, before_run)
    return torch.compile(fn, fullgraph=fullgraph, backend=arriving, options=options or None)


def _arriving(
    backend: str, patches: dict[str, Any], before_run: Callable[[], None], gm: Any, inputs: Any
) -> Any:
    """A torch.compile backend: `backend`'s compiled graph (inductor's with config
    `patches`), run after `before_run()` returns where it holds a collective. Dynamo
    calls its backend once a trace has succeeded, before the graph first runs, and runs
    every call through what the backend returns: the one place between a trace and a
    run (`CompiledLoss._arrive` says why a step needs one)."""
    from torch._dynamo.backends.registry import lookup_backend

    collects = _collects(gm)  # before compiling: inductor's passes may change `gm`
    if patches:
        graph = lookup_backend(backend)(gm, inputs, config_patches=patches)
    else:
        graph = lookup_backend(backend)(gm, inputs)
    if not collects:  # a piece of a loss that breaks the graph, without a gather
        return graph

    def run(*args: Any) -> Any:
        before_run()
        return graph(*args)

    return run


def _collects(gm: Any) -> bool:
    """Whether dynamo's graph `gm` (with its autograd.Functions' bodies, submodules of
    it) runs a collective: a functional collective of `torch.distributed`."""
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            op = node.target
            if isinstance(op, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and (
                str(op).split(".", 1)[0] in _COLLECTIVES  # "_c10d_functional.all_gather_..."
            ):
                return True
    return False


_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d")


def _unfixed(roots: tuple[str, ...], entries: Any) -> list[bool]:
    """`guard_filter_fn`: keeps each guard but those on a value under one of `roots`
    (`self.layout`), for a `fullgraph` trace: its one frame is the loss's own (in pieces
    the user's frames, whose `self` is another object, would be filtered too). An entry
    names its value as torch 2.13 does, the frame's locals
    unwrapped (`self.layout.buckets[3]`), or as the guard itself does
    (`L['self'].layout.buckets[3]`): a filter matching only the second dropped nothing."""
    names = [_LOCAL.sub(r"\1", e.name) for e in entries]
    return [not any(n == r or n.startswith((f"{r}.", f"{r}[")) for r in roots) for n in names]


_LOCAL = re.compile(r"L\[\s*['\"](.*?)['\"]\s*\]")  # a frame local, `L['self']`


def unentered_use(rank: int) -> str:
    """The error for a compiled loss that used a just-in-time unit it had not entered."""
    return (
        f"rank {rank}: the compiled loss used a parameter of a just-in-time unit that it had "
        "not entered (just_in_time=True: every unit but the root enters where the loss "
        "calls fzero.gathered(params, unit)); call fzero.gathered before using the unit's "
        "parameters, or leave just_in_time off so that the units enter before the loss "
        "(the line is in the traceback above)"
    )


def graphs_compiled() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes of a batch's tensors, in its tree's order."""
    leaves = optree.tree_leaves(batch, none_is_leaf=False, namespace=NAMESPACE)
    return [tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor)]


def recompiled(
    rank: int, before: list[tuple[int, ...]], now: list[tuple[int, ...]], pieces: bool = False
) -> str:
    """Says that a compiled step's loss was compiled again, and why as far as fzero sees
    (`pieces`: it runs in pieces, where a path not taken before compiles its first)."""
    config = torch._dynamo.config
    limit = getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8)
    if before != now:
        why = (
            f"its batch's shapes changed, {before} -> {now}: after one such recompile "
            "torch.compile marks the dimension dynamic"
        )
    elif pieces:
        why = "a piece ran for the first time (a path not taken before), or a guard failed"
    else:
        why = "a guard of its graphs failed (a dtype, device or Python value the loss reads)"
    return (
        f"fzero: rank {rank}: the compiled step's loss was compiled again ({why}); a step "
        f"function compiles at most {limit} graphs (torch._dynamo.config.recompile_limit), "
        "past which it is compiled in pieces, and past their limit runs eagerly; "
        "TORCH_LOGS=recompiles names each guard that failed"
    )


def warn_recompiled(
    rank: int, before: list[tuple[int, ...]], now: list[tuple[int, ...]], pieces: bool
) -> None:
    """The RuntimeWarning of `recompiled`, at the compiled loss's caller."""
    warnings.warn(recompiled(rank, before, now, pieces), RuntimeWarning, stacklevel=3)


def in_pieces(rank: int, why: str) -> str:
    """Says that a compiled loss is compiled in pieces from now on, and `why`."""
    return (
        f"fzero: rank {rank}: the compiled loss {why}; it is compiled in pieces, with the "
        "code between them run eagerly (and a piece past its own recompile limit too): "
        "the same training, less of it compiled (TORCH_LOGS=graph_breaks lists every "
        "break, TORCH_LOGS=recompiles every recompile)"
    )


def arrive_alike(mesh: Mesh, pieces: bool, why: str, recomputes: bool) -> None:
    """A compiled stage-3 call's barrier (`CompiledLoss._arrive`), carrying whether this
    rank's loss is compiled in pieces. Where the backward gathers again (`recomputes`:
    resharded just-in-time units, in a call with gradients), a rank in pieces keeps the
    gathers that cross a break instead, and ranks that differ would pair a gather with a
    reduction until the timeout: they raise instead, every rank alike, before any gather."""
    # Every branch below reads gathered values only: every rank takes it alike.
    flags = _comm.all_gather_ints_async([int(pieces), int(recomputes)], mesh)()
    if not any(r for _, r in flags) or len({p for p, _ in flags}) == 1:
        return
    whys = _comm.all_gather_object(why, mesh)
    said = "; ".join(f"rank {r}: it {w}" for r, w in enumerate(whys) if flags[r][0])
    raise _comm.agreed(
        ValueError(
            f"fzero: the compiled loss is in pieces on some ranks only ({said}): at stage 3 "
            "with resharding, a rank in pieces keeps the gathered parameters that cross a "
            "break for the backward where the others gather them again, and their "
            "collectives would pair wrongly. Give every rank the same code path in the loss "
            "(log from one rank outside it), or pass reshard_after_forward=False or "
            "compile=False"
        )
    )
