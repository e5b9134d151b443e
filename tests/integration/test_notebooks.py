"""Every notebook in notebooks/ runs end to end without a cell error."""

import json
import os
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


@pytest.fixture
def this_interpreter_kernel(tmp_path, monkeypatch):
    """A ``python3`` kernelspec for this interpreter, found before any other installed one
    (a python3 spec registered for another Python would not have autoshard)."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    return "python3"


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_quickstart.ipynb", "02_exploring_plans.ipynb", "03_model_zoo.ipynb"} <= set(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name}: store it without outputs (python notebooks/make_notebooks.py)")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, this_interpreter_kernel):
    nb = nbformat.read(path, as_version=4)
    # The kernel runs this interpreter in the notebook's folder, without the test's
    # XLA_FLAGS: the notebook's first cell must set up its own devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S,
                                     kernel_name=this_interpreter_kernel,
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed\n{e}")
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
