"""Module hooks that run a step's units just in time, and the per-unit value-and-grad."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._autodiff import check_loss
from ._burst import Bursts
from ._layout import ShardLayout
from ._mesh import Mesh
from ._nodes import _RegatherBeforeBackward, gather_unit
from ._tree import tree_flatten, tree_unflatten
from ._unit import UnitRun, _Call
from ._unit_ledger import UnitLedger

# A hooked unit's parameters: (leaf path, the module holding it, its attribute name).
Slots = tuple[tuple[str, nn.Module, str], ...]


@dataclass
class UnitHooks:
    """Forward hooks on the unit submodules of `module` for the duration of one step."""

    run: UnitRun
    module: nn.Module
    units: dict[str, Slots]  # hooked unit -> its parameters' module slots
    handles: list[Any] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    open_calls: dict[str, list[_Call]] = field(default_factory=dict)

    def __enter__(self) -> UnitHooks:
        for unit in self.units:
            sub = self.module.get_submodule(unit)
            self.handles.append(sub.register_forward_pre_hook(self._pre(unit)))
            self.handles.append(sub.register_forward_hook(self._post(unit)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, unit: str) -> Any:
        def hook(sub: nn.Module, args: Any) -> None:
            run = self.run
            views, call = gather_unit(run, unit)
            if torch._C._current_graph_task_id() == -1:  # not a checkpoint's recompute
                self.seen.append(unit)
                run.prefetch_next(unit)
            for path, owner, name in self.units[unit]:
                view = views[path]
                call.swapped.append((owner, name, owner._parameters[name]))
                owner._parameters[name] = view
            self.open_calls.setdefault(unit, []).append(call)

        return hook

    def _post(self, unit: str) -> Any:
        def hook(sub: nn.Module, args: Any, output: Any) -> Any:
            run = self.run
            call = self.open_calls[unit].pop()
            # Put back what was there (functional_call's placeholders): the gathered views
            # must not outlive the unit's forward in the module or the caller's dict.
            for owner, name, old in reversed(call.swapped):
                owner._parameters[name] = old
            # During a checkpoint's recompute (inside backward) the recomputed activations
            # need these parameters until the unit's backward: keep them.
            if not run.reshard or torch._C._current_graph_task_id() != -1:
                return None
            run.release(call)
            return _wrap_outputs(run, call, output)

        return hook


def _wrap_outputs(run: UnitRun, call: _Call, output: Any) -> Any:
    leaves, treedef = tree_flatten(output)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return None
    wrapped = _RegatherBeforeBackward.apply(run, call, *(leaves[i] for i in idx))
    for i, w in zip(idx, wrapped):
        leaves[i] = w
    return tree_unflatten(treedef, leaves)


def hookable_units(layout: ShardLayout, module: nn.Module | None) -> dict[str, Slots]:
    """The units gathered just in time: those naming a submodule of `module` that runs,
    each with the (path, owning module, attribute) of its parameters, which its hook swaps.

    A container such as `nn.ModuleList` has no forward of its own, so no hook would ever
    fire for it: such units are gathered before the forward, like units that name no
    submodule.

    Every leaf of such a unit must be a registered parameter of `module` under its path
    (params from `dict(module.named_parameters())`), since the hook swaps it in by name.
    Other units, and the root, are gathered before the forward.
    """
    if module is None:
        return {}
    names = dict(module.named_modules())
    out: dict[str, Slots] = {}
    for unit in layout.units:
        if not unit or unit not in names or not layout.unit_buckets(unit):
            continue
        if type(names[unit]).forward is nn.Module.forward:  # a container: never called
            continue
        slots = []
        for i in layout.unit_buckets(unit):
            for s in layout.buckets[i].slots:
                head, _, name = s.path.rpartition(".")
                owner = names.get(head) if head else module
                if owner is None or name not in owner._parameters:
                    raise ValueError(
                        f"unit {unit!r}: leaf {s.path!r} is not a parameter of the module "
                        "passed as module= (use dict(module.named_parameters()) as params)"
                    )
                slots.append((s.path, owner, name))
        out[unit] = tuple(slots)
    return out


def value_and_shard_grad(
    loss_fn: Any,
    batch: Any,
    *,
    mesh: Mesh,
    layout: ShardLayout,
    shards: tuple[torch.Tensor, ...],
    local: tuple[torch.Tensor, ...] | None,
    module: nn.Module | None,
    reshard: bool,
    prefetch: bool,
    order: list[str],
    ledger: UnitLedger | None,
    acc: dict[int, torch.Tensor] | None = None,
    final: bool = True,
    overlap: bool = True,
    replicate: bool = False,
    bursts: bool = False,
    hold_bytes: int = 0,
    jit: dict[str, Slots] | None = None,
    comm_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """This rank's loss and its shard gradients (mean over ranks), unit by unit.

    Args:
      loss_fn: `(params, batch) -> scalar`.
      batch: this rank's micro-batch.
      mesh: the mesh.
      layout: the state's layout.
      shards: this rank's shard buffers (only their values are read).
      local: stage 2: the full replicated buckets; stage 3: None (all-gather instead).
      module: the module whose unit submodules get just-in-time hooks, or None.
      reshard: stage 3: free each unit's parameters after its forward.
      prefetch: stage 3: gather the next unit while the current one computes.
      order: unit call order from the previous step; updated in place for the next.
      ledger: optional UnitLedger.
      acc: local accumulation: full gradients of earlier micro-batches, per bucket
        (updated in place); None reduce-scatters every micro-batch.
      final: with `acc`, whether this is the last micro-batch (reduce now).
      overlap: let one unit's reduce-scatter run while the next unit differentiates
        (one more unit of full gradients alive); False reduces synchronously.
      jit: `hookable_units(layout, module)`, if the caller already has it (it walks the
        module, so a step computes it once, not every step).
      replicate: stage 0: all-reduce each unit's gradient (full-size results, one per
        bucket) instead of reduce-scattering it.
      bursts: stage 1: with `overlap`, reductions start `hold_bytes` at a time, and a
        burst in flight is finished when the next unit's gradient arrives.
      hold_bytes: stages 0-1: hold complete unit gradients until at least this many bytes
        are ready, then start their reductions together (0: each as soon as complete).
      comm_dtypes: `(gather_dtype, reduce_dtype)` the parameters and gradients travel in
        (None: the buckets' own); reduced gradients come back in the reduce dtype.

    Returns:
      `(loss, shard_grads)`: the detached loss and one gradient buffer per bucket.
    """
    # Frozen buckets' shards enter without requires_grad: no gradient, no reduce-scatter.
    inputs = tuple(
        s.detach() if b.frozen else s.detach().requires_grad_()
        for s, b in zip(shards, layout.buckets)
    )
    trainable = [i for i, b in enumerate(layout.buckets) if not b.frozen]
    run = UnitRun(
        mesh, layout, inputs, local, reshard=reshard, prefetch=prefetch, order=order, ledger=ledger
    )
    run.acc, run.final = acc, final
    # Stage 0 holds every full gradient anyway (it reduces them in place and keeps them),
    # and stage 1 reduces a burst at a time: they issue a burst's reductions without waiting
    # for one another, as DDP's buckets do. Stages 2-3 keep one in flight, so at most two
    # units of full gradients are alive.
    run.max_inflight = (len(layout.buckets) if replicate or bursts else 1) if overlap else 0
    run.replicate = replicate
    run.drain = bursts
    run.hold_bytes = hold_bytes if replicate or bursts else 0
    run.gather_dtype, run.reduce_dtype = comm_dtypes
    if replicate and acc is None:
        run.bursts = Bursts(hold_bytes, layout, comm_dtypes[1])
    jit = hookable_units(layout, module) if jit is None else jit
    leaves: list[Any] = [None] * len(layout.paths)
    index = {p: i for i, p in enumerate(layout.paths)}
    for unit in layout.units:
        if not layout.unit_buckets(unit):
            continue
        if unit in jit:
            # Meta placeholders: the unit's hook swaps the real views in for its forward, and
            # any use outside that forward fails loudly instead of training on stale values.
            for i in layout.unit_buckets(unit):
                for s in layout.buckets[i].slots:
                    leaves[s.index] = torch.empty(
                        s.shape, dtype=layout.buckets[i].dtype, device="meta"
                    )
        else:
            views, _ = gather_unit(run, unit)
            for path, view in views.items():
                leaves[index[path]] = view
    params = tree_unflatten(layout.treedef, leaves)
    hooks = UnitHooks(run, module, jit) if jit else None
    try:
        if hooks is not None:
            hooks.__enter__()
        loss = check_loss(loss_fn(params, batch), rank=mesh.rank)
        if hooks is not None and mesh.size > 1:
            run.agree()  # hooks call units as the forward runs: a branch may skip one
        grads: tuple[Any, ...] = (None,) * len(inputs)
        if loss.requires_grad:
            found = torch.autograd.grad(loss, [inputs[i] for i in trainable], allow_unused=True)
            grads = tuple(dict(zip(trainable, found)).get(i) for i in range(len(inputs)))
    except (RuntimeError, NotImplementedError) as exc:
        # torch's own words ("Tensor on device meta ...", "Cannot copy out of meta tensor")
        # differ by op and arrive in forward or backward; say what actually went wrong.
        if jit and "meta" in str(exc):
            raise ValueError(
                f"rank {mesh.rank}: a parameter of a just-in-time unit ({', '.join(jit)}) was "
                "used outside its submodule's forward, where it is only a meta placeholder; "
                "use it inside the submodule, or leave it out of units= (e.g. in the root)"
            ) from exc
        raise
    finally:
        if hooks is not None:
            hooks.__exit__()
    run.finish()
    run.settle()
    if hooks is not None:
        order[:] = hooks.seen
    out = []
    for i, (x, g) in enumerate(zip(inputs, grads)):
        if layout.buckets[i].frozen:
            out.append(x.new_empty(0))  # a placeholder: frozen buckets have no gradient
            continue
        for part in (run.reduced.get(i), run.extra.get(i)):
            if part is not None:
                g = part if g is None else g + part
        out.append(torch.zeros_like(x) if g is None else g)
    return loss.detach(), tuple(out)
