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
