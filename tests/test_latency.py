"""Per-task overhead (issue 22): what runs around every task costs milliseconds, whatever is imported.

The speed goal itself (each warm call within 2x of the same work done with
bare ipyparallel on the same engines) is measured by
``benchmarks/bench_latency.py``; here the bounds are loose enough for a
shared 2-core machine and tight enough to catch the 0.2 s a task cost when
every imported module was sorted and stat-ed twice per task.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
import types

import pytest

import nbddp


def _overhead_on_this_worker(extra_modules: int) -> dict:
    """Runs on a worker: the cost of a whole ``nbddp.run`` task around a trivial function, with more modules imported."""
    from nbddp.shipping import pickling as shipping
    from nbddp.worker.tasks import entry
    from nbddp.worker.tasks import module_reload as freshness
    from nbddp.worker.engine.rank_state import STATE

    fakes = {}
    for i in range(extra_modules):
        module = types.ModuleType(f"nbddp_test_fake_{i}")
        module.__file__ = f"/nowhere/site-packages/fake_{i}.py"
        fakes[module.__name__] = module
    sys.modules.update(fakes)
    try:
        freshness.reload_changed()  # the new modules are sorted here, once
        parcel = shipping.pack((abs, (-1,), {}), local=True)

        def cost(call, n=25):  # the least of n: what the work costs, without what other processes took meanwhile
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
            return min(times)

        return {"modules": len(sys.modules), "task_s": cost(lambda: entry.call_task(parcel, STATE.generation)),
                "walk_s": cost(freshness.reload_changed)}
    finally:
        for name in fakes:
            sys.modules.pop(name, None)


class _Call:
    """Unpickling this calls ``fn(*args)``: a bare ``apply(cloudpickle.loads, ...)`` runs test code on the engines
    outside any task of the person's (no heartbeat thread of its own sampling the measurement)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _on_the_workers(workers, fn, *args):
    import cloudpickle

    nbddp.run(abs, -1)  # the workers follow the kernel's paths
    return workers.client[[p.engine_id for p in workers.placements]].apply_sync(cloudpickle.loads,
                                                                                cloudpickle.dumps(_Call(fn, *args)))


def test_a_task_costs_milliseconds_on_the_worker_whatever_is_imported(workers):
    few, many = (_on_the_workers(workers, _overhead_on_this_worker, n) for n in (0, 3000))
    for a, b in zip(few, many):
        assert b["modules"] >= a["modules"] + 3000 >= 3000 + 1000, (a, b)
        # bounds 10x under the regression they guard (0.2 s per task with 1,580 modules), not a speed goal: ~2 ms
        # on a quiet machine, up to 5 ms seen under load 10 on 2 cores (the goal lives in bench_latency.py)
        assert a["task_s"] < 0.02 and b["task_s"] < 0.02, (a, b)
        assert b["walk_s"] < 0.002, (a, b)  # a walk of 4,500 modules that did not change: no realpath, no stat
        assert b["task_s"] < a["task_s"] + 0.015, (a, b)  # sorting cost 0.2 s per 1,580 modules per task before


def test_warm_calls_stay_within_reach_of_bare_ipyparallel_on_the_same_engines(workers):
    from benchmarks.warm_calls import bare_execute

    view = workers.client[[p.engine_id for p in workers.placements]]
    pairs = {
        "run": (lambda: nbddp.run(abs, -1), lambda: view.apply_sync(abs, -1)),
        "cell": (lambda: nbddp.run_cell("a = 1"), lambda: bare_execute(view, "a = 1")),
        "push": (lambda: nbddp.push(a=1), lambda: view.push({"a": 1}, block=True)),
    }
    times = {name: ([], []) for name in pairs}
    for i in range(12):
        for name, (ours, bare) in pairs.items():
            for side, call in ((0, ours), (1, bare))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                call()
                times[name][side].append(time.perf_counter() - t0)
    ratios = {name: statistics.median(ours) / statistics.median(bare) for name, (ours, bare) in times.items()}
    # the benchmark's goal is 2x; 4x here leaves room for a machine shared with other test runs (it was 34x)
    assert all(r < 4 for r in ratios.values()), (ratios, os.getloadavg())


def test_modules_are_sorted_once_per_module_object_and_again_when_replaced_or_forced(tmp_path, monkeypatch):
    from nbddp.shipping import by_value as modules
    name = f"sorted_once_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(name)
    sorted_now: list[str] = []
    real = modules.travels_by_value
    monkeypatch.setattr(modules, "travels_by_value", lambda n, m: sorted_now.append(n) or real(n, m))
    try:
        assert name in dict(modules.by_value_modules())
        sorted_now.clear()
        assert name in dict(modules.by_value_modules()) and sorted_now == []  # nothing changed: nothing sorted
        installed = types.ModuleType(name)
        installed.__file__ = "/nowhere/site-packages/x.py"
        sys.modules[name] = installed  # another object under the same name: sorted again, alone
        assert name not in dict(modules.by_value_modules()) and sorted_now == [name]
        sys.modules.pop(name)
        importlib.import_module(name)  # imported afresh: the file's module again
        assert name in dict(modules.by_value_modules())
        modules.ship_by_reference(name)
        assert name not in dict(modules.by_value_modules())
        modules.ship_by_value(name)
        assert name in dict(modules.by_value_modules())
    finally:
        sys.modules.pop(name, None)


def test_a_module_a_cell_imports_again_is_followed_when_its_file_changes(workers, tmp_path, monkeypatch):
    name = f"reimported_{os.getpid()}"
    path = tmp_path / f"{name}.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def write(value: int) -> None:
        path.write_text(f"VALUE = {value}\n")
        st = path.stat()  # a new mtime even within one clock tick
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10_000_000 * value))

    write(1)
    nbddp.run_cell(f"import {name}\nfirst = {name}.VALUE")
    for _ in range(3):
        nbddp.run(abs, -1)  # tasks in between: the walks are answered from what was sorted
    nbddp.run_cell(f"import sys\ndel sys.modules['{name}']\nimport {name}\nsecond = {name}.VALUE")  # a new object
    write(2)
    nbddp.run_cell(f"import {name}\nthird = {name}.VALUE")
    assert nbddp.pull("first", "second", "third", rank=1) == {"first": 1, "second": 1, "third": 2}
    nbddp.run_cell(f"import sys\nsys.modules.pop('{name}', None)\ndel first, second, third, {name}")


MiB = 1 << 20
FAILING = "import torch\ndef f():\n    big = torch.ones({n} << 20, dtype=torch.uint8)\n    raise ValueError('on purpose')\nf()"


@pytest.mark.heavy
def test_a_failed_cell_gives_its_memory_back_once_its_post_mortem_is_dropped(workers):
    """A task that raised leaves its frames (and their 64 MiB) to the traceback, which the engine's shell kept too.

    The failing ranks keep the failure for ``%ddp debug`` (issue 23) until their next fit or ``--clear``: then the
    memory goes, frames frozen with the engine's objects included.

    Heavy: 64 MiB per rank allocated, kept by a failure, then measured as given back."""
    from nbddp.api import clear_debug as clear

    def fail(mib: int) -> None:
        with pytest.raises(nbddp.WorkerError, match="on purpose"):
            nbddp.run_cell(FAILING.format(n=mib))
        workers.wait_healed(raise_error=True)

    fail(1)  # a worker's first failure imports what formats tracebacks: not what this test measures
    clear()
    before = nbddp.run(_rss)
    fail(64)
    nbddp.run(abs, -1)
    kept = nbddp.run(_rss)
    assert all(k > b + 48 * MiB for k, b in zip(kept, before)), ("the post-mortem keeps the failing frame's locals",
                                                                 before, kept)
    said = clear()
    after = nbddp.run(_rss)
    assert all(a < b + 32 * MiB for a, b in zip(after, before)), (said, before, kept, after)


def _rss() -> int:
    from nbddp.worker.memory.usage import rss_bytes

    return rss_bytes()
