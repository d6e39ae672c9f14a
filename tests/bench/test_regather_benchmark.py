"""benchmarks/regather.py: its floor moves the bytes fzero's resharding adds, and it runs.

The script's verdict compares "DDP plus the re-gathers' collectives" with fzero's stage 3
resharding against keeping its units. That comparison means something only if the floor
gathers again exactly what fzero gathers again: the same buffers, nothing more or less.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fzero
from tests.support import run

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _bytes_a_step(mesh: fzero.Mesh) -> dict[str, Any]:
    """Second-step bytes (from the second step on, the forward's last units are known and
    kept): what each floor's bare re-gathers gathered (full buffers), and fzero's
    all-gathers at stage 3 resharding and keeping, from its ledger."""
    sys.path.insert(0, str(BENCH))
    import models
    import regather

    spec = models.spec("gpt", True, 1)
    out: dict[str, Any] = {}
    for name in regather.NAMES:
        step, sent = regather.build(name, spec, mesh.rank, mesh.size)
        for t in range(2):
            sent.clear()
            with fzero.comm_ledger() as ledger:
                step(models.rank_batch(spec, t, mesh.rank, mesh.size))
        out[name] = (sum(sent), ledger.by_op(data_only=True).get("all_gather:float32", 0))
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_floors_gather_again_what_fzero_gathers_again() -> None:
    for got in run(2, _bytes_a_step):
        again = got["fzero3"][1] - got["fzero3-keep"][1]
        assert got["fzero3-keep"][1] > 0 and again > 0, got
        assert got["ddp+regather"] == (again, 0), got
        assert got["fzero3-keep+regather"] == (again, got["fzero3-keep"][1]), got
        assert got["ddp"] == (0, 0) and got["fzero3"][0] == got["fzero3-keep"][0] == 0, got


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_script_runs_small(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS-regather.md"
    cmd = [sys.executable, str(BENCH / "regather.py"), "--quick", "--launches", "1"]
    cmd += ["--steps", "3", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert "| **median** |" in text, text
    for name in ("ddp", "ddp+regather", "fzero3-keep", "fzero3"):
        assert f"\n| {name} | " in text, text
