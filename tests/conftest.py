"""Shared fixtures: one set of workers for the suite, and a leak check on every test.

Starting workers costs ~7 s, so tests share the kernel's one nbddp Session
(``workers`` fixture). A test that must break or stop the workers may do so:
the next ``workers`` user starts or heals them.

After every test, three kinds of leak fail it:

* processes: an ipyparallel engine, nanny or controller, or an nbddp reaper,
  started by this test run and not owned by the live session. "Started by
  this run" is an environment variable every process this run starts
  inherits, so re-parented orphans are found too, not only descendants of
  pytest. Leaked processes are killed by pid.
* shared-memory files: ``/dev/shm/nbddp-*`` files of this run (the suite
  session's, or named after one of this run's pids) that appeared during the
  test and outlive it (the live session's own files excepted);
* threads: ``nbddp-*`` threads of this process still alive after the test.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import secrets
import sys
import threading
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

RUN_MARKER = "NBDDP_TEST_RUN"


def _run_id() -> str:
    """This test process's marker: one per run, and one per pytest-xdist worker within it.

    Each xdist worker has a session (and workers) of its own, so its leak
    check must not take another worker's engines for leaked ones.
    """
    base = os.environ.get(RUN_MARKER) or secrets.token_hex(8)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{base}-{worker}" if worker and not base.endswith(f"-{worker}") else base


_RUN_ID = os.environ[RUN_MARKER] = _run_id()


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


# what a test costs, roughly, by its markers (seconds on a quiet machine): only used to order the files, for a test
# that tests/test_costs.json does not list
_WEIGHTS = {"slow": 60.0, "notebook": 20.0, "browser": 20.0, "slurm": 15.0, "netns": 10.0, "bench": 10.0,
            "fresh_workers": 8.0, "docs": 8.0, "faults": 5.0, "heavy": 5.0}
_COSTS = os.path.join(os.path.dirname(__file__), "test_costs.json")


def _measured() -> dict[str, float]:
    """Each test function's mean wall seconds in a measured run of the suite, by ``file::function``.

    Written by ``scripts/cpu_table.py LOG --costs tests/test_costs.json`` from a run's CPU log; a test it does not
    list (under half a second then, or new since) is estimated by its markers (``_weight``).
    """
    try:
        with open(_COSTS, encoding="utf-8") as f:
            return json.load(f)["seconds"]
    except FileNotFoundError:
        return {}


def _weight(item: pytest.Item, measured: dict[str, float]) -> float:
    """What the test took when measured; else a marked test by its marker, about a second on the shared workers,
    and a unit test next to nothing (so that, in the quick tier, files of many cheap unit tests do not start
    before the files of real fits)."""
    took = measured.get(item.nodeid.split("[", 1)[0])
    if took is not None:
        return took
    uses_workers = bool({"workers", "warm", "ip"} & set(getattr(item, "fixturenames", ())))
    return max((w for name, w in _WEIGHTS.items() if name in item.keywords), default=1.0 if uses_workers else 0.05)


def pytest_configure(config):
    from cpu_meter import maybe_register

    maybe_register(config)


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: a file costs what runs of it
def pytest_collection_modifyitems(config, items):
    if _gpu_count() == 0:
        skip = pytest.mark.skip(reason="requires_gpu: no CUDA GPU visible on this machine")
        for item in items:
            if "requires_gpu" in item.keywords:
                item.add_marker(skip)
    # Longest files first, each file's tests kept together and in their own order: with pytest-xdist's
    # --dist loadfile --no-loadscope-reorder (scripts/test.sh) each test process takes the next file in this
    # order when it is free, so the long files start first instead of ending the run alone, and a module's
    # workers and kernels start once. (Without --no-loadscope-reorder, xdist orders the files by their number
    # of tests instead: the one-test benchmark, soak and live-cost files then started last.)
    measured = _measured()
    cost: dict[str, float] = {}
    for item in items:
        cost[item.nodeid.split("::")[0]] = cost.get(item.nodeid.split("::")[0], 0.0) + _weight(item, measured)
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])  # stable: the order within a file stays


def _run_processes() -> dict[int, psutil.Process]:
    """nbddp's and ipyparallel's processes started by this test run, wherever they were re-parented."""
    found = {}
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == me:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        if "ipyparallel" not in cmd and "nbddp.cluster.reaper" not in cmd:
            continue
        try:
            if p.environ().get(RUN_MARKER) == _RUN_ID:
                found[p.pid] = p
        except psutil.Error:
            continue
    return found


def _shm_files() -> set[str]:
    from nbddp.protocol.notes import shm_dir

    return set(glob.glob(os.path.join(shm_dir(), "nbddp-*")))


def owned_pids() -> set[int]:
    """Every pid the live session legitimately holds, and their descendants (one pass over /proc)."""
    from nbddp.session.session import get_session

    s = get_session()
    if not s.started:
        return set()
    owned = set(s.workers.all_pids())
    if s.workers.reaper.pid is not None:
        owned.add(s.workers.reaper.pid)
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    stack = list(owned)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in owned:
                owned.add(child)
                stack.append(child)
    return owned


@pytest.fixture(autouse=True, scope="module")
def _ship_test_module_by_value(request):
    """Classes/functions defined in a test module travel by value, as a notebook's do.

    Workers cannot import ``tests/test_*.py``; a notebook's ``__main__`` is
    pickled by value by cloudpickle anyway, so this makes tests behave like
    notebook cells.
    """
    import cloudpickle

    module = request.module
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


class _IOErrors(logging.Handler):
    """What raised in a ZMQ stream's callback in the client's IO thread (pyzmq logs it to tornado.general).

    Such a raise can leave the stream unread for good: an output message ipyparallel could not handle once
    stopped all later output of the session (nbddp/cluster/iopub_guard.py)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "callback" in record.getMessage():
            self.seen.append(f"{record.getMessage()}: {record.exc_info[1]!r}" if record.exc_info else record.getMessage())


_IO_ERRORS = _IOErrors()
logging.getLogger("tornado.general").addHandler(_IO_ERRORS)


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail any test that leaves an engine/controller process, a shared-memory file or an nbddp thread behind.

    Or that made the client's IO thread raise in a stream's callback (``_IOErrors``)."""
    shm_before = _shm_files()
    io_errors = len(_IO_ERRORS.seen)
    yield
    if "nbddp.session.session" not in sys.modules:
        return
    s = sys.modules["nbddp.session.session"].get_session()
    s.wait_healed(raise_error=False)
    spare = getattr(s.supervisor, "spare", None)
    if spare is not None:  # an elastic fit's spare engine, still starting in the background, is no leak
        spare.wait()
    problems = _leaked_processes() + _leaked_files(s, shm_before) + _leaked_threads()
    if len(_IO_ERRORS.seen) > io_errors:
        problems.append(f"the client's IO thread raised in a stream callback: {_IO_ERRORS.seen[io_errors:][:3]}")
    if problems:
        pytest.fail("; ".join(problems))


def _leaked_processes() -> list[str]:
    owned = owned_pids()
    leaked = {pid: p for pid, p in _run_processes().items() if pid not in owned}
    if not leaked:
        return []
    psutil.wait_procs(list(leaked.values()), timeout=5)
    still = {pid: p for pid, p in leaked.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
    if not still:
        return []
    desc = [f"{pid}: {' '.join(p.cmdline()[:4])} (parent {p.ppid()})" for pid, p in still.items()]
    for p in still.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    return [f"test left {len(still)} worker process(es) behind: {desc}"]


def _ours(path: str, session, pids: set[int]) -> bool:
    """Whether a shared-memory file was made by this test run: the suite session's, or one of ``pids``'.

    Other test runs on the same machine have files of their own in /dev/shm;
    those are not this run's business.
    """
    name = os.path.basename(path)
    if name.startswith(session.file_prefix):
        return True
    return any(name.startswith(f"nbddp-{pid}-") for pid in pids)


def _leaked_files(session, before: set[str]) -> list[str]:
    live = session.file_prefix if session.started else None
    deadline = time.monotonic() + 5.0
    while True:
        candidates = _shm_files() - before
        pids = {os.getpid(), *owned_pids(), *_run_processes()} if candidates else set()
        new = {f for f in candidates
               if _ours(f, session, pids) and not (live and os.path.basename(f).startswith(live))}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for path in new:
        try:
            os.unlink(path)
        except OSError:
            pass
    return [f"test left shared-memory file(s) behind: {sorted(new)}"] if new else []


def _leaked_threads() -> list[str]:
    deadline = time.monotonic() + 5.0
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("nbddp-") and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return [f"test left nbddp thread(s) running: {alive}"] if alive else []
        time.sleep(0.05)


@pytest.fixture(scope="session")
def _suite_session():
    yield
    import nbddp

    nbddp.stop()


@pytest.fixture
def gpu_workers(_suite_session):
    """One worker per visible GPU with NCCL, stopped afterwards (the CPU ``workers`` fixture restarts its own)."""
    import torch

    import nbddp
    from nbddp.session.session import get_session

    s = get_session()
    if s.started and s.backend != "nccl":
        nbddp.stop()
    try:
        if not s.started:
            nbddp.start(n=torch.cuda.device_count(), backend="nccl")
        yield s
    finally:
        nbddp.stop()


@pytest.fixture
def workers(_suite_session):
    """The suite's shared 2 CPU workers (started or healed as needed)."""
    import nbddp
    from nbddp.session.session import get_session

    s = get_session()
    if s.started:
        try:
            s.wait_healed(raise_error=True)
        except nbddp.ClusterError:  # a failed heal leaves no usable group: start afresh
            nbddp.stop()
    if s.started and s.workers is not None and s.workers.controller_problem() is not None:
        nbddp.stop()  # a test that killed the controller and failed before its restart: do not fail every later test
    if s.started:
        if s.world_size != 2 or s.backend != "gloo":
            nbddp.stop()
    if not s.started:
        nbddp.start(n=2, backend="gloo")
    from shared_options import reset_to_default_options

    reset_to_default_options(s)  # whatever options the test before left
    return s


@pytest.fixture(scope="session")
def ipython_shell():
    """The one IPython shell of the test process (IPython allows a single global one).

    ``start_ipython()`` builds it on its first call only and returns None after,
    so every test module asks for it here.
    """
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    if shell is None:
        from IPython.terminal.interactiveshell import TerminalInteractiveShell

        shell = TerminalInteractiveShell.instance()
    return shell


@pytest.fixture(scope="module")
def ip(ipython_shell):
    """The shell with ``%load_ext nbddp``, for one test module."""
    shell = ipython_shell
    shell.run_line_magic("load_ext", "nbddp")
    yield shell
    shell.run_line_magic("unload_ext", "nbddp")


@pytest.fixture
def digits():
    """scikit-learn's digits, as float features and integer labels (no download)."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
