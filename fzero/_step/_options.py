"""StepOptions: what `sharded_step` was asked for, checked once; and whether a state fits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .._comm import Axis, Mesh, QuantizedComm
from .._core import ShardLayout, Shards, Stage, UnitSpec, members_of, stage_of
from .._engine import Schedule, UnitLedger, plan
from .._state import Precision, ShardedState, check_live


@dataclass(frozen=True)
class StepOptions:
    """`sharded_step`'s arguments, checked (`step_options`): fixed for the step
    function's life. See `fzero.sharded_step` for what each means."""

    mesh: Mesh
    stage: Stage
    layout: str | None
    units: Sequence[UnitSpec] | None
    module: nn.Module | None
    just_in_time: bool
    reshard_after_forward: bool
    reshard: bool | int  # as given: an int k is hpZ's (its axis made on the first step)
    quantize: QuantizedComm | None
    prefetch: bool
    ledger: UnitLedger | None
    donate: bool
    accumulate: str | None
    buffer_sync: str
    overlap_reduce: bool
    reduce_bucket_bytes: int
    compile: str | None = None  # torch.compile's backend; None: eager
    has_aux: bool = False  # loss_fn returns (output, aux)

    def secondary(self) -> Axis | None:
        """hpZ's axis, where the backward gathers a resharded unit from (None without
        hpZ). Made collectively on first use: by the step, once the ranks agreed on k."""
        if isinstance(self.reshard, bool):
            return None
        return self.mesh.secondary(self.reshard)

    def schedule(
        self, layout: ShardLayout, precision: Precision | None, hooked: Mapping[str, Any]
    ) -> Schedule:
        """The step's schedule for a state of `layout` and `precision` (`hooked`: its
        units entered by module hooks)."""
        prec = precision
        return plan(
            self.stage,
            layout,
            self.mesh.size,
            hooked,
            just_in_time=self.just_in_time,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            secondary=self.secondary(),
            quantize=self.quantize,
            overlap_reduce=self.overlap_reduce,
            reduce_bucket_bytes=self.reduce_bucket_bytes,
            accumulate_locally=self.accumulate == "local",
            comm_dtypes=(None, None) if prec is None else (prec.gather_dtype, prec.reduce_dtype),
        )


# `reduce_bucket_bytes=None`'s bursts: DDP's bucket_cap_mb, but smaller where a compiled
# step reduce-scatters in the graph (stages 1-3). At stage 3 the forward waits for each
# burst's gather before its units compute: on the CPU the benchmark GPT's 2.6 MB units
# stepped 1.03-1.5 x faster in 4 MiB bursts than in 25 MiB ones, and the deep model's
# 1.7 MB of tiny units still share one. At stages 1-2 the GPT's whole 21 MB of gradients
# was one burst, reduced after the backward with nothing left to overlap: 4 MiB bursts,
# on gloo as all-to-alls, took it from 1.18-1.23 x DDP to 1.12-1.13 x (eager 1.09-1.13).
# Stage 0's all-reduce gained nothing from them (docs/design.md, [Note: compiled steps]).
EAGER_BURST = 25 * 2**20
GRAPH_BURST = 4 * 2**20


def step_options(mesh: Mesh, stage: Any, **options: Any) -> StepOptions:
    """`sharded_step`'s options checked: a TypeError or ValueError naming the option
    otherwise. `options` are `sharded_step`'s keyword arguments but `stage`."""
    spec = stage_of(stage)
    accumulate = options["accumulate"]
    bucket = options["reduce_bucket_bytes"]
    buffer_sync = options["buffer_sync"]
    if accumulate not in (None, "local", "sharded"):
        raise ValueError(f"accumulate must be None, 'local' or 'sharded', got {accumulate!r}")
    compile_ = options.get("compile", False)
    if bucket is None:
        bucket = GRAPH_BURST if compile_ and spec.shards_optimizer else EAGER_BURST
    if isinstance(bucket, bool) or not isinstance(bucket, int):
        raise TypeError(f"reduce_bucket_bytes must be an int, got {bucket!r}")
    if bucket < 0:
        raise ValueError(f"reduce_bucket_bytes must be >= 0, got {bucket}")
    if buffer_sync not in ("broadcast", "mean", "local"):
        raise ValueError(f"buffer_sync must be 'broadcast', 'mean' or 'local', got {buffer_sync!r}")
    _check_quantize(options["quantize"], spec)
    reshard = options["reshard_after_forward"]
    if not isinstance(compile_, (bool, str)) or compile_ == "":
        raise TypeError(f"compile must be a bool or a torch.compile backend, got {compile_!r}")
    return StepOptions(
        mesh=mesh,
        stage=spec,
        layout=options["layout"],
        units=options["units"],
        module=options["module"],
        just_in_time=bool(options["just_in_time"]),
        reshard_after_forward=bool(reshard),
        reshard=_check_reshard(reshard, spec, mesh),
        quantize=options["quantize"],
        prefetch=options["prefetch"],
        ledger=options["ledger"],
        donate=options["donate"],
        accumulate=accumulate,
        buffer_sync=buffer_sync,
        overlap_reduce=options["overlap_reduce"],
        reduce_bucket_bytes=bucket,
        compile=("inductor" if compile_ is True else compile_) or None,
        has_aux=_check_has_aux(options.get("has_aux", False)),
    )


def _check_has_aux(has_aux: Any) -> bool:
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
    return has_aux


def _check_quantize(quantize: Any, stage: Stage) -> None:
    if quantize is None:
        return
    if not isinstance(quantize, QuantizedComm):
        raise TypeError(f"quantize must be a fzero.QuantizedComm, got {quantize!r}")
    quantize.check()
    if quantize.weights and stage.enter != "all_gather":
        raise ValueError(
            f"QuantizedComm(weights=True) quantizes stage 3's per-unit parameter all-gathers "
            f"(qwZ); stage {stage.number} has none (its parameters are gathered once after "
            f"the update, into the replicas the optimizer reads): use weights=False"
        )
    if quantize.grads and stage.reduce != "reduce_scatter":
        raise ValueError(
            "QuantizedComm(grads=True) quantizes gradient reduce-scatters (qgZ, stages 1-3); "
            "stage 0 all-reduces: use stage >= 1 or grads=False"
        )


def _check_reshard(reshard: Any, stage: Stage, mesh: Mesh) -> bool | int:
    """`reshard_after_forward` checked on this rank (its axis is made on the first step,
    once every rank agreed on it)."""
    if isinstance(reshard, bool):
        return reshard
    if not isinstance(reshard, int):
        raise TypeError(f"reshard_after_forward must be a bool or an int, got {reshard!r}")
    if not stage.shards_params:
        raise ValueError(
            f"reshard_after_forward={reshard} (hpZ's secondary copy) is for stage 3, whose "
            f"parameters are sharded; this step is stage {stage.number}"
        )
    if reshard < 1 or mesh.shard_size % reshard:
        raise ValueError(
            f"reshard_after_forward={reshard} must be the same int dividing the "
            f"{mesh.shard_size} ranks that shard (hpZ keeps a copy over groups of k of them)"
        )
    return reshard


def check_step_state(
    state: ShardedState,
    stage: int,
    layout: str | None,
    units: Sequence[UnitSpec] | None,
    mesh: Mesh,
    what: str = "step",
) -> None:
    """Raises unless a step for `stage` (and `layout`, `units`, `mesh`) can take `state`;
    `what` names the caller (a step, a forward)."""
    if not isinstance(state, ShardedState):
        raise TypeError(
            f"{what} expects the ShardedState from shard_state, got {type(state).__name__}"
        )
    check_live(state, mesh.rank, what)
    if state.stage != stage:
        raise ValueError(
            f"this step is for stage {stage}, the state was built for stage {state.stage}"
        )
    if layout is not None and layout != state.layout.kind:
        raise ValueError(f"this step is for layout {layout!r}, the state has {state.layout.kind!r}")
    if units is not None and members_of(units) != state.layout.members[1:]:
        raise ValueError(
            f"this step is for units {list(units)}, the state has {list(state.layout.specs)}"
        )
    if state.layout.world_size != mesh.shard_size:
        raise ValueError(
            f"the state is sharded over {state.layout.world_size} ranks, the mesh shards over "
            f"{mesh.shard_size}"
        )
    if isinstance(state.params, Shards) and state.params.rank != mesh.shard_rank:
        raise ValueError(
            f"the state's shards belong to shard {state.params.rank} of "
            f"{mesh.shard_size}, this is rank {mesh.rank} (shard {mesh.shard_rank})"
        )
