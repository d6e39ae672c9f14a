"""Every notebook in notebooks/ runs top to bottom in a fresh kernel; a failing cell fails."""

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))

# Each notebook is written to run in well under a minute on two cores; this leaves room for
# a busy CI machine and still fails a hung collective long before pytest's own ceiling.
TIMEOUT = 300


@contextlib.contextmanager
def kernel_spec(jupyter_dir: Path, env: dict[str, str]) -> Iterator[str]:
    """A kernel spec running this interpreter (the venv under test), found first on the path.

    The stock "python3" spec resolves through the user's Jupyter paths, which may point at
    another Python; this one pins `sys.executable`. It is found through JUPYTER_PATH, so
    nbclient creates (and so shuts down and closes) the kernel manager itself.
    """
    spec = jupyter_dir / "kernels" / "fzero-test"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "fzero tests", "language": "python", "env": env}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    before = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(jupyter_dir), before]))
    try:
        yield "fzero-test"
    finally:
        if before is None:
            del os.environ["JUPYTER_PATH"]
        else:
            os.environ["JUPYTER_PATH"] = before


def execute(path: Path, jupyter_dir: Path, env: dict[str, str]) -> nbformat.NotebookNode:
    """Runs the notebook at `path` in its own directory; raises CellExecutionError on a failure."""
    nb = nbformat.read(path, as_version=4)
    with kernel_spec(jupyter_dir, env) as name:
        client = NotebookClient(
            nb,
            kernel_name=name,
            timeout=TIMEOUT,
            allow_errors=False,
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    return nb


def test_notebooks_exist_and_are_stored_with_their_outputs() -> None:
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
        counts = [c.execution_count for c in code]
        # Executed top to bottom in one kernel, then saved: counts run 1, 2, 3, ...
        assert counts == list(range(1, len(code) + 1)), f"{path.name}: run it and save: {counts}"


@pytest.mark.multiprocess
def test_a_failing_cell_fails_and_plots_use_agg(tmp_path: Path) -> None:
    cells = [
        "import matplotlib\nassert matplotlib.get_backend().lower() == 'agg'",
        "raise ValueError('boom')",
        "print('never runs')",
    ]
    path = tmp_path / "broken.ipynb"
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path
    )
    with pytest.raises(CellExecutionError, match="boom"):
        execute(path, tmp_path / "jupyter", {"MPLBACKEND": "Agg"})


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    # Agg: figures render without a display; the stored outputs were made with ipykernel's
    # inline backend, which runs the same plotting code and also embeds the PNGs.
    # A notebook's hypothesis examples go to a scratch database, not notebooks/.hypothesis.
    env = {"MPLBACKEND": "Agg", "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hypothesis")}
    nb = execute(path, tmp_path / "jupyter", env)
    ran = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert ran and all(c.execution_count is not None for c in ran)
