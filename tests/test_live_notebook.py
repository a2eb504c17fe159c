"""A notebook with a live fit, executed headless by nbclient: what the saved file shows.

The dashboard's widget state must be saved in its final form (bar at 100 %,
a PNG in the image), and the same output must carry a static PNG and a
text summary for viewers that render no widgets.
"""

from __future__ import annotations

import base64
import os
import shutil

import pytest

pytestmark = [pytest.mark.notebook]

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "live_fit.ipynb")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def executed(tmp_path, monkeypatch):
    import nbformat  # here, not at collection: with jsonschema's format checkers it costs a second of CPU
    from nbclient import NotebookClient

    path = tmp_path / "live_fit.ipynb"
    shutil.copy(NOTEBOOK, path)
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("NBDDP_DEMO_PACE", "0.005")
    client = NotebookClient(nb, timeout=240, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    nbformat.write(nb, path)
    return nbformat.read(path, as_version=4)  # what a person opening the saved file gets


def _models(nb, name):
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    return {mid: m for mid, m in state.items() if m["model_name"] == name}


def test_saved_notebook_shows_final_dashboard_and_static_fallback(executed):
    nb = executed
    fit_cell = next(c for c in nb.cells if c.cell_type == "code" and "dist_fit(" in c.source)
    assert not [o for o in fit_cell.outputs if o.output_type == "error"], fit_cell.outputs
    shown = [o for o in fit_cell.outputs if o.output_type == "display_data" and WIDGET_VIEW in o.data]
    assert len(shown) == 1, "one dashboard output under the cell"
    out = shown[0]

    # the static fallback, in the same output: a PNG of the final plot and a text summary
    assert base64.b64decode(out.data["image/png"]).startswith(PNG_MAGIC)
    summary = out.data["text/plain"]
    assert summary.startswith("nbddp fit completed: step 96/96 · epoch 3/3"), summary
    assert "val_acc" in summary and "rank 1" in summary
    assert "<img src='data:image/png;base64," in out.data["text/html"]

    # the saved widget state is the final one: progress at 100 %, a PNG in the image
    progress = _models(nb, "FloatProgressModel")
    assert [m["state"]["value"] for m in progress.values()] == [1.0]
    assert [m["state"]["bar_style"] for m in progress.values()] == ["success"]
    images = _models(nb, "ImageModel")
    assert len(images) == 1
    (image,) = images.values()
    buffers = {tuple(b["path"]): b for b in image.get("buffers", [])}
    assert base64.b64decode(buffers[("value",)]["data"]).startswith(PNG_MAGIC)
    html_values = [m["state"].get("value", "") for m in _models(nb, "HTMLModel").values()]
    assert any("100%" == v for v in html_values)
    assert any("nbddp-status" in v and ">completed<" in v for v in html_values)
    # the dashboard points at the saved box
    boxes = _models(nb, "VBoxModel")
    assert out.data[WIDGET_VIEW]["model_id"] in boxes

    history_cell = nb.cells[nb.cells.index(fit_cell) + 1]
    assert "status='completed'" in history_cell.outputs[0].data["text/plain"]
