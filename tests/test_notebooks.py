"""The notebooks of notebooks/ execute top to bottom, plot inline, and print what they claim.

    python -m pytest tests/test_notebooks.py -q -p no:cacheprovider --durations=5

Each runs in a fresh `python3` kernel (ipykernel) of this interpreter, started in notebooks/ as
Jupyter would; the notebooks find the repository root themselves. The kernel does not inherit
conftest's XLA_FLAGS (8 host devices, batch-invariant flags): a notebook sets the flags it
needs, as a user's would, and runs on one CPU device. The notebooks `assert` their claims
(identical tokens with and without SD, xla diff > 0 and batch_invariant diff == 0, ...), so a
broken claim fails the cell; the checks here read the printed facts back.
"""

from __future__ import annotations

import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
CELL_TIMEOUT_S = 300

# Facts each notebook prints (its asserts guard the same claims).
EXPECTED = {
    "quickstart": ["identical tokens and log-probs with and without SD: True", "accept length:"],
    "batch_invariance": [
        "rows bitwise equal at every batch size: xla False | batch_invariant True",
        "sampler log-probs == trainer log-probs, bitwise: xla False | batch_invariant True"],
    "long_tail": ["decode time with < 25% of 64 slots live", "(matches simulation.json)",
                  "same tokens, rewards and parameters in all variants: True"],
}


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
  """Environment for the kernels: a `python3` kernelspec that is this interpreter, no XLA_FLAGS."""
  spec_dir = tmp_path_factory.mktemp("jupyter") / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "Python 3 (tlt-jax tests)", "language": "python"}))
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "MPLBACKEND")}
  env["JUPYTER_PATH"] = str(spec_dir.parent.parent)  # searched before user and system specs
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  return env


def _execute(name: str, env: dict, monkeypatch) -> nbformat.NotebookNode:
  with open(os.path.join(NOTEBOOKS, f"{name}.ipynb"), encoding="utf-8") as f:
    nb = nbformat.read(f, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
      f"{name}.ipynb is committed with outputs: run `python notebooks/make_notebooks.py`")
  monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])  # the spec lookup runs in this process
  client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                          resources={"metadata": {"path": NOTEBOOKS}})
  client.execute(env=env)  # raises CellExecutionError, with the traceback, if a cell fails
  return nb


def _outputs(nb):
  for cell in nb.cells:
    if cell.cell_type == "code":
      yield from cell.outputs


@pytest.mark.parametrize("name", list(EXPECTED))
def test_notebook_executes_and_shows_its_results(name, kernel_env, monkeypatch):
  nb = _execute(name, kernel_env, monkeypatch)
  outputs = list(_outputs(nb))
  assert not [o for o in outputs if o.output_type == "error"]
  images = [o for o in outputs if o.output_type in ("display_data", "execute_result")
            and "image/png" in o.get("data", {})]
  assert images, f"{name}: no inline plot"
  stdout = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
  for fact in EXPECTED[name]:
    assert fact in stdout, f"{name}: {fact!r} not printed; stdout was:\n{stdout}"
  assert nb.metadata["language_info"]["name"] == "python"


def test_notebooks_are_what_the_generator_writes():
  sys.path.insert(0, NOTEBOOKS)
  try:
    import make_notebooks
  finally:
    sys.path.remove(NOTEBOOKS)
  assert set(make_notebooks.NOTEBOOKS) == set(EXPECTED)
  for name, cells in make_notebooks.NOTEBOOKS.items():
    with open(os.path.join(NOTEBOOKS, f"{name}.ipynb"), encoding="utf-8") as f:
      committed = nbformat.read(f, as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in make_notebooks.build(cells).cells], (
        f"notebooks/{name}.ipynb differs from notebooks/make_notebooks.py: rerun it")
