"""The ranks' rich output and progress bars under the cell, on the suite's 2 CPU workers, through a real IPython shell.

The shell here is IPython's terminal one; what a Jupyter kernel would send
to the notebook is what its display publisher is given, so a recording
publisher takes its place, and the kernel test (``in_notebook_kernel``)
answers yes where a test checks the notebook's drawing.
"""

from __future__ import annotations

import re
import time

import pytest

import nbddp
from nbddp.cells import rank_output as output

BAR = re.compile(r"\[rank (\d)\]\s+(\d+)%\|[^|]*\|\s*(\d+)/200")


class Recorder:
    """IPython's display publisher, keeping each output (and calling ``on_publish``) as the kernel would send it."""

    def __init__(self):
        self.published: list[dict] = []
        self.on_publish = None

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        item = {"data": data, "metadata": metadata or {}, "transient": transient or {}, "update": update,
                "t": time.monotonic()}
        self.published.append(item)
        if self.on_publish is not None:
            self.on_publish(item)

    def clear_output(self, wait=False):
        self.published.append({"clear": wait})

    def final(self) -> list[dict]:
        """The outputs as the notebook ends up showing them: each update applied to its display."""
        shown: list[dict] = []
        by_id: dict[str, dict] = {}
        for item in self.published:
            if "clear" in item:
                shown.clear()
                continue
            display_id = item["transient"].get("display_id")
            if item["update"]:
                if display_id in by_id:
                    by_id[display_id]["data"] = item["data"]
                continue
            entry = dict(item)
            shown.append(entry)
            if display_id:
                by_id[display_id] = entry
        return shown

    def images(self) -> list[int]:
        return [item["metadata"]["nbddp"]["rank"] for item in self.published if "image/png" in item.get("data", {})]


@pytest.fixture
def notebook(ip, monkeypatch):
    """The shell's display publisher recorded, and nbddp drawing as in a Jupyter kernel."""
    import nbddp.live.choice

    recorder = Recorder()
    monkeypatch.setattr(ip, "display_pub", recorder)
    monkeypatch.setattr(nbddp.live.choice, "in_notebook_kernel", lambda: True)
    return recorder


@pytest.fixture
def written(monkeypatch):
    """Every labelled line printed, as (stream, text)."""
    lines: list[tuple[str, str]] = []
    real = output.write

    def record(kind, text):
        lines.append((kind, text))
        real(kind, text)

    monkeypatch.setattr(output, "write", record)
    return lines


TQDM_CELL = """
import os, time
from tqdm import tqdm
for step in tqdm(range(200)):
    time.sleep(0.004)  # a training step
    if step == 100:  # wait until the test has seen the bar part-way (bounded: the test fails, not hangs)
        deadline = time.monotonic() + 60
        while not os.path.exists({go!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
"""


def test_a_tqdm_loop_is_drawn_in_place_while_it_runs_and_ends_as_one_line_per_rank(ip, workers, notebook, written,
                                                                                  tmp_path):
    go = str(tmp_path / "go")
    part_way: list[dict[int, int]] = []

    def watch(item):  # called as the kernel publishes: once both ranks' bars are seen part-way, let them go on
        steps = {int(r): int(n) for r, _, n in BAR.findall(item["data"].get("text/plain", ""))}
        if len(steps) == 2 and all(0 < n < 200 for n in steps.values()) and not part_way:
            part_way.append(steps)
            open(go, "w").close()

    notebook.on_publish = watch
    ip.run_cell_magic("ddp", "", TQDM_CELL.format(go=go))
    assert part_way, "the bars were never drawn part-way while the loop ran"
    bars = [item for item in notebook.final() if BAR.search(item["data"].get("text/plain", ""))]
    assert len(bars) == 1, "one block of bars, updated in place"
    lines = bars[0]["data"]["text/plain"].splitlines()
    assert [BAR.search(line).groups()[::2] for line in lines] == [("0", "200"), ("1", "200")]  # readable to the end
    assert "\r" not in bars[0]["data"]["text/plain"]
    assert [text for _, text in written if "/200" in text] == []  # not printed again as lines
    updates = sum(1 for item in notebook.published if item["update"])
    assert 2 <= updates < 200 / 2, f"{updates} redraws for 2 x 200 steps: throttled, not one per step"


def test_outside_a_notebook_each_bar_ends_as_one_readable_line(ip, workers, written):
    ip.run_cell_magic("ddp", "", "from tqdm import tqdm\nfor _ in tqdm(range(200)):\n    pass\nprint('after', rank)")
    bar_lines = [text for kind, text in written if "/200" in text]
    assert sorted(BAR.search(text).group(1, 3) for text in bar_lines) == [("0", "200"), ("1", "200")]
    assert all(kind == "stderr" and "\r" not in text for kind, text in written if "/200" in text)
    assert ("stdout", "[rank 0] after 0\n") in written


def test_nested_bars_show_both_rows_while_running_and_leave_the_outer_bar(ip, workers, notebook, written):
    """An epoch bar over a batch bar that clears itself: tqdm moves the cursor down and back up between them."""
    ip.run_cell_magic("ddp", "", "import time\nfrom tqdm import tqdm, trange\n"
                                 "for epoch in trange(3):\n"
                                 "    for batch in tqdm(range(20), leave=False):\n"
                                 "        time.sleep(0.005)\n"
                                 "print('trained', rank)")
    drawn = [item["data"]["text/plain"] for item in notebook.published if "/3 [" in item["data"].get("text/plain", "")]
    assert any(text.count("\n") == 3 and "/20 [" in text for text in drawn), drawn  # 2 rows a rank, mid-epoch
    assert not any("\x1b" in text for text in drawn)
    final = [item["data"]["text/plain"] for item in notebook.final() if "/3 [" in item["data"].get("text/plain", "")]
    assert len(final) == 1 and final[0].count("3/3 [") == 2 and "/20 [" not in final[0]
    assert [text for _, text in written if "/20" in text or "/3 " in text] == []
    assert ("stdout", "[rank 1] trained 1\n") in written


def test_no_stream_prints_each_bars_final_line_grouped_by_rank(ip, workers, written):
    ip.run_cell_magic("ddp", "--no-stream", "from tqdm import tqdm\nfor _ in tqdm(range(200)):\n    pass")
    assert [BAR.search(text).group(1, 3) for kind, text in written if kind == "stderr"] == [("0", "200"), ("1", "200")]


FIGURE_CELL = """
import matplotlib.pyplot as plt
plt.plot([0, 1], [rank, rank])
plt.show()
"""


def test_rank_0s_figure_arrives_as_png_and_other_ranks_only_on_request(ip, workers, notebook):
    ip.run_cell_magic("ddp", "", FIGURE_CELL)
    assert notebook.images() == [0]
    figure = next(item for item in notebook.published if "image/png" in item["data"])
    assert figure["data"]["image/png"][:8] == "iVBORw0K"  # a PNG, base64: what the inline backend sends
    notebook.published.clear()
    ip.run_cell_magic("ddp", "--displays all", FIGURE_CELL)
    assert sorted(notebook.images()) == [0, 1]
    notebook.published.clear()
    ip.run_cell_magic("ddp", "--displays 1", FIGURE_CELL)
    assert notebook.images() == [1]
    notebook.published.clear()
    ip.run_cell_magic("ddp", "--displays none", FIGURE_CELL)
    assert notebook.images() == []
    notebook.published.clear()
    ip.run_cell_magic("ddp", "--targets 1", FIGURE_CELL)
    assert notebook.images() == [1]  # the default is the lowest rank the cell runs on


def test_a_figure_left_open_is_drawn_at_the_cells_end_as_in_a_notebook(ip, workers, notebook):
    ip.run_cell_magic("ddp", "", "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])")
    assert notebook.images() == [0]
    state = nbddp.run(_figures_state)
    assert [open_now for open_now, _ in state] == [0, 0]  # drawn on rank 0, dropped on rank 1: none left open
    assert all("inline" in backend for _, backend in state)  # ipykernel's backend in every engine, set by no one


def _figures_state() -> tuple[int, str]:
    import matplotlib
    import matplotlib.pyplot as plt

    return len(plt.get_fignums()), matplotlib.get_backend()


HTML_CELL = """
from IPython.display import HTML, display, clear_output
import ipywidgets
table = display(HTML("<table><tr><td>step 0</td></tr></table>"), display_id=True)
for step in range(1, 30):
    table.update(HTML(f"<table><tr><td>step {step}</td></tr></table>"))
display(ipywidgets.HTML(value="<b>a widget</b>"))
"""


def test_an_html_table_updated_in_place_and_a_widgets_snapshot(ip, workers, notebook):
    """HF's notebook progress table is a display handle updated at each step; a widget arrives with its text."""
    ip.run_cell_magic("ddp", "", HTML_CELL)
    shown = notebook.final()
    tables = [item for item in shown if "<table>" in item["data"].get("text/html", "")]
    assert len(tables) == 1 and "step 29" in tables[0]["data"]["text/html"]
    assert all(item["metadata"]["nbddp"] == {"rank": 0} for item in shown)
    widget = [item for item in shown if "application/vnd.jupyter.widget-view+json" in item["data"]]
    assert len(widget) == 1 and "a widget" in widget[0]["data"]["text/plain"]
    updates = [item for item in notebook.published if item["update"]]
    assert len(updates) < 29, "updates of one display are folded"


def test_tqdm_auto_on_a_worker_is_rank_0s_widget_with_its_text(ip, workers, notebook):
    ip.run_cell_magic("ddp", "", "from tqdm.auto import tqdm\nfor _ in tqdm(range(5)):\n    pass")
    widgets = [item for item in notebook.published if "application/vnd.jupyter.widget-view+json" in item["data"]]
    assert [item["metadata"]["nbddp"]["rank"] for item in widgets] == [0]
    assert "0/5" in widgets[0]["data"]["text/plain"]


@pytest.mark.heavy
def test_hf_trainers_notebook_progress_table_is_shown_and_updated_in_place(ip, workers, notebook):
    """Imports transformers into both workers for the first time (heavy): HF's own ``NotebookTrainingTracker``,
    which ``Trainer`` draws through ``NotebookProgressCallback`` when it finds itself in a notebook, as it does on a
    worker (``is_in_notebook()``)."""
    ip.run_cell_magic("ddp", "", "from transformers.utils.import_utils import is_in_notebook\n"
                                 "from transformers.utils.notebook import NotebookTrainingTracker\n"
                                 "assert is_in_notebook()\n"
                                 "tracker = NotebookTrainingTracker(50)\n"
                                 "for step in range(1, 51):\n"
                                 "    tracker.update(step, force_update=True)\n"
                                 "    tracker.write_line({'Step': step, 'Training Loss': 1 / step})")
    tables = [item for item in notebook.final() if "<progress" in item["data"].get("text/html", "")]
    assert len(tables) == 1 and "50/50" in tables[0]["data"]["text/html"]
    assert tables[0]["metadata"]["nbddp"] == {"rank": 0}


def test_clear_output_on_rank_0_clears_the_cell(ip, workers, notebook):
    ip.run_cell_magic("ddp", "", "from IPython.display import clear_output, display\ndisplay('first')\n"
                                 "clear_output(wait=True)\ndisplay('second')")
    assert [item["data"]["text/plain"] for item in notebook.final()] == ["'second'"]


def test_run_shows_rank_0s_displays_and_others_on_request(ip, workers, notebook):
    nbddp.run(_show_rank)
    assert [item["data"]["text/plain"] for item in notebook.published] == ["'shown by 0'"]
    notebook.published.clear()
    nbddp.run(_show_rank, displays=[1])
    assert [item["data"]["text/plain"] for item in notebook.published] == ["'shown by 1'"]
    with pytest.raises(ValueError, match=r"nbddp.run\(displays=7\): no rank 7; the workers have ranks 0\.\.1"):
        nbddp.run(_show_rank, displays=7)


def _show_rank() -> None:
    import torch.distributed as dist
    from IPython.display import display

    display(f"shown by {dist.get_rank()}")


SCRIPT = """
import sys
import matplotlib.pyplot as plt
import torch.distributed as dist
from tqdm import tqdm

dist.init_process_group("gloo")
for _ in tqdm(range(200), file=sys.stderr):
    pass
plt.plot([0, 1], [0, dist.get_rank()])
plt.show()
dist.destroy_process_group()
"""


def test_a_script_shows_rank_0s_figure_and_its_bars_in_place(ip, workers, notebook, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    ip.run_line_magic("ddp", "script train.py")
    assert notebook.images() == [0]
    bars = [item["data"]["text/plain"] for item in notebook.final() if "/200" in item["data"].get("text/plain", "")]
    assert len(bars) == 1 and [m[::2] for m in BAR.findall(bars[0])] == [("0", "200"), ("1", "200")]
    notebook.published.clear()
    ip.run_line_magic("ddp", "script --displays all train.py")
    assert sorted(notebook.images()) == [0, 1]


def test_displays_errors_name_the_value_before_any_rank_runs(ip, workers, tmp_path):
    with pytest.raises(ValueError, match=r"run_cell\(displays=3\): no rank 3; the workers have ranks 0\.\.1"):
        ip.run_cell_magic("ddp", "--displays 3", "raise SystemExit('must not run')")
    (tmp_path / "empty.py").write_text("")
    with pytest.raises(ValueError, match=r"run_script\(displays=\.\.\.\) takes a rank .*got 'rank 0'"):
        nbddp.run_script(tmp_path / "empty.py", displays="rank 0")


def test_a_noblock_cell_keeps_its_figures_for_display_outputs(ip, workers, notebook):
    handle = ip.run_cell_magic("ddp", "--noblock", FIGURE_CELL)
    handle.result(timeout=60)
    assert notebook.images() == []  # not drawn under whichever cell runs meanwhile
    handle.display_outputs()
    assert notebook.images() == [0]
    handle = nbddp.run(_show_rank, block=False, displays="all")
    handle.result(timeout=60)
    handle.display_outputs()
    assert [item["data"]["text/plain"] for item in notebook.published if "text/plain" in item["data"]][-2:] == [
        "'shown by 0'", "'shown by 1'"]
