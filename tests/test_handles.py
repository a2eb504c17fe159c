"""Every handle is a ``concurrent.futures.Future`` with one meaning (issue handles).

First the base (``nbddp/execution/handle.py``) on a fake work, without
engines: what ``result``/``exception``/``cancel``/``stop``/``await`` mean,
and how ``concurrent.futures.wait`` and ``asyncio`` see it. Then every kind
on the shared workers, through the same suite: ``dist_fit``, ``predict``,
``evaluate``, ``sweep``, ``run`` and ``run_cell`` (``%%ddp --noblock``), each
once run to its end and once cancelled while it runs. Then ``WorkerError`` as
ipyparallel's ``RemoteError``, the ``live=`` vocabulary, ``History``'s Keras
names, and the rule that every warning nbddp can issue is an ``NbddpWarning``.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures as cf
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import ipyparallel.error
import pytest
import torch
import torch.nn as nn

import nbddp
from nbddp.execution.handle import WorkHandle
from nbddp.execution.work import Work
from nbddp.protocol.errors import RankFailure, WorkerError

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parent.parent


# ---- the base, on a fake work (no engines) ---------------------------------------------------------------------
class FakeWork(Work):
    """Ends when ``end(...)`` is called; its stop makes it end as interrupted, as a stopped predict does."""

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(attend=lambda work: None, running=None), "a fake")
        self.stops: list[str] = []
        self.outcome: object = None

    def request_stop(self) -> None:
        self.stops.append("stop")

    def hard_stop(self, reason: str = "") -> None:
        self.stops.append("hard")

    def end(self, outcome: object) -> None:
        self.outcome = outcome
        threading.Thread(target=self.set_done, name="fake-watcher").start()  # as a watcher thread ends work

    def result(self) -> object:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class FakeHandle(WorkHandle[object]):
    def __init__(self, work: FakeWork):
        super().__init__(work, "the fake work")
        work.when_done(lambda: self.settle(work.result))


def made() -> tuple[FakeWork, FakeHandle]:
    work = FakeWork()
    return work, FakeHandle(work)


async def awaited(handle):
    return await handle


def test_a_handle_waits_returns_and_tells_its_callbacks():
    work, handle = made()
    told: list[tuple[object, str]] = []
    handle.add_done_callback(lambda h: told.append((h, threading.current_thread().name)))
    assert isinstance(handle, cf.Future) and handle.running() and not handle.done()
    with pytest.raises(TimeoutError, match=r"the fake work still running after 0.01 s; call .wait\(\) again or .stop\(\)"):
        handle.result(timeout=0.01)
    with pytest.raises(TimeoutError):
        handle.exception(timeout=0.01)
    assert repr(handle) == "<FakeHandle the fake work: running>"
    work.end(42)
    assert handle.result(timeout=5) == 42 and handle.wait() == 42 and handle.exception() is None
    assert told == [(handle, "fake-watcher")]  # in the thread that learnt the end
    late: list[object] = []
    handle.add_done_callback(late.append)
    assert late == [handle] and handle.done() and not handle.running() and handle.cancel() is False
    assert asyncio.run(awaited(handle)) == 42 and repr(handle) == "<FakeHandle the fake work: done>"


def test_concurrent_futures_and_asyncio_take_handles_as_they_are():
    (w1, h1), (w2, h2) = made(), made()
    w2.end(2)
    assert cf.wait([h1, h2], timeout=0.05).done == {h2}
    assert list(cf.as_completed([h2], timeout=5)) == [h2]
    w1.end(1)
    assert cf.wait([h1, h2], timeout=5, return_when=cf.ALL_COMPLETED).done == {h1, h2}

    async def both():
        return await asyncio.gather(h1, asyncio.wrap_future(h2))

    assert asyncio.run(both()) == [1, 2]


def test_a_failure_is_the_handles_exception():
    work, handle = made()
    error = WorkerError(RankFailure(1, "ValueError", "bad"))
    work.end(error)
    assert handle.exception(timeout=5) is error and repr(handle) == "<FakeHandle the fake work: failed>"
    with pytest.raises(WorkerError, match="rank 1: ValueError: bad"):
        handle.result()
    with pytest.raises(WorkerError):
        asyncio.run(awaited(handle))
    with pytest.raises(WorkerError):  # stop() does not hide an error that is not the stop's own
        handle.stop()


def test_cancel_asks_the_stop_and_the_handle_is_cancelled_once_the_work_ended():
    work, handle = made()
    assert handle.cancel() is True and work.stops == ["stop"]
    assert not handle.cancelled() and handle.running()  # the ranks are still stopping: the workers are not free yet
    waiting = cf.ThreadPoolExecutor(1).submit(cf.wait, [handle], 10)
    work.end(KeyboardInterrupt("stopped: it returns nothing"))
    assert waiting.result(timeout=10).done == {handle}  # concurrent.futures.wait heard of the cancellation
    assert handle.cancelled() and handle.done() and repr(handle) == "<FakeHandle the fake work: cancelled>"
    with pytest.raises(cf.CancelledError):
        handle.result()
    with pytest.raises(cf.CancelledError):
        handle.exception()
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(awaited(handle))
    assert handle.cancel() is True and handle.stop() is None  # cancelled already: nothing more to do


def test_cancel_keeps_a_failure_that_is_not_the_stops_own():
    work, handle = made()
    handle.cancel()
    work.end(WorkerError(RankFailure(0, "RuntimeError", "unrelated")))
    assert not handle.cancelled() and isinstance(handle.exception(timeout=5), WorkerError)


def test_stop_returns_what_the_stopped_work_returns_or_none():
    work, handle = made()
    threading.Timer(0.05, work.end, args=("a History, interrupted",)).start()
    assert handle.stop() == "a History, interrupted" and work.stops == ["stop"]
    work, handle = made()
    assert handle.stop(wait=False) is None and not handle.done()
    work.end(KeyboardInterrupt("predict was interrupted: it returns nothing"))
    assert handle.stop() is None
    with pytest.raises(KeyboardInterrupt, match="returns nothing"):  # as the call itself raises
        handle.result()


def test_await_never_lets_a_keyboard_interrupt_into_the_event_loop():
    work, handle = made()
    work.end(KeyboardInterrupt("predict was interrupted"))
    with pytest.raises(asyncio.CancelledError, match="the fake work was stopped: predict was interrupted"):
        asyncio.run(awaited(handle))


def test_cancelling_the_awaiting_task_cancels_the_handle():
    """Kernel > Interrupt of an ``await handle`` cell: ipykernel cancels the cell's task; the work stops."""
    work, handle = made()

    async def interrupted():
        task = asyncio.ensure_future(awaited(handle))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    assert work.stops == ["stop"]
    work.end(KeyboardInterrupt())
    assert cf.wait([handle], 5).done and handle.cancelled()


def test_kernel_interrupt_while_waiting_stops_the_work_as_a_blocking_call_does(monkeypatch):
    import signal

    work, handle = made()

    def interrupt_twice():
        time.sleep(0.1)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.3)
        signal.raise_signal(signal.SIGINT)
        time.sleep(0.3)
        work.end("stopped")

    threading.Thread(target=interrupt_twice).start()
    assert handle.result(timeout=10) == "stopped" and work.stops == ["stop", "hard"]


def test_block_must_be_a_bool():
    from nbddp.execution.handle import check_block

    with pytest.raises(TypeError, match=r"nbddp.run\(block=\.\.\.\) must be True or False, got 'no'"):
        check_block("no", "nbddp.run")


# ---- every kind, on the shared workers: the same suite ------------------------------------------------------------
def xy(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def mark(folder: str) -> None:
    """Say on disk that this rank started (the test waits for that, not for the clock)."""
    import torch.distributed as dist

    open(os.path.join(folder, f"rank{dist.get_rank()}"), "a").close()


class SlowNet(nn.Module):
    """A linear layer whose forward marks its rank, then takes 50 ms: a fit, prediction or trial that lasts."""

    def __init__(self, folder: str = ""):
        super().__init__()
        self.lin, self.folder = nn.Linear(4, 2), folder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folder:
            mark(self.folder)
            time.sleep(0.05)
        return self.lin(x)


def slow_call(folder: str) -> int:
    mark(folder)
    for _ in range(1200):
        time.sleep(0.05)
    return 1


def error_per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).abs().mean(1)


def sweep(folder: str, n_trials: int):
    return nbddp.sweep(lambda width: SlowNet(folder), xy(), space={"width": [2, 3]}, metric="loss", n_trials=n_trials,
                       epochs=1 if not folder else 40, batch_size=8, live=False, block=False)


KINDS = {  # name: (start it quickly, start it slow in folder, check its value)
    "dist_fit": (lambda: nbddp.dist_fit(SlowNet(), xy(), batch_size=8, live=False, block=False),
                 lambda d: nbddp.dist_fit(SlowNet(d), xy(), epochs=40, batch_size=8, live=False, block=False),
                 lambda v: isinstance(v, nbddp.History) and v.status == "completed" and v.steps[-1]["step"] == 2),
    "predict": (lambda: nbddp.predict(SlowNet(), (xy()[0],), batch_size=8, live=False, block=False),
                lambda d: nbddp.predict(SlowNet(d), (xy(4000)[0],), batch_size=1, live=False, block=False),
                lambda v: isinstance(v, torch.Tensor) and v.shape == (32, 2)),
    "evaluate": (lambda: nbddp.evaluate(SlowNet(), xy(), metrics={"err": error_per_sample}, batch_size=8, live=False,
                                        block=False),
                 lambda d: nbddp.evaluate(SlowNet(d), xy(4000), metrics={"err": error_per_sample}, batch_size=1,
                                          live=False, block=False),
                 lambda v: set(v) == {"err"} and v["err"] > 0),
    "sweep": (lambda: sweep("", 1), lambda d: sweep(d, 2),
              lambda v: len(v.trials) == 1 and v.status == "completed"),
    "run": (lambda: nbddp.run(lambda: torch.distributed.get_rank() * 10, block=False),
            lambda d: nbddp.run(slow_call, d, block=False),
            lambda v: v == [0, 10]),
    "%%ddp --noblock": (lambda: nbddp.run_cell("print('on', rank)\nrank * 10", block=False),
                        lambda d: nbddp.run_cell(f"import time\nopen(f'{d}/rank{{rank}}', 'a').close()\n"
                                                 "for _ in range(1200): time.sleep(0.05)", block=False),
                        lambda v: v == [0, 10]),
}


def started(folder: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(folder.iterdir()):
        assert time.monotonic() < deadline, "the slow work never started"
        time.sleep(0.02)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_handle_is_a_future_with_one_meaning(workers, tmp_path, kind):
    quick, slow, check = KINDS[kind]
    handle = quick()
    told: list[object] = []
    handle.add_done_callback(told.append)
    value = asyncio.run(awaited(handle))  # await handle
    assert isinstance(handle, cf.Future) and handle.done() and not handle.running() and not handle.cancelled()
    assert check(value), value
    assert handle.result() is value and handle.wait() is value and handle.exception() is None
    assert told == [handle] and handle.cancel() is False
    running = slow(str(tmp_path))
    started(tmp_path)
    assert running.running() and not running.done() and workers.busy
    with pytest.raises(TimeoutError, match="still running after 0.01 s"):
        running.result(timeout=0.01)
    assert running.cancel() is True
    with pytest.raises(cf.CancelledError):
        running.result(timeout=120)
    assert running.cancelled() and running.done() and not workers.busy


def test_wait_on_a_fit_and_a_predict_at_once(workers):
    """One set of workers runs one call at a time: the predict starts once the fit is done, and one
    ``concurrent.futures.wait`` (or ``as_completed``, or ``asyncio.gather``) takes both."""
    fit = nbddp.dist_fit(SlowNet(), xy(), batch_size=8, live=False, block=False)
    assert cf.wait([fit], timeout=120).done == {fit}
    model = fit.result().model or SlowNet()
    pred = nbddp.predict(model, (xy()[0],), batch_size=8, live=False, block=False)
    done, pending = cf.wait([fit, pred], timeout=120)
    assert done == {fit, pred} and not pending
    assert set(cf.as_completed([fit, pred], timeout=5)) == {fit, pred}

    async def both():
        return await asyncio.gather(fit, pred)

    history, outputs = asyncio.run(both())
    assert history is fit.result() and outputs.shape == (32, 2)


def test_stop_means_the_same_for_a_call_and_a_cell(workers, tmp_path):
    """Stopped, ``run`` and a cell return nothing (their ranks got ``KeyboardInterrupt``): ``stop()`` is None."""
    handle = nbddp.run(slow_call, str(tmp_path), block=False)
    started(tmp_path)
    assert handle.stop() is None and handle.done() and not handle.cancelled() and not workers.busy
    with pytest.raises(KeyboardInterrupt, match=r"nbddp.run\(slow_call\) interrupted on every rank"):
        handle.result()
    assert nbddp.run(lambda: 1) == [1, 1]  # the workers took the next call


def test_a_call_that_does_not_block_keeps_what_the_ranks_print(workers, capsys):
    handle = nbddp.run_cell("print('hello from', rank)\nrank + 1", ranks=[1], block=False)
    assert handle.result(timeout=60) == [2] and handle.ranks == [1]
    assert capsys.readouterr().out == ""  # kept on the handle, not written under whichever cell runs
    assert handle.stdout == {1: "hello from 1\n2\n"} and handle.stderr == {1: ""}
    handle.display_outputs()
    assert capsys.readouterr().out == "[rank 1] hello from 1\n[rank 1] 2\n"
    assert nbddp.run_cell("x_handles = 5", block=False).result(60) == [None, None]  # no final expression
    assert nbddp.run(lambda: print("said") or 3, live=False) == [3, 3] and "said" not in capsys.readouterr().out


# ---- errors in ipyparallel's words ----------------------------------------------------------------------------------
def fails_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 cannot")
    return 0


def test_except_remote_error_catches_a_ranks_value_error(workers):
    with pytest.raises(ipyparallel.error.RemoteError) as caught:
        nbddp.run(fails_on_rank_1)
    error = caught.value
    assert isinstance(error, WorkerError) and isinstance(error, nbddp.NbddpError)
    assert error.ename == "ValueError" and error.evalue == "rank 1 cannot" and "rank 1 cannot" in error.traceback
    engine = workers.group.by_rank()[1]
    assert error.engine_info == {"engine_id": engine.engine_id, "pid": engine.pid, "host": engine.host, "rank": 1,
                                 "method": "apply"}
    assert error.elist[0] == ("ValueError", "rank 1 cannot", error.traceback, error.engine_info)
    assert str(error).startswith("rank 1 (pid ") and error.render_traceback() == error._render_traceback_()
    handle = nbddp.run(fails_on_rank_1, block=False)
    assert isinstance(handle.exception(timeout=60), ipyparallel.error.RemoteError)


def test_several_failed_ranks_keep_the_headline_and_others_as_an_elist():
    first = RankFailure(1, "ValueError", "bad", "tb1", 11, "h", 4)
    other = RankFailure(0, "RuntimeError", "also", "tb0", 10, "h", 3)
    error = WorkerError(first, [other])
    assert [e[0] for e in error.elist] == ["ValueError", "RuntimeError"] and error.others == [other]
    assert error.elist[1][3] == {"engine_id": 3, "pid": 10, "host": "h", "rank": 0, "method": "apply"}
    assert repr(error).startswith("WorkerError('rank 1 (pid 11 on h): ValueError: bad")


# ---- live= ----------------------------------------------------------------------------------------------------------
def test_live_means_the_same_everywhere_and_old_spellings_warn():
    from nbddp.live.choice import live_choice, resolved

    for value in (True, False, None, "widget", "text"):
        assert live_choice(value, "nbddp.predict") is value
    with pytest.deprecated_call(match=r"nbddp.sweep\(live='html'\) is now live='widget'"):
        assert live_choice("html", "nbddp.sweep") == "widget"
    with pytest.raises(ValueError, match=r"nbddp.run\(live=\.\.\.\) must be True, False, None \(automatic\), "
                                         r"'widget' or 'text'; got 'html5'"):
        live_choice("html5", "nbddp.run")
    assert resolved(True) == resolved(None) == "text" and resolved("widget") == "widget" and resolved(False) == "off"


def test_every_old_spelling_of_live_works_with_a_deprecation_warning(workers):
    """``sweep(live="html")`` (the only one: ``dist_fit``'s and ``predict``'s values all stay) draws the widget view."""
    import optuna

    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(params={"width": 2}, value=0.5,
                                              distributions={"width": optuna.distributions.CategoricalDistribution([2])}))
    with pytest.deprecated_call(match=r"live='html'\) is now live='widget'"):
        result = nbddp.sweep(lambda width: SlowNet(), xy(), space={"width": [2]}, metric="loss", n_trials=1,
                             study=study, live="html")
    assert result.best_value == 0.5


def test_predicts_widget_view_is_one_output_updated_in_place(monkeypatch):
    from nbddp.inference.progress import ProgressLine

    shown, updated = [], []
    monkeypatch.setattr("IPython.display.display",
                        lambda obj, display_id=False: shown.append(obj.data) or SimpleNamespace(update=updated.append))
    line = ProgressLine("nbddp.predict", 24, "widget")
    from nbddp.protocol.messages import PUBLISH_KEYS

    line.tick({0: SimpleNamespace(data={PUBLISH_KEYS["beat"]: SimpleNamespace(micro=5)})})
    line.finish("done")
    assert len(shown) == 1 and "<progress value='5' max='24'" in shown[0] and "5/24 batches on 1 ranks" in shown[0]
    assert len(updated) == 1 and "nbddp.predict: done in" in updated[0].data


# ---- History in Keras's words ------------------------------------------------------------------------------------
def test_history_has_kerass_dict_of_lists_and_the_global_batch(workers):
    val = xy(16)
    history = nbddp.dist_fit(SlowNet(), xy(), val_data=val, epochs=2, batch_size=4, grad_accum=2, live=False)
    assert list(history.history) == ["loss", "val_loss"]
    assert history.history["loss"] == [e["loss"] for e in history.epochs] and len(history.history["val_loss"]) == 2
    assert history.batch_size == 4 and history.global_batch_size == 4 * 2 * 2  # per rank x ranks x accumulation


def test_the_views_show_the_global_batch_beside_the_per_rank_one():
    import io

    from nbddp.live.state import LiveState
    from nbddp.live.text import TextView
    from nbddp.live.widget import status_html

    state = LiveState(world_size=4, backend="gloo", batch_size=16, global_batch=128)
    run = SimpleNamespace(live_state=state, error=None)
    assert "batch 16/rank, 128 global" in status_html(run, "training")
    out = io.StringIO()
    TextView(out).start(run)
    assert out.getvalue() == "nbddp: training on 4 rank(s), backend gloo, batch 16/rank, 128 global\n"


def test_the_global_batch_counts_data_parallel_ranks_only():
    from nbddp.protocol.fit_options import FitConfig

    assert FitConfig(batch_size=8, grad_accum=2).global_batch_size(4) == 64
    assert FitConfig(batch_size=8, mesh={"dp": 2, "pp": 2}).global_batch_size(4) == 16
    assert FitConfig(batch_size=8, mesh={"pp": 4}).global_batch_size(4) == 8
    assert FitConfig(batch_size=8, data_world=4).global_batch_size(3) == 32  # min_workers keeps the batch it began with


# ---- every warning is an NbddpWarning --------------------------------------------------------------------------
def warning_classes() -> dict[str, type]:
    """Every Warning class nbddp defines, and every category its ``warnings.warn`` calls name, found by reading
    the package: ``name -> class``."""
    import importlib

    found: dict[str, type] = {}
    for path in sorted((ROOT / "nbddp").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ClassDef) and any("Warning" in ast.unparse(b) for b in node.bases):
                names.append((module, node.name))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("warnings.warn", "warn"):
                category = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "category"), None)
                names.append((module, "UserWarning" if category is None else ast.unparse(category)))
            for mod, name in names:
                namespace = {**vars(__import__("builtins")), **vars(importlib.import_module(mod))}
                cls = eval(name, namespace)  # noqa: S307 - a name the module itself uses
                found[f"{mod}:{name}"] = cls
    return found


def test_every_warning_class_nbddp_can_issue_is_an_nbddp_warning():
    found = warning_classes()
    assert "nbddp.fit.compile_report:RecompileWarning" in found and "nbddp.protocol.notices:NbddpWarning" in found
    assert {k for k, cls in found.items() if not issubclass(cls, nbddp.NbddpWarning)} == set()
    with pytest.deprecated_call():
        nbddp.modules  # noqa: B018 - a moved name: the old spelling warns (an NbddpDeprecationWarning)


def test_a_notice_raised_as_an_error_stops_the_cell_but_never_a_watcher_thread(caplog):
    """``filterwarnings("error", category=NbddpWarning)`` raises a notice where the person waits; from a background
    thread (a fit's watcher or hooks) it is logged at ERROR, so the watching goes on."""
    import warnings

    from nbddp.protocol.notices import notify

    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=nbddp.NbddpWarning)
        with pytest.raises(nbddp.NbddpWarning, match="a notice"):
            notify("a notice")
        worker = threading.Thread(target=notify, args=("from the watcher",), name="nbddp-fit-watch")
        with caplog.at_level("ERROR", logger="nbddp"):
            worker.start()
            worker.join()
    assert "from the watcher (an NbddpWarning the warnings filters raise as an error; from the nbddp-fit-watch" \
        in caplog.text
