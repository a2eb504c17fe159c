"""The ranks' output drawn under the cell, without engines: carriage returns, the block of bars, rich displays.

``nbddp/cells/line_buffer.py``, ``live_lines.py``, ``rank_displays.py`` and
``rank_messages.py``, fed by hand; ``tests/test_rich_output.py`` runs the
same path on the shared workers.
"""

from __future__ import annotations

import io

import pytest
from IPython.core.error import UsageError

from nbddp.cells.line_buffer import LineBuffer
from nbddp.cells.live_lines import LiveLines, drawing_for, drawing_here
from nbddp.cells.rank_displays import RankDisplays, shown_ranks
from nbddp.cells.rank_messages import RankInbox, RankMessage


def tqdm_chunks(total: int) -> list[str]:
    """What tqdm writes for a bar of ``total`` steps: ``\\r`` and the whole bar at every update, ``\\n`` at the end."""
    bars = [f"\r{100 * n // total:3d}%|{'#' * (10 * n // total):<10}| {n}/{total} [00:00<00:00]" for n in range(total + 1)]
    return [*bars, f"\r100%|##########| {total}/{total} [00:01<00:00]", "\n"]


# ---- carriage returns ------------------------------------------------------------------
def test_a_bar_is_one_line_that_ends_as_its_last_state():
    buffer = LineBuffer()
    seen = []
    for chunk in tqdm_chunks(200)[:-1]:
        assert buffer.feed(chunk) == []
        seen.append(buffer.current)
    assert buffer.live and seen[100].endswith("100/200 [00:00<00:00]") and seen[100].startswith(" 50%")
    # its newline ends it, but the row stays open a little: tqdm goes back up to a bar's row when bars nest
    assert buffer.feed("\n") == [] and buffer.current == "100%|##########| 200/200 [00:01<00:00]"
    assert buffer.feed("next line\n") == [("100%|##########| 200/200 [00:01<00:00]", True), ("next line", False)]
    assert buffer.current == "" and not buffer.live


def test_plain_lines_pass_through_and_chunks_may_split_anywhere():
    buffer = LineBuffer()
    assert buffer.feed("hello\nwor") == [("hello", False)]
    assert buffer.current == "" and not buffer.live  # not redrawn: held until its newline, not drawn in place
    assert buffer.feed("ld\nlast") == [("world", False)]
    assert buffer.rest() == [("last", False)] and buffer.current == ""


def test_carriage_return_overwrites_like_a_terminal_and_crlf_is_one_line_end():
    buffer = LineBuffer()
    assert buffer.feed("abcdef\rXY") == [] and buffer.current == "XYcdef"
    assert buffer.feed("\r\n") == [] and buffer.rest() == [("XYcdef", True)]
    assert buffer.feed("windows line\r") == [] and buffer.feed("\nnext\n") == [("windows line", False), ("next", False)]
    assert buffer.feed("a\r\nb\r\n") == [("a", False), ("b", False)]


def test_a_bar_cleared_on_close_leaves_nothing():
    """tqdm(leave=False) blanks its line and returns to its start: nothing is left to show."""
    buffer = LineBuffer()
    buffer.feed("\r 50%|#####     | 1/2")
    buffer.feed("\r" + " " * 20 + "\r")
    assert not buffer.live and buffer.rest() == []


def nested_bars() -> str:
    """What tqdm writes for an epoch bar over a batch bar that clears itself (``leave=False``), then a print."""
    import io

    from tqdm import tqdm, trange

    out = io.StringIO()
    for _ in trange(2, file=out, mininterval=0):
        for _ in tqdm(range(3), file=out, mininterval=0, leave=False):
            pass
    out.write("done\n")
    return out.getvalue()


def test_nested_bars_are_two_rows_while_they_run_and_one_line_at_the_end():
    text = nested_bars()
    assert "\x1b[A" in text  # tqdm goes down a row for the inner bar and back up
    buffer = LineBuffer()
    done, states = [], []
    for piece in text.split("\x1b[A"):  # as the rank's writes arrive, escape codes cut in two included
        for part in (piece[:-1], piece[-1:] + "\x1b", "[A"):
            done += buffer.feed(part)
        states.append(buffer.current)
    done += buffer.rest()
    assert [(line[:4], redrawn) for line, redrawn in done] == [("100%", True), ("done", False)]
    assert "| 2/2 [" in done[0][0]
    two_rows = [state.split("\n") for state in states if state.count("\n") == 1]
    assert two_rows and all("/2 [" in outer and "/3 [" in inner for outer, inner in two_rows)
    assert not any("\x1b" in state for state in states)


def test_colours_are_dropped_and_cut_codes_are_joined():
    buffer = LineBuffer()
    assert buffer.feed("\x1b[32mgreen\x1b") == [] and buffer.feed("[0m text\n") == [("green text", False)]


# ---- the block of bars ------------------------------------------------------------------
class FakeHandle:
    def __init__(self, shown: list):
        self.shown = shown

    def update(self, bundle, raw=False):
        self.shown.append(("update", bundle["text/plain"]))


@pytest.fixture
def displayed(monkeypatch):
    """What ``LiveLines`` puts in the notebook, through a stand-in for IPython's ``display``."""
    shown: list[tuple[str, str]] = []

    def display(bundle, raw=False, display_id=False):
        assert raw and display_id is True
        shown.append(("display", bundle["text/plain"]))
        return FakeHandle(shown)

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", display)
    return shown


def test_the_notebook_block_shows_one_line_per_rank_updated_in_place_and_keeps_the_final_state(displayed):
    block = LiveLines("display", every=0.0)
    block.set((0, "stderr"), " 10%| 20/200")
    block.set((1, "stderr"), "  5%| 10/200")
    block.draw()
    block.set((0, "stderr"), " 50%| 100/200")
    block.draw()
    assert displayed == [("display", "[rank 0]  10%| 20/200\n[rank 1]   5%| 10/200"),
                         ("update", "[rank 0]  50%| 100/200\n[rank 1]   5%| 10/200")]
    assert block.end((0, "stderr"), "100%| 200/200") and block.end((1, "stderr"), "100%| 200/200")
    block.draw()
    assert displayed[-1] == ("update", "[rank 0] 100%| 200/200\n[rank 1] 100%| 200/200")
    assert not block.end((0, "stderr"), "a line of a later bar")  # the block closed: the caller prints it
    block.set((0, "stderr"), "  0%| 0/10")
    block.draw()
    assert displayed[-1] == ("display", "[rank 0]   0%| 0/10") and len(displayed) == 4  # a new block, below


def test_redraws_are_throttled(displayed):
    block = LiveLines("display", every=60.0)
    for n in range(100):
        block.set((0, "stderr"), f"{n}/100")
        block.draw()
    assert displayed == [("display", "[rank 0] 0/100")]
    block.finish()  # the end is drawn whatever the clock says
    assert displayed[-1] == ("update", "[rank 0] 99/100")


def test_a_ranks_next_bar_hands_back_its_ended_line_while_another_rank_still_runs(displayed):
    block = LiveLines("display", every=0.0)
    block.set((0, "stderr"), "epoch 1 10/10")
    block.set((1, "stderr"), "epoch 1 3/10")
    assert block.end((0, "stderr"), "epoch 1 10/10 done")
    assert block.set((0, "stderr"), "epoch 2 1/10") == "epoch 1 10/10 done"


def test_on_a_terminal_the_block_is_redrawn_in_place_with_cursor_moves():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    assert drawing_here(out) == "terminal" and drawing_here(io.StringIO()) == "plain"
    block = LiveLines("terminal", stream=out, every=0.0)
    block.set((0, "stderr"), "1/2")
    block.set((1, "stderr"), "1/2")
    block.draw()
    block.set((0, "stderr"), "2/2")
    block.draw()
    assert out.getvalue() == "[rank 0] 1/2\x1b[K\n[rank 1] 1/2\x1b[K\n\x1b[2F\x1b[J[rank 0] 2/2\x1b[K\n[rank 1] 1/2\x1b[K\n"
    block.before_print()  # an ordinary line goes where the block was; the block follows it at the next draw
    assert out.getvalue().endswith("\x1b[2F\x1b[J")


def test_plain_text_draws_nothing_in_place_and_the_caller_prints_each_final_line():
    out = io.StringIO()
    block = LiveLines("plain", stream=out, every=0.0)
    assert block.set((0, "stderr"), "1/2") is None
    block.draw()
    assert not block.end((0, "stderr"), "2/2") and out.getvalue() == ""


def test_live_text_and_widget_choose_the_drawing():
    assert drawing_for("widget") == "display"
    assert drawing_for("text") in ("terminal", "plain")
    assert drawing_for(None) is None and drawing_for(True) is None


# ---- rich displays ---------------------------------------------------------------------
class Recorder:
    """A display publisher that keeps what it is given (IPython's ``display_pub`` interface)."""

    def __init__(self):
        self.published: list[dict] = []

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
        self.published.append({"data": data, "metadata": metadata, "transient": transient, "update": update})

    def clear_output(self, wait=False):
        self.published.append({"clear": wait})


@pytest.fixture
def publisher(ipython_shell, monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(ipython_shell, "display_pub", recorder)
    return recorder


def message(rank, kind, data=None, display_id=None, **content):
    if data is not None:
        content["data"] = data
        content["metadata"] = {}
        content["transient"] = {"display_id": display_id} if display_id else {}
    return RankMessage(rank, kind, content)


def test_only_the_chosen_ranks_displays_are_published_with_their_rank(publisher):
    displays = RankDisplays({0}, notebook=True)
    displays.take(message(0, "display_data", {"image/png": "AAA", "text/plain": "<Figure>"}))
    displays.take(message(1, "display_data", {"image/png": "BBB", "text/plain": "<Figure>"}))
    displays.flush()
    assert [(p["data"]["image/png"], p["metadata"]["nbddp"]) for p in publisher.published] == [("AAA", {"rank": 0})]


def test_updates_of_one_display_fold_to_the_newest_per_tick(publisher):
    displays = RankDisplays(None, notebook=True)
    displays.take(message(0, "display_data", {"text/html": "<b>0</b>"}, display_id="table"))
    for n in range(1, 50):
        displays.take(message(0, "update_display_data", {"text/html": f"<b>{n}</b>"}, display_id="table"))
    displays.flush()
    assert [(p["data"]["text/html"], p["update"], p["transient"]) for p in publisher.published] == [
        ("<b>0</b>", False, {"display_id": "table"}), ("<b>49</b>", True, {"display_id": "table"})]


def test_clear_output_from_a_shown_rank_clears_the_cell_in_a_notebook_only(publisher):
    notebook = RankDisplays({0}, notebook=True)
    notebook.take(message(0, "clear_output", wait=True))
    notebook.flush()
    assert publisher.published == [{"clear": True}] and notebook.cleared
    terminal = RankDisplays({0}, notebook=False)
    terminal.take(message(0, "clear_output", wait=True))
    terminal.flush(final=True)
    assert publisher.published == [{"clear": True}]


def test_outside_a_notebook_new_displays_show_at_once_and_updates_only_at_the_end(publisher):
    cleared: list[int] = []
    displays = RankDisplays({0}, notebook=False, before_print=lambda: cleared.append(len(publisher.published)))
    displays.take(message(0, "display_data", {"text/plain": "table 0"}, display_id="t"))
    displays.take(message(0, "update_display_data", {"text/plain": "table 1"}, display_id="t"))
    displays.flush()
    displays.take(message(0, "update_display_data", {"text/plain": "table 2"}, display_id="t"))
    displays.flush()
    assert [p["data"]["text/plain"] for p in publisher.published] == ["table 0"]
    displays.flush(final=True)
    assert [(p["data"]["text/plain"], p["update"]) for p in publisher.published] == [("table 0", False),
                                                                                    ("table 2", False)]
    assert cleared == [0, 1]  # a terminal's bars made room before each


def test_several_ranks_shown_are_labelled(publisher, capsys):
    displays = RankDisplays(None, notebook=True, label=True)
    displays.take(message(1, "display_data", {"text/plain": "<Figure>"}))
    displays.flush()
    assert capsys.readouterr().out == "[rank 1] display:\n"


def test_displays_choices_and_their_errors():
    assert shown_ranks(None, [0, 1], 2, "run") == {0}
    assert shown_ranks(None, [1], 2, "run") == {1}  # --targets 1: the first rank that runs
    assert shown_ranks("all", [0, 1], 2, "run") is None and shown_ranks(True, [0, 1], 2, "run") is None
    assert shown_ranks("none", [0, 1], 2, "run") == set() and shown_ranks(False, [0, 1], 2, "run") == set()
    assert shown_ranks([1, -2], [0, 1], 2, "run") == {0, 1}
    assert shown_ranks(slice(1, None), [0, 1], 2, "run") == {1}
    with pytest.raises(ValueError, match=r"run_cell\(displays=\.\.\.\) takes a rank .*'all' or 'none'; got 'rank0'"):
        shown_ranks("rank0", [0, 1], 2, "run_cell")
    with pytest.raises(ValueError, match=r"run\(displays=\[0, 5\]\): no rank 5; the workers have ranks 0\.\.1"):
        shown_ranks([0, 5], [0, 1], 2, "run")


def test_the_magics_displays_flag_is_parsed_and_misuse_is_a_usage_error():
    from nbddp.magics import _cell, parse_displays

    assert parse_displays(None, _cell) is None and parse_displays("ALL", _cell) == "all"
    assert parse_displays("0,1", _cell) == [0, 1] and parse_displays("::2", _cell) == slice(None, None, 2)
    with pytest.raises(UsageError, match=r"--displays takes ranks like 0 or 0,1, .*got 'everyone'\nusage: %%ddp"):
        parse_displays("everyone", _cell)


# ---- the inbox ----------------------------------------------------------------------------
class FakeFuture:
    """ipyparallel's ``MessageFuture``, as far as the inbox uses it."""

    def __init__(self, msg_id="m-1"):
        self.msg_id = msg_id
        self.iopub_callbacks: list = []


def test_the_inbox_keeps_each_output_message_once_in_order_and_never_raises():
    future = FakeFuture()
    inbox = RankInbox()
    inbox.attach(1, future)
    hook = future.iopub_callbacks[0]
    hook({"header": {"msg_type": "stream"}, "content": {"name": "stderr", "text": "\r1/2"}})
    hook({"header": {"msg_type": "status"}, "content": {}})  # not output: not kept
    hook({"header": {"msg_type": "display_data"}, "content": {"data": {}}})
    hook({"header": {"msg_type": "update_display_data"}, "content": {"data": {}}})
    hook({"header": {"msg_type": "clear_output"}, "content": {"wait": True}})
    hook({"bad": "message"})  # never raises in the client's IO thread
    assert [(m.rank, m.kind) for m in inbox.drain()] == [(1, "stream"), (1, "display_data"),
                                                         (1, "update_display_data"), (1, "clear_output")]
    assert inbox.drain() == []
    inbox.close()
    assert future.iopub_callbacks == []


def test_the_report_inbox_keeps_every_report_batch_of_its_rank_and_nothing_else():
    """Each batch is taken as it arrives (ipyparallel keeps only the latest on the task), unpickled from the
    message itself; other published data, other messages and a batch of another rank are left."""
    from ipyparallel.serialize import serialize_object

    from nbddp.protocol.messages import PUBLISH_KEYS
    from nbddp.protocol.reports import ReportBatch
    from nbddp.reports.inbox import ReportInbox

    def data_message(data):
        return {"header": {"msg_type": "data_message"}, "content": {"keys": list(data)},
                "buffers": serialize_object(data)}

    future, inbox = FakeFuture(), ReportInbox()
    inbox.attach(1, future)
    hook = future.iopub_callbacks[0]
    key = PUBLISH_KEYS["report"]
    first, second = (ReportBatch(1, n, [(n - 1, (n, 0.5, {"loss": 1.0}, {"loss": "mean"}))]) for n in (1, 2))
    hook(data_message({key: first}))
    hook(data_message({PUBLISH_KEYS["beat"]: "a heartbeat"}))  # other data: not a report
    hook({"header": {"msg_type": "stream"}, "content": {"name": "stdout", "text": "x"}})
    hook(data_message({key: ReportBatch(0, 1, [])}))  # another rank's: not this task's
    hook(data_message({key: second}))
    hook({"header": {"msg_type": "data_message"}, "content": {"keys": [key]}, "buffers": [b"not a pickle"]})
    assert [(b.rank, b.seq, b.window) for b in inbox.drain()] == [(1, 1, first.window), (1, 2, second.window)]
    inbox.close()
    assert future.iopub_callbacks == []


def test_a_tasks_future_is_seen_before_the_task_is_sent():
    """``to_ranks`` hands each task's message future over before ipyparallel sends it, and only its own."""
    from nbddp.execution.send import _futures_seen

    class Client:
        def create_message_futures(self, msg_id):
            return [f"future of {msg_id}"]

    client, seen = Client(), []
    with _futures_seen(client, seen.append):
        client.create_message_futures("a")
    client.create_message_futures("b")  # after: not seen, the class's method again
    assert seen == ["future of a"] and "create_message_futures" not in vars(client)


def test_a_listener_must_say_what_it_picks():
    """The base ``Listener`` picks nothing itself: a subclass that forgot ``pick`` fails loudly, not silently."""
    from nbddp.execution.listening import Listener

    with pytest.raises(NotImplementedError):
        Listener().pick(0, "m-1", {"header": {"msg_type": "stream"}, "content": {}})
