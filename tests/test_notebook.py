"""notebooks/quickstart.ipynb runs headless from its first cell to its last, as committed.

Its parameters cell already holds CI sizes, so nothing is injected: the test runs what a reader
opens. nbclient starts the kernel from a kernel spec written for this interpreter (the venv, not
whatever `python3` spec Jupyter would find first), with the kernel's working directory and
temporary files in the test's tmp_path, so that the notebook writes nothing into the repository.
The notebook seeds everything it draws (`SEED`); its last cell asserts what it showed (HF round
trip bitwise equal, the loss fell, text generated, finite dense and sparse losses).
"""

import json
import os
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

from glm5_jax import numerics

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300     # the training cell, compilation included, takes ~30-60 s on 2 CPU cores


def _kernel_spec(tmp_path) -> str:
  """A kernel spec running this interpreter; returns its name (found through JUPYTER_PATH)."""
  name = "glm5-jax-test"
  spec = tmp_path / "jupyter" / "kernels" / name
  spec.mkdir(parents=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "glm5-jax test", "language": "python"}))
  return name


def _outputs(cell, kind):
  return [o for o in cell.outputs if o.output_type == kind]


def _stdout(cell) -> str:
  return "".join(o.text for o in _outputs(cell, "stream") if o.name == "stdout")


def test_committed_notebook_is_stripped_and_parametrized():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(not c.outputs and c.execution_count is None and "execution" not in c.metadata
             for c in code)
  assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1


def test_quickstart_runs_headless(tmp_path, monkeypatch):
  work = tmp_path / "cwd"
  work.mkdir()
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
  monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
  monkeypatch.setenv("TMPDIR", str(tmp_path))              # the notebook's WORKDIR goes here
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  monkeypatch.delenv("MPLBACKEND", raising=False)          # ipykernel's inline backend
  # A reader's kernel runs XLA's defaults: drop the batch-invariant flag tests/conftest.py sets.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f != numerics.FLAG]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
  nb = nbformat.read(NOTEBOOK, as_version=4)

  NotebookClient(nb, kernel_name=_kernel_spec(tmp_path), timeout=CELL_TIMEOUT_S,
                 resources={"metadata": {"path": str(work)}}).execute()   # raises on an error

  code = [c for c in nb.cells if c.cell_type == "code"]
  setup = next(c for c in code if "REPO = " in c.source)
  assert f"python : {sys.executable}\n" in _stdout(setup)
  assert f"workdir: {tmp_path}{os.sep}" in _stdout(setup)
  for marker in ("ax.imshow(", "train.run(c, run_dir)"):   # the top-k picture, the loss plot
    cell = next(c for c in code if marker in c.source)
    assert any("image/png" in o.data for o in _outputs(cell, "display_data")), marker
  assert _stdout(code[-1]).strip() == "quickstart OK"
  assert not list(work.iterdir())                          # everything went to the workdir
