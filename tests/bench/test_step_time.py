"""benchmarks/step_time.py: the A/B timing script runs, on the fzero its PYTHONPATH names."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_script_times_both_ranks_of_the_checkout_it_is_given() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--quick"]
    cmd += ["--steps", "2", "--warmup", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    source, _, times = done.stdout.strip().splitlines()[-1].partition(" ")
    assert Path(source) == ROOT, source
    ranks = re.findall(r"cpu (\d+\.\d) ms wall (\d+\.\d) ms", times)
    assert len(ranks) == 2 and all(float(c) > 0 and float(w) > 0 for c, w in ranks), times


@pytest.mark.multiprocess
def test_the_clip_and_scaler_benchmark_runs() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "clip_scale.py"
    out = subprocess.run(
        [sys.executable, str(script), "--quick", "--stages", "0,3", "--steps", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [r[0] for r in rows] == ["0", "3"] and all(float(r[1]) > 0 for r in rows), out.stdout


@pytest.mark.multiprocess
def test_the_call_check_benchmark_times_both_stages() -> None:
    script = ROOT / "benchmarks" / "call_check.py"
    out = subprocess.run(
        [sys.executable, str(script), "--blocks", "2", "--steps", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"stage (\d): (\d+\.\d+) ms a step checked, (\d+\.\d+) ms not", out.stdout)
    assert [r[0] for r in rows] == ["0", "3"], out.stdout
    assert all(float(on) > 0 and float(off) > 0 for _, on, off in rows), out.stdout
