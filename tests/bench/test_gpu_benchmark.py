"""benchmarks/gpu.py, run small on the CPU: the script a lent GPU runs must not rot here.

A GPU is lent rarely and briefly; a benchmark that fails there wastes it. This runs the
script's `--smoke` mode (a tiny GPT on the CPU, gloo) through the same row processes, and
checks what its tables claim: fp32 rows that start from the same values and see the same
tokens end bitwise equal to the eager loop (fzero's model is built on meta and initialised
by `fzero.init.from_module`), and world size 2 ends close to it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def smoke_rows(tmp_path: Path, only: str, ws2_steps: int) -> tuple[dict[str, str], str]:
    """gpu.py's `--smoke` run of the rows `only` matches: the fp32 table's rows (label ->
    max abs delta against the eager loop), and the whole results file."""
    out = tmp_path / "RESULTS-gpu.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--steps", "2"]
    cmd += ["--warmup", "1", "--ws2-steps", str(ws2_steps), "--out", str(out), "--only", only]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    fp32 = text[text.index("## fp32") : text.index("## bf16")]
    rows = {m[0]: m[1] for m in re.findall(r"^\| ([^|]+?) \|.*\| ([0-9.e+-]+) \|$", fp32, re.M)}
    return rows, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_benchmark_runs_small_on_the_cpu(tmp_path: Path) -> None:
    only = "fp32 (DDP|FSDP2 \\(per block, reshard\\)$|fzero stage [03](?!, compiled))"
    rows, text = smoke_rows(tmp_path, only, ws2_steps=2)
    want = ["eager (fused AdamW)", "DDP", "FSDP2 (per block, reshard)"]
    want += ["fzero stage 0", "fzero stage 3", "fzero stage 3 (keep)"]
    assert list(rows) == want, text
    assert all(float(d) == 0.0 for d in rows.values()), text  # bitwise the eager loop
    ws2 = re.findall(r"^\| ([0-3]) \| ([0-9.e+-]+) \|$", text, re.M)
    assert [s for s, _ in ws2] == ["0", "1", "2", "3"], text
    assert all(0 < float(d) < 1e-4 for _, d in ws2), ws2  # trained alike, not bitwise


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_benchmarks_compiled_rows_run_small_on_the_cpu(tmp_path: Path) -> None:
    """Issue 50's rows: the eager loop with its module compiled, and fzero stages 0 and 3
    compiled (stage 3 also through its module hooks), train as the eager loop does to
    float32's reassociation."""
    only = "fp32 (eager, compiled|fzero stage [03], compiled)"
    rows, text = smoke_rows(tmp_path, only, ws2_steps=0)
    want = ["eager (fused AdamW)", "eager, compiled"]
    want += ["fzero stage 0, compiled", "fzero stage 3, compiled"]
    want += ["fzero stage 3, compiled, module hooks"]
    assert list(rows) == want, text
    assert all(float(d) < 1e-4 for d in rows.values()), text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_world_size_two_section_runs_the_stages_asked_for(tmp_path: Path) -> None:
    """`--ws2-stages` (a lent GPU's call may have time for one stage): those stages, in
    order, and nothing for a stage that does not exist."""
    out = tmp_path / "RESULTS-gpu.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--steps", "1"]
    cmd += ["--warmup", "0", "--ws2-steps", "1", "--only", "^$", "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--ws2-stages", "31"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ws2 = re.findall(r"^\| ([0-3]) \| ([0-9.e+-]+) \|$", out.read_text(), re.M)
    assert [s for s, _ in ws2] == ["1", "3"], ws2
    bad = subprocess.run(
        [*cmd, "--ws2-stages", "4"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert bad.returncode != 0 and "--ws2-stages" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stage_3_under_bf16_holds_between_steps_what_fsdp2_holds() -> None:
    """benchmarks/peak_cpu.py's measurement (torch.profiler's allocation events, not
    fzero's accounting), on gpu.py's tiny GPT: after two bf16 steps fzero's stage 3 holds
    FSDP2's fp32 shard and AdamW moments, and no bf16 shard beside them (2 bytes a
    parameter more, +17 % of these bytes, before the shard became the master)."""
    script = str(ROOT / "benchmarks" / "peak_cpu.py")
    got = {}
    for name in ("FSDP2 (per block, reshard)", "fzero stage 3"):
        cmd = [sys.executable, script, "--row", name, "--smoke", "--steps", "2"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        got[name] = json.loads(done.stdout.strip().splitlines()[-1])
    fsdp, ours = got["FSDP2 (per block, reshard)"], got["fzero stage 3"]
    assert 0.97 * fsdp["end"] <= ours["end"] <= 1.03 * fsdp["end"], got
    assert ours["peak"] > ours["end"] > 0, got


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_gpu_offload_benchmark_runs_small_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/offload_gpu.py's `--smoke` rows of model A: fzero offloaded (overlapped,
    after the backward, half) ends bitwise fzero on the device, and with the fused host
    AdamW within float32's rounding of it; FSDP2's CPUOffloadPolicy row runs and is
    compared."""
    out = tmp_path / "RESULTS-offload.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "offload_gpu.py"), "--smoke"]
    cmd += ["--steps", "2", "--warmup", "2", "--only", "^A ", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| ([^|]+?) \|.*\| ([0-9.e+-]+) \|$", text, re.M)}
    fzero_rows = [r for r in rows if r.startswith("fzero")]
    assert len(fzero_rows) == 6 and "FSDP2, CPUOffloadPolicy" in rows, text
    for r in fzero_rows:  # bitwise the device's; fused, the fp32 masters to its rounding
        assert float(rows[r]) <= (1e-6 if "fused" in r else 0.0), text
