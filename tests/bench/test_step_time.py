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
