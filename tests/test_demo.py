"""`python -m fzero demo` trains every stage and agrees with the single-process reference."""

import pytest

from fzero.__main__ import main


def test_demo_matches_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--world-size", "3", "--steps", "4", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in map(str.split, out.splitlines()) if len(r) == 8 and r[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    for row in rows:
        assert float(row[2]) < 1e-9  # max |delta| against torch.optim.AdamW on one process


def test_demo_rejects_bad_flags() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--world-size", "0"])
    assert exc.value.code == 2
