"""The tutorial notebook (docs/tutorial.ipynb) runs top to bottom and shows what its text says.

The notebook is executed in a fresh kernel (nbclient) with the repository first on the path; any cell
that raises fails the test with the cell's traceback. The numbers checked are those the text explains:
the trained model attends to the parent and patching the parent recovers the clean output (Theorem 3.1:
attention on position N-1 is at least 1 - exp(-Omega(N))), random models do neither, and the two-layer
model on the persistent walk beats what the last state alone allows (0.5).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "tutorial.ipynb"
#: Seconds any one cell may take (the whole notebook takes well under a minute on one core).
CELL_TIMEOUT = 180


def text_of(nb: nbformat.NotebookNode) -> str:
    """Everything the code cells printed, in order."""
    return "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for out in cell.outputs if out.output_type == "stream")


def number(pattern: str, text: str) -> float:
    """The number captured by ``pattern`` (one group) in ``text``; a missing line fails the test."""
    match = re.search(pattern, text)
    assert match, f"the tutorial no longer prints {pattern!r}"
    return float(match.group(1))


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    tmp = tmp_path_factory.mktemp("tutorial")
    path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TMPDIR": str(tmp),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)  # raises CellExecutionError, with the traceback, if a cell fails
    return nb


def test_the_committed_notebook_holds_its_outputs():
    """Committed executed, so that it reads on the web: every code cell ran, none failed, figures included."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code)
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    images = [out for cell in code for out in cell.outputs if "image/png" in out.get("data", {})]
    assert len(images) == 2  # the attention and V-against-Pi figures


def test_the_tutorial_runs_and_shows_the_parent(executed):
    text = text_of(executed)
    assert number(r"mean attention on the parent \(position 19 of 20\): ([\d.]+)", text) > 0.99
    assert number(r"largest attention on any other position: ([\d.e+-]+)", text) < 0.01
    assert "hook_z is the output f(X): True" in text
    assert "QK equals W^T: True" in text and re.search(r"W: \(70, 70\) rank 1\b", text)
    assert "same outputs: True" in text  # the saved run loads back
    assert number(r"patching position 19 recovers\s+([-\d.]+)", text) > 0.99
    assert number(r"all positions but the parent together: ([\d.]+)", text) < 0.01
    assert number(r"refused: transformer_lens\.patching of attn_out by position.*\n.*parent: ([-\d.]+)", text) > 0.99
    for key in ("parent_effect", "localization", "necessity", "sufficiency"):
        assert number(rf"{key}\s+([-\d.]+)", text) > 0.99


def test_the_tutorial_compares_with_random_models_and_two_layers(executed):
    text = text_of(executed)
    trained, random = (number(rf"parent_attention\s+([\d.]+)\s+[\d.]+ \+-", text),
                       number(r"parent_attention\s+[\d.]+\s+([\d.]+) \+-", text))
    assert trained > 0.99 and random < 0.5
    assert number(r"transition\.cosine\s+([-\d.]+)", text) > 0.9  # V points along Pi^T
    # The persistent walk: the last state alone gives 1/2, both parents the Bayes accuracy 0.8.
    assert number(r"test accuracy ([\d.]+), Bayes 0\.800", text) > 0.7
    attention = [[number(rf"layer {layer}: attention on s_\(N-2\) ([\d.]+)", text),
                  number(rf"layer {layer}: attention on s_\(N-2\) [\d.]+, on s_\(N-1\) ([\d.]+)", text)]
                 for layer in (0, 1)]
    # Between them the two layers attend to both parents (which layer takes which is the seed's choice).
    assert max(attention[0][0], attention[1][0]) > 0.5 and max(attention[0][1], attention[1][1]) > 0.5
    assert re.search(r"L0H0 .*; L1H0 ", text)
    images = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs
              if "image/png" in out.get("data", {})]
    assert len(images) == 2
