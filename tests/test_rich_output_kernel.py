"""Bars and figures from the ranks in a real Jupyter kernel (nbclient): what a saved notebook keeps.

``tests/test_rich_output.py`` checks the same path in IPython's terminal
shell with a recording publisher; here the kernel's own display publisher,
ipykernel's matplotlib backend on the workers and nbclient's handling of
display updates are the real ones.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.notebook]

BAR = re.compile(r"\[rank (\d)\]\s+(\d+)%\|[^|]*\|\s*(\d+)/200")

CELLS = [
    "%load_ext nbddp\nimport nbddp\nnbddp.start(2, threads=1)",
    "%%ddp\nimport time\nfrom tqdm import tqdm\nimport matplotlib.pyplot as plt\n"
    "for _ in tqdm(range(200)):\n    time.sleep(0.005)  # a training step\nplt.plot([0, 1], [0, rank])",
    "nbddp.stop()",
]


@pytest.mark.fresh_workers
def test_a_cells_bars_update_in_place_and_rank_0s_figure_is_saved_in_the_notebook(tmp_path):
    """The kernel starts workers of its own (it is another process than the suite's)."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    seen: list[tuple[str, str]] = []

    class Watching(nbclient.NotebookClient):
        def process_message(self, msg, cell, cell_index):  # every message, as the notebook gets it
            data = msg["content"].get("data") or {}
            seen.append((msg["msg_type"], data.get("text/plain", msg["content"].get("text", ""))))
            return super().process_message(msg, cell, cell_index)

    Watching(nb, kernel_name="python3", timeout=240, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[1].outputs
    part_way = [text for kind, text in seen if kind == "update_display_data"
                and any(0 < int(n) < 200 for _, _, n in BAR.findall(text))]
    assert part_way, f"no bar drawn part-way while the loop ran: {seen} {outputs}"
    bars = [out for out in outputs if out.get("output_type") == "display_data" and "/200" in
            out["data"].get("text/plain", "")]
    assert len(bars) == 1, outputs  # one output, updated in place
    assert [m[::2] for m in BAR.findall(bars[0]["data"]["text/plain"])] == [("0", "200"), ("1", "200")]
    assert not any("/200" in out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    figures = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(figures) == 1 and figures[0]["metadata"]["nbddp"] == {"rank": 0}
