"""Turns the launcher's per-rank records into rows, tables, RESULTS.md and the memory plot."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import configs

from fzero import estimate_memory

MiB = 2**20


@dataclass
class Row:
    """One configuration of one model, aggregated over ranks (worst rank)."""

    model: str
    config: str
    label: str
    error: str | None = None
    step_s: float = float("nan")
    cpu_s: float = float("nan")  # process CPU time per step, all threads (slowest rank)
    load: float = float("nan")  # 1-minute load average when the configuration finished
    busy: bool = False  # load above the ranks' own: other processes shared the cores
    ratio: float = float("nan")
    cpu_ratio: float = float("nan")  # CPU s/step over DDP's: robust to other processes
    peak_mib: float = float("nan")  # high-water mark over the steps (setup excluded)
    base_mib: float = float("nan")  # RSS after the process group, before the model
    rise_mib: float = float("nan")  # peak over the RSS just before the first step
    transient_mib: float = float("nan")  # timed steps' peak over the RSS at rest before them
    setup_mib: float = float("nan")  # high-water mark of building and sharding the model
    reset: bool = True  # whether the high-water mark could be reset after the setup
    state: dict[str, int] | None = None
    formula: float = float("nan")
    comm: dict[str, float] | None = None  # bytes per op, mean over the steps
    comm_first: dict[str, float] | None = None  # the first step's
    comm_last: dict[str, float] | None = None  # the last step's
    psi: int = 0
    delta: float = float("nan")
    extras: dict[str, Any] | None = None
    fast: Row | None = None  # the same configuration timed with glibc's default allocator

    @property
    def state_total(self) -> int:
        return sum(self.state.values()) if self.state else 0


def aggregate(
    records: list[dict[str, Any]], world_size: int, warmup: int
) -> tuple[list[Row], dict[str, dict[str, Any]]]:
    """Rows for every configuration, and the single-process reference per model."""
    refs = {r["model"]: r["ranks"][0] for r in records if r["config"] == "reference"}
    for r in records:  # world size 1 and the interleaved runs, kept with the reference
        if (r["config"] == "ws1" or r["config"].startswith("interleaved:")) and r["model"] in refs:
            refs[r["model"]][r["config"]] = r["launches"]
    rows = []
    for rec in records:
        if rec["config"] in ("reference", "ws1") or rec["config"].startswith("interleaved:"):
            continue
        cfg = configs.BY_NAME[rec["config"]]
        row = Row(rec["model"], cfg.name, cfg.label)
        errors = [r["error"] for r in rec["ranks"] if "error" in r]
        if errors:
            row.error = errors[0].strip()
            rows.append(row)
            continue
        ranks = rec["ranks"]
        per_step = [max(ts) for ts in zip(*(r["times"] for r in ranks))]
        row.step_s = statistics.median(per_step[warmup:])
        per_cpu = [max(cs) for cs in zip(*(r["cpu"] for r in ranks))]
        row.cpu_s = statistics.median(per_cpu[warmup:])
        row.load = rec.get("load", float("nan"))
        row.busy = row.load > world_size + 0.5
        row.peak_mib = max(r["rss_peak_kib"] for r in ranks) / 1024
        row.base_mib = max(r["rss_base_kib"] for r in ranks) / 1024
        row.rise_mib = max(r["rss_peak_kib"] - r["rss_before_kib"] for r in ranks) / 1024
        row.transient_mib = max(r["rss_steady_peak_kib"] - r["rss_rest_kib"] for r in ranks) / 1024
        row.setup_mib = max(r["rss_setup_peak_kib"] for r in ranks) / 1024
        row.reset = all(r["hwm_reset"] for r in ranks)
        row.state = max((r["state"] for r in ranks), key=lambda s: sum(s.values()))
        row.psi = refs[rec["model"]]["psi"]
        row.formula = estimate_memory(
            row.psi, world_size, cfg.stage, param_bytes=4, grad_bytes=4, optim_bytes=8
        ).total
        row.delta = max(r["max_delta"] for r in ranks)
        if "comm_per_step" in ranks[0]:
            row.comm = ranks[0]["comm_per_step"]
            row.comm_first, row.comm_last = ranks[0]["comm_first_step"], ranks[0]["comm_last_step"]
            row.extras = {
                k: max(r[k] for r in ranks)
                for k in (
                    "ledger_peak_params",
                    "ledger_peak_grads",
                    "largest_unit_bytes",
                    "root_unit_bytes",
                )
            }
            row.extras["units"] = ranks[0]["units"]
        rows.append(row)
    for model in {r.model for r in rows}:
        ddp = next((r for r in rows if r.model == model and r.config == "ddp"), None)
        for r in rows:
            if r.model == model and ddp is not None and not ddp.error:
                r.ratio = r.step_s / ddp.step_s
                r.cpu_ratio = r.cpu_s / ddp.cpu_s
    return rows, refs


def attach_speed(rows: list[Row], fast: list[Row]) -> None:
    """Hangs each configuration's default-allocator timing (pass 2) on its pass-1 row."""
    by = {(r.model, r.config): r for r in fast}
    for r in rows:
        r.fast = by.get((r.model, r.config))


@dataclass
class Launch:
    """One fresh launch of configurations stepped in turn: per configuration, the median
    s/step (each step the slowest rank's) and the median page faults per step (rank 0)."""

    step_s: dict[str, float]
    faults: dict[str, float]


def _launches(
    refs: dict[str, dict[str, Any]], fast: dict[str, dict[str, Any]] | None, key: str, warmup: int
) -> Iterator[tuple[str, str, list[Launch] | str]]:
    """Per model and allocator: every launch stored under `key`, or the first error."""
    for label, source in (("default malloc", fast), ("mmap ≥ 64 KiB", refs)):
        for model, ref in (source or {}).items():
            launches = ref.get(key)
            if not launches:
                continue
            errors = [r["error"] for ranks in launches for r in ranks if "error" in r]
            if errors:
                yield model, label, f"failed: {errors[0].splitlines()[-1]}"
                continue
            out = []
            for ranks in launches:
                times = [r["times"] for r in ranks]
                out.append(
                    Launch(
                        {
                            c: statistics.median(
                                [max(ts) for ts in zip(*(t[c] for t in times))][warmup:]
                            )
                            for c in times[0]
                        },
                        {c: statistics.median(f[warmup:]) for c, f in ranks[0]["faults"].items()},
                    )
                )
            yield model, label, out


def _compare(runs: list[Launch], ref: str, new: str, bound: float) -> list[str]:
    """Table cells: medians over launches, each launch's ratio, faults, and the verdict on
    the median of the launches' ratios."""
    ratios = [r.step_s[new] / r.step_s[ref] for r in runs]
    med = statistics.median(ratios)
    return [
        f"{statistics.median(r.step_s[ref] for r in runs):.3f}",
        f"{statistics.median(r.step_s[new] for r in runs):.3f}",
        " / ".join(f"{x:.2f}" for x in ratios),
        f"{statistics.median(r.faults[ref] for r in runs):,.0f} / "
        f"{statistics.median(r.faults[new] for r in runs):,.0f}",
        f"**{med:.2f}**",
        _verdict(med, bound),
    ]


def _compare_head(ref: str) -> list[str]:
    return [
        f"| model | allocator | target | {ref} s/step | fzero s/step | ratio in each launch "
        f"| page faults/step, {ref} / fzero | median ratio | verdict |",
        "|---|---|---|---:|---:|---|---:|---:|---|",
    ]


def functional_cost(
    refs: dict[str, dict[str, Any]], fast: dict[str, dict[str, Any]] | None, warmup: int
) -> list[str]:
    """Issue 7's world-size-1 target: fzero stage 0 against a plain eager loop."""
    out = _compare_head("eager")
    for model, label, runs in _launches(refs, fast, "ws1", warmup):
        target = "stage 0 ≤ 1.10 × eager"
        if isinstance(runs, str):
            out.append(f"| {model} | {label} | {target} | {runs} | | | | | |")
            continue
        out.append(
            f"| {model} | {label} | {target} | "
            + " | ".join(_compare(runs, "eager", "fzero0", 1.10))
            + " |"
        )
    return out


def interleaved(
    refs: dict[str, dict[str, Any]],
    fast: dict[str, dict[str, Any]] | None,
    warmup: int,
    world_size: int,
) -> list[str]:
    """Issue 7's stage 0 and stage 1 targets and issue 16's against DDP, each pair of
    configurations stepped in turn."""
    out = _compare_head("reference")
    names = {"ddp": "DDP", "zero": "ZeroRedundancyOptimizer"}
    for ref_cfg, fz_cfg, bounds in configs.INTERLEAVED_PAIRS:
        bound = configs.pair_bound(bounds, world_size)
        scale = "" if bound == 1 else f"{bound:g} × "
        target = f"stage {fz_cfg[-1]} ≤ {scale}{names.get(ref_cfg, ref_cfg)}"
        for model, label, runs in _launches(refs, fast, f"interleaved:{ref_cfg}+{fz_cfg}", warmup):
            if isinstance(runs, str):
                out.append(f"| {model} | {label} | {target} | {runs} | | | | | |")
                continue
            out.append(
                f"| {model} | {label} | {target} | "
                + " | ".join(_compare(runs, ref_cfg, fz_cfg, bound))
                + " |"
            )
    return out


def _verdict(ratio: float, bound: float) -> str:
    return "met" if ratio <= bound else f"MISSED by {ratio / bound - 1:.0%}"


def _psi_units(row: Row) -> str:
    if not row.comm:
        return "n/a"
    unit = row.psi * 4
    parts = {
        op: sum(v for k, v in row.comm.items() if k.startswith(op)) / unit
        for op in ("all_gather", "reduce_scatter", "all_reduce")
    }
    total = sum(parts.values())
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    detail = " ".join(f"{short[k]} {v:.2f}" for k, v in parts.items() if v)
    return f"{total * unit / MiB:.1f} MiB = {total:.2f}Ψ ({detail})"


def _fmt(x: float, spec: str) -> str:
    return "—" if x != x else format(x, spec)


def _failed(r: Row, width: int) -> str:
    msg = (r.error or "").splitlines()[-1].replace("|", "/")[:150]
    if r.config == "fairscale-fsdp" and ("all_gather" in msg or "CUDA" in msg):
        msg = f"needs CUDA: {msg}"
    return f"| {r.label} | failed: {msg} |" + " |" * (width - 2)


def _speed(r: Row | None) -> str:
    if r is None:
        return "— | — | — | —"
    if r.error:
        return "failed | | |"
    busy = " ⚠" if r.busy else ""
    return f"{r.step_s:.3f} | {_fmt(r.ratio, '.2f')} | {r.cpu_s:.3f} | {r.load:.1f}{busy}"


def speed_table(rows: list[Row]) -> list[str]:
    """Markdown lines: step times of one model's configurations, both allocator settings."""
    out = [
        "| configuration | step s, default malloc | × DDP | CPU s/step | load "
        "| step s, mmap ≥ 64 KiB | × DDP | CPU s/step | load "
        "| comm/step (fzero's logical bytes) | max abs Δ vs 1 process |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if r.error:
            out.append(_failed(r, 11))
            continue
        out.append(
            f"| {r.label} | {_speed(r.fast)} | {_speed(r)} | {_psi_units(r)} | {r.delta:.1e} |"
        )
    return out


def memory_table(rows: list[Row]) -> list[str]:
    """Markdown lines: per-rank memory of one model's configurations (pass 1)."""
    out = [
        "| configuration | peak RSS MiB/rank | peak − pre-step | per-step transient "
        "| setup peak | model state MiB/rank (p + g + o) | ZeRO formula | vs formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.error:
            out.append(_failed(r, 8))
            continue
        s = r.state or {}
        state = (
            f"{r.state_total / MiB:.1f} ({s['params'] / MiB:.1f} + {s['grads'] / MiB:.1f}"
            f" + {s['opt'] / MiB:.1f})"
        )
        out.append(
            f"| {r.label} | {r.peak_mib:.0f}{'' if r.reset else '*'} | {r.rise_mib:.0f} "
            f"| {r.transient_mib:.0f} | {r.setup_mib:.0f} | {state} "
            f"| {r.formula / MiB:.1f} | {r.state_total / r.formula - 1:+.1%} |"
        )
    return out


def bounds_table(rows: list[Row]) -> list[str]:
    """Issue 3's bounds for fzero stages 2 and 3, against the UnitLedger's peaks.

    fzero runs with overlap_reduce=True (its default): one unit's reduce-scatter stays in
    flight while the next unit differentiates, so two units of full gradients are the
    bound (one with overlap_reduce=False, checked in tests/engine/test_units.py). The root unit is
    gathered before the forward and kept for the step, so stage 3's bound includes it.
    """
    out = [
        "| model | configuration | own shards MiB | peak full-unit params MiB "
        "| bound: 2 × largest unit (+ root) | peak full-unit grads MiB "
        "| bound: 2 × largest unit (one in flight) "
        "| measured total MiB | bound total MiB | met | RSS per-step transient MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if r.error or not r.extras or not r.config.startswith(("fzero2", "fzero3")):
            continue
        s, e = r.state or {}, r.extras
        unit = e["largest_unit_bytes"]
        if r.config == "fzero2":  # gradient bytes only: params are replicated at stage 2
            own, pmeas, pbound = s["grads"], "—", "—"
            measured, bound = own + e["ledger_peak_grads"], own + 2 * unit
        else:
            own, root = r.state_total, e["root_unit_bytes"]
            measured = own + e["ledger_peak_params"] + e["ledger_peak_grads"]
            bound = own + 2 * unit + root + 2 * unit
            pbound = f"{(2 * unit + root) / MiB:.2f}"
            pmeas = f"{e['ledger_peak_params'] / MiB:.2f}"
        over = measured - bound
        if r.config == "fzero3-keep":
            met = f"n/a: keeps every unit until its backward (+{over / MiB:.2f} MiB)"
        elif over <= 0:
            met = "yes"
        else:
            met = f"NO, by {over:,} B"
        out.append(
            f"| {r.model} | {r.label} | {own / MiB:.2f} | {pmeas} | {pbound} "
            f"| {e['ledger_peak_grads'] / MiB:.2f} | {2 * unit / MiB:.2f} "
            f"| {measured / MiB:.2f} | {bound / MiB:.2f} | {met} "
            f"| {r.transient_mib:.0f} |"
        )
    return out


def targets(rows: list[Row]) -> list[str]:
    """Issue 7's targets, met or missed, per model (speed under both allocator settings)."""
    out = [
        "| model | target | wall time, default malloc | CPU time, default malloc "
        "| wall time, mmap ≥ 64 KiB |",
        "|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        out += _model_targets(
            model, {r.config: r for r in rows if r.model == model and not r.error}
        )
    return out


def _model_targets(model: str, by: dict[str, Row]) -> list[str]:
    out: list[str] = []

    def ratio(name: str, variant: str) -> float:
        r = by[name] if variant == "mmap" else by[name].fast
        if r is None or r.error:
            return float("nan")
        return r.cpu_ratio if variant == "cpu" else r.ratio

    def check(name: str, lhs: str, rhs: str | None, limit: float = 1.0) -> None:
        if lhs not in by or (rhs is not None and rhs not in by):
            out.append(f"| {model} | {name} | not measured | | |")
            return
        cells = []
        for variant in ("wall", "cpu", "mmap"):
            want = limit * (ratio(rhs, variant) if rhs else 1.0)
            got = ratio(lhs, variant)
            cells.append(
                "—"
                if got != got or want != want
                else f"{got:.2f} vs {want:.2f} ({got / want - 1:+.0%}): "
                f"{'met' if got <= want else 'MISSED'}"
            )
        out.append(f"| {model} | {name} | {' | '.join(cells)} |")

    check("fzero stage 0 ≤ 1.05 × DDP", "fzero0", None, 1.05)
    check("fzero stage 1 ≤ ZeroRedundancyOptimizer", "fzero1", "zero")
    check("fzero stage 2 ≤ FSDP2 keep (ZeRO-2-like)", "fzero2", "fsdp2-keep")
    check("fzero stage 3 reshard ≤ FSDP2 reshard", "fzero3", "fsdp2")
    check("fzero stage 3 keep ≤ FSDP2 keep", "fzero3-keep", "fsdp2-keep")
    for name, r in by.items():
        if name.startswith("fzero"):
            off = r.state_total / r.formula - 1
            verdict = "met" if abs(off) <= 0.01 else "MISSED"
            out.append(
                f"| {model} | {r.label}: model state within 1 % of formula "
                f"| {off:+.2%}: {verdict} | (same) | (same) |"
            )

    def psi(r: Row, comm: dict[str, float]) -> float:
        return sum(v for k, v in comm.items() if not k.startswith("broadcast")) / (r.psi * 4)

    for name, want in (("fzero0", 2), ("fzero1", 2), ("fzero2", 2), ("fzero3-keep", 2)):
        if name in by and by[name].comm:
            got = psi(by[name], by[name].comm)
            verdict = "met" if abs(got - want) <= 0.01 * want else "MISSED"
            out.append(
                f"| {model} | {by[name].label}: {want}Ψ communicated per step "
                f"| {got:.3f}Ψ: {verdict} | (same) | (same) |"
            )
    r3 = by.get("fzero3")
    if r3 is not None and r3.comm_first and r3.comm_last:
        # About ZeRO's 3Ψ on the first step, which gathers every unit again for the
        # backward but those it does not use (the embeddings); from the second, the
        # forward's last units stay gathered for it (`keep_last`).
        first, last = psi(r3, r3.comm_first), psi(r3, r3.comm_last)
        verdict = "met" if 2.9 <= first <= 3 and 2 < last < first else "MISSED"
        out.append(
            f"| {model} | {r3.label}: 3Ψ communicated on the first step, less from the "
            f"second (the forward's last units kept) | {first:.3f}Ψ, then {last:.3f}Ψ:"
            f" {verdict} | (same) | (same) |"
        )
    return out


def plot(rows: list[Row], path: Path) -> None:
    """Per-rank peak RSS above the pre-model baseline, and model-state bytes, by config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(len(models), 1, figsize=(11, 4.2 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r.model == model]
        xs = range(len(mine))
        rss = [0 if r.error else r.peak_mib - r.base_mib for r in mine]
        step = [0 if r.error else r.transient_mib for r in mine]
        state = [0 if r.error else r.state_total / MiB for r in mine]
        ax.bar(
            [x - 0.27 for x in xs],
            rss,
            0.27,
            label="peak RSS over the steps − RSS before the model was built",
        )
        ax.bar(list(xs), state, 0.27, label="model state (params + grads + optimizer)")
        ax.bar([x + 0.27 for x in xs], step, 0.27, label="per-step transient (peak − RSS at rest)")
        for x, r in zip(xs, mine):
            if r.error:
                ax.text(x, 0, "failed /\nn.a.", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [r.config for r in mine], rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("MiB per rank")
        ax.set_title(f"{model}: memory per rank (worst rank)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
