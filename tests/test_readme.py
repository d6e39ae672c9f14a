"""The README's commands and quickstart are what CI and users really run."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    commands = [
        ln for b in _blocks("bash") for ln in b.splitlines() if ln and not ln.startswith("#")
    ]
    assert len(commands) == 2, "the README gives exactly two commands: the demo and the tests"
    demo, tests = commands
    assert demo.endswith("python -m fzero demo") and tests.endswith("python -m pytest")
    ci = [
        ln
        for ln in (ROOT / ".ci" / "run").read_text().splitlines()
        if ln and not ln.startswith("#")
    ]
    assert tests in ci, ".ci/run must run the README's test command verbatim"
    for cmd in commands:  # the CPU torch pin comes before anything that could pull torch
        assert cmd.index("torch==2.13.0") < cmd.index("-e ")


@pytest.mark.multiprocess
def test_quickstart_runs() -> None:
    quickstart = _blocks("python")[0]
    namespace: dict = {"__name__": "readme"}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    assert len(namespace["results"]) == 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_demo_prints_the_table_the_readme_shows(capfd: pytest.CaptureFixture[str]) -> None:
    """The README's demo table, but for the times and the float deltas (last digits move
    with the CPU's kernels): the losses and the bytes held and sent are what the demo
    prints today (the comm column drifted once, when the ranks began agreeing on calls)."""
    from fzero.__main__ import main

    def rows(text: str) -> list[list[str]]:
        table = [ln.split() for ln in text.splitlines()]
        return [[r[0], r[1], *r[3:9]] for r in table if len(r) == 10 and r[0].isdigit()]

    shown = rows(README)
    assert [r[0] for r in shown] == ["0", "1", "2", "3"], shown
    assert main(["demo", "--no-progress"]) == 0
    assert rows(capfd.readouterr().out) == shown
