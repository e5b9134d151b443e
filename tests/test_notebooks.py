"""Every notebook in notebooks/ runs end to end without a cell error."""

import os
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_quickstart.ipynb", "02_exploring_plans.ipynb", "03_model_zoo.ipynb"} <= set(names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, (
                f"{path.name}: clear outputs before committing (python notebooks/make_notebooks.py)")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # The kernel is this interpreter (jupyter_client maps the python3 spec's "python" to
    # sys.executable), started in the notebook's folder without the test's XLA_FLAGS: the
    # notebook's first cell must set up its own devices.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    started = time.perf_counter()
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed\n{e}")
    seconds = time.perf_counter() - started
    sys.stderr.write(f"{path.name}: {seconds:.1f} s\n")
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
