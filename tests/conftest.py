"""Shared fixtures: one set of workers for the suite, and a leak check on every test.

Starting workers costs ~7 s, so tests share the kernel's one nbddp Session
(``workers`` fixture). A test that must break or stop the workers may do so:
the next ``workers`` user starts or heals them. After every test, any
ipyparallel process that is a child of this process and not owned by the
live session is a leak: it is killed (by pid) and the test fails.
"""

from __future__ import annotations

import os
import sys

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def pytest_collection_modifyitems(config, items):
    if _gpu_count() == 0:
        skip = pytest.mark.skip(reason="requires_gpu: no CUDA GPU visible on this machine")
        for item in items:
            if "requires_gpu" in item.keywords:
                item.add_marker(skip)


def _ipp_children() -> dict[int, psutil.Process]:
    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "ipyparallel" in cmd or "nbddp._reaper" in cmd:
            found[p.pid] = p
    return found


def owned_pids() -> set[int]:
    """Every pid the live session legitimately holds (and their children)."""
    from nbddp.session import get_session

    s = get_session()
    if not s.started:
        return set()
    pids = set(s.workers.all_pids())
    if s.workers.reaper is not None:
        pids.add(s.workers.reaper.pid)
    for pid in list(pids):
        try:
            pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:
            pass
    return pids


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


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """Fail any test that leaves an engine/controller process nobody owns."""
    yield
    if "nbddp.session" not in sys.modules:
        return
    s = sys.modules["nbddp.session"].get_session()
    heal = s._heal
    if heal is not None:
        heal.join(120)
    leaked = {pid: p for pid, p in _ipp_children().items() if pid not in owned_pids()}
    if leaked:
        psutil.wait_procs(list(leaked.values()), timeout=5)
        still = {pid: p for pid, p in leaked.items() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
        if still:
            desc = [f"{pid}: {' '.join(p.cmdline()[:4])}" for pid, p in still.items()]
            for p in still.values():
                try:
                    p.kill()
                except psutil.Error:
                    pass
            pytest.fail(f"test left {len(still)} worker process(es) behind: {desc}")


@pytest.fixture(scope="session")
def _suite_session():
    yield
    import nbddp

    nbddp.stop()


@pytest.fixture
def workers(_suite_session):
    """The suite's shared 2 CPU workers (started or healed as needed)."""
    import nbddp
    from nbddp.session import get_session

    s = get_session()
    if s.started:
        s._join_heal(raise_error=False)
        if s.world_size != 2 or s.backend != "gloo":
            nbddp.stop()
    if not s.started:
        nbddp.start(n=2, backend="gloo")
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


@pytest.fixture
def digits():
    """scikit-learn's digits, as float features and integer labels (no download)."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])
