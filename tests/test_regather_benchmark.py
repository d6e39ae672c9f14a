"""benchmarks/regather.py: its floor moves the bytes fzero's resharding adds, and it runs.

The script's verdict compares "DDP plus the re-gathers' collectives" with fzero's stage 3
resharding against keeping its units. That comparison means something only if the floor
gathers again exactly what fzero gathers again: the same buffers, nothing more or less.
"""

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from support import run

import fzero

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _bytes_a_step(mesh: fzero.Mesh) -> dict[str, Any]:
    """Bytes the floor broadcasts in its second step (the full buffers it gathers again),
    and fzero's all-gather bytes (its ledger) in the second step of stage 3 resharding and
    keeping (from the second step on, the forward's last units are known and kept)."""
    sys.path.insert(0, str(BENCH))
    import configs
    import models
    import regather

    spec = models.spec("gpt", True, 1)
    sent: list[int] = []
    real = dist.broadcast

    def counted(t: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(t.numel() * t.element_size())
        return real(t, *args, **kwargs)

    out: dict[str, Any] = {}
    dist.broadcast = counted
    try:
        floor = regather._ddp_regather(spec, models.build_model(spec), mesh.rank, mesh.size)
        for t in range(2):
            sent.clear()
            floor(models.rank_batch(spec, t, mesh.rank, mesh.size))
        out["floor"] = sum(sent)
    finally:
        dist.broadcast = real
    for name in ("fzero3", "fzero3-keep"):
        step = configs.build(configs.BY_NAME[name], spec, models.build_model(spec)).step
        for t in range(2):
            with fzero.comm_ledger() as ledger:
                step(models.rank_batch(spec, t, mesh.rank, mesh.size))
        out[name] = ledger.by_op(data_only=True)["all_gather:float32"]
    return out


def test_the_floor_gathers_again_what_fzero_gathers_again() -> None:
    for got in run(2, _bytes_a_step):
        assert got["fzero3"] > got["fzero3-keep"] > 0, got
        assert got["floor"] == got["fzero3"] - got["fzero3-keep"], got


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
