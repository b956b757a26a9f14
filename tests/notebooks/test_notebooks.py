"""The notebooks run top to bottom, and their rich outputs are there (issue 16).

Each notebook in `notebooks/` is executed in a real Jupyter kernel (nbclient) on the tiny
model; any cell error fails the test. The executed notebook is then rendered to HTML with
nbconvert, as a reader would see it, and the views each notebook is about must be in the
page: the engine report, state transcripts by role, the traced graph and the radix tree as
SVG, results as a DataFrame table. Run twice in one kernel, a notebook leaves one engine
alive: the output history keeps no engine.
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path

import pytest

# A cell's own timeout (600 s, nbclient's) must fail the test before the suite's per-test
# one does: that one interrupted pytest while it reported the failure and ended the run.
pytestmark = pytest.mark.timeout(1800)

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
nbconvert = pytest.importorskip("nbconvert")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# What each notebook's rendered page must show.
EXPECTED = {
    "01_quickstart": [
        'class="lmprog-engine"',
        'class="lmprog-role lmprog-role-user"',
        "lmprog-gen",
    ],
    "02_programs": [
        "lmprog-role-system",
        "lmprog-select",
        "<svg",
        "stroke-dasharray",
        "argument message",
    ],
    "03_structured_output": ["lmprog-gen", "jump-forward tokens"],
    "04_datasets_and_cache": ['class="dataframe', "prefix cache hit rate", "<svg", "hits"],
}


def test_every_notebook_is_checked():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run each notebook once on the tiny model; (notebook, its HTML) by name."""
    env_before = os.environ.get("LMPROG_NOTEBOOK_MODEL")
    os.environ["LMPROG_NOTEBOOK_MODEL"] = "tiny"  # the kernel inherits it
    done = {}
    try:
        for path in sorted(NOTEBOOKS.glob("*.ipynb")):
            book = nbformat.read(path, as_version=4)
            client = nbclient.NotebookClient(
                book,
                timeout=600,
                kernel_name="python3",
                resources={"metadata": {"path": str(NOTEBOOKS)}},
            )
            client.execute()
            page, _ = nbconvert.HTMLExporter().from_notebook_node(book)
            page += "".join(  # nbconvert embeds SVG outputs as base64 images
                base64.b64decode(data).decode()
                for data in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', page)
            )
            (tmp_path_factory.getbasetemp() / f"{path.stem}.html").write_text(page)
            done[path.stem] = (book, page)
    finally:
        if env_before is None:
            os.environ.pop("LMPROG_NOTEBOOK_MODEL", None)
        else:
            os.environ["LMPROG_NOTEBOOK_MODEL"] = env_before
    return done


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_runs_and_shows_its_views(executed, name):
    book, page = executed[name]
    errors = [
        output
        for cell in book.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, errors
    for needle in EXPECTED[name]:
        assert needle in page, (name, needle)
    # Every code cell ran, in order.
    counts = [c.execution_count for c in book.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))


def test_the_live_view_updates_one_display_in_place(executed):
    """`run(stream=True)` in a kernel leaves one display (updated by id), holding the
    finished transcript, not one output per token."""
    book, _ = executed["01_quickstart"]
    cell = next(c for c in book.cells if "stream=True)" in c.source and "tell.run" in c.source)
    displays = [o for o in cell.outputs if o.output_type == "display_data"]
    assert len(displays) == 1
    assert "lmprog-role-assistant" in displays[0].data["text/html"]


# Run in a kernel after a notebook ran twice: how many engines are still alive. An engine
# freezes the collector while it works and a while after (`gc_freeze.py`), and a frozen
# cycle is never collected: the freeze is undone first.
COUNT_ENGINES = """\
import gc
from lmprog_runtime.process_guard import _LIVE
gc.unfreeze()
gc.collect()
print(len(_LIVE))"""


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_running_a_notebook_again_leaves_one_engine(name, monkeypatch):
    """Every cell run twice in one kernel, in order. IPython's output history (`Out`, `_`) keeps the value
    of each cell's last expression: a cell ending with a bare `engine` (or a `state`, which
    holds its engine) kept every engine the notebook made alive, about 3 GB each on
    SmolLM2. `display(...)` shows the same report and keeps nothing."""
    monkeypatch.setenv("LMPROG_NOTEBOOK_MODEL", "tiny")  # the kernel inherits it
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    sources = [cell.source for cell in book.cells if cell.cell_type == "code"]
    book.cells = [nbformat.v4.new_code_cell(source) for source in sources + sources]
    book.cells.append(nbformat.v4.new_code_cell(COUNT_ENGINES))
    nbclient.NotebookClient(
        book, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    (output,) = [o for o in book.cells[-1].outputs if o.output_type == "stream"]
    assert output.text.strip() == "1"
