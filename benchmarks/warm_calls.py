"""Warm calls against bare ipyparallel on the same engines: what nbddp adds around each kind of task.

Four warm calls, each next to what a person would write with ipyparallel
alone on the same two engines (the floor of that call), alternating, in
one run:

==========  ==========================================  ===============================================
figure      nbddp                                       floor (bare ipyparallel, same engines)
==========  ==========================================  ===============================================
``run``     ``nbddp.run(one)``                          ``view.apply_sync(one)``
``fit``     ``dist_fit(Linear, (x, y), max_steps=1)``   ``view.apply_sync(bare_step, ...)``: unpickle the
                                                        model, wrap it in DDP, one AdamW step, rank 0's
                                                        state dict back and loaded
``cell``    ``nbddp.run_cell("a = 1")`` (``%%ddp``)     ``view.execute("a = 1")`` (``%px``)
``push``    ``nbddp.push(a=1)`` (``%ddp push``)         ``view.push({"a": 1})``
==========  ==========================================  ===============================================

Each figure is reported against its own floor and against the plain
``apply`` floor. Then what giving memory back costs on the workers
(``nbddp.worker.memory.release.LAST``, read with a bare apply, which is no task of
the person's): after each kind of call, and after a fit of a larger model,
where ``malloc_trim`` has a big heap to walk.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

FIGURES = ("run", "fit", "cell", "push")


def one() -> int:
    return 1


def bare_step(model_bytes: bytes, x: Any, y: Any, batch: int) -> Any:
    """One DDP step on the engines' process group, written by hand (the floor of a one-step fit)."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = cloudpickle.loads(model_bytes)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    F.mse_loss(ddp(x[rank::world][:batch]), y[rank::world][:batch]).backward()
    opt.step()
    return model.state_dict() if rank == 0 else None


def release_cost() -> dict[str, float]:
    try:
        from nbddp.worker.memory.release import LAST
    except ImportError:  # an nbddp from before memory was given back (the benchmark's "before" runs)
        return {}
    return dict(LAST)


def bare_execute(view: Any, code: str) -> None:
    """``view.execute(code, block=True)`` (``%px``), its wait for the engines' output bounded as nbddp's is.

    ipyparallel waits for each engine's output without a limit: seen once in a full test run, an output
    message that never came held the call until the test's timeout. nbddp waits for it at most
    ``OUTPUT_WAIT_S`` (nbddp/cells/rank_output.py), so the floor does the same."""
    from nbddp.cells.rank_output import OUTPUT_WAIT_S

    ar = view.execute(code, block=False)
    ar.get(timeout=60)
    ar.wait_for_output(OUTPUT_WAIT_S)


def _calls(session: Any, world: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """figure -> (nbddp's call, its floor)."""
    import cloudpickle
    import torch
    import torch.nn.functional as F

    import nbddp

    view = session.client[[p.engine_id for p in session.placements]]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32 * world, 32, generator=g), torch.randn(32 * world, 32, generator=g)

    def fit() -> None:
        nbddp.dist_fit(torch.nn.Linear(32, 32), (x, y), max_steps=1, batch_size=32, loss_fn=F.mse_loss, live=False)

    def bare_fit() -> None:
        model = torch.nn.Linear(32, 32)
        states = view.apply_sync(bare_step, cloudpickle.dumps(model), x, y, 32)
        model.load_state_dict(states[0])

    return {
        "run": (lambda: nbddp.run(one), lambda: view.apply_sync(one)),
        "fit": (fit, bare_fit),
        "cell": (lambda: nbddp.run_cell("a = 1"), lambda: bare_execute(view, "a = 1")),
        "push": (lambda: nbddp.push(a=1), lambda: view.push({"a": 1}, block=True)),
    }


def _timed(call: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _release_after(session: Any, call: Callable[[], Any]) -> dict[str, float]:
    call()
    view = session.client[[p.engine_id for p in session.placements]]
    costs = view.apply_sync(release_cost)
    return {k: max(c.get(k, 0.0) for c in costs) for k in ("collect_s", "full_collect_s", "trim_s", "cuda_s")}


def big_fit_release(session: Any, layers: int) -> dict[str, Any]:
    """What giving back costs after a DDP fit of ``layers`` x Linear(1024, 1024) with AdamW (the heap it leaves)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import nbddp

    x, y = torch.randn(64, 1024), torch.randn(64, 1024)

    def fit() -> None:
        nbddp.dist_fit(lambda: nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)]), (x, y),
                       max_steps=2, batch_size=16, loss_fn=F.mse_loss, live=False, return_weights=False)

    out: dict[str, Any] = {"params": layers * (1024 * 1024 + 1024)}
    out.update(_release_after(session, fit))
    return out


def measure(reps: int, big_layers: int) -> dict[str, Any]:
    """The four figures and their floors (medians of ``reps`` alternating rounds), and the release costs."""
    from nbddp.session.session import get_session

    import nbddp

    session = get_session()
    nbddp.run(one)  # the workers follow the kernel's sys.path: the floors' functions import from here
    calls = _calls(session, session.world_size)
    times: dict[str, list[float]] = {f"{f}/{side}": [] for f in FIGURES for side in ("nbddp", "floor")}
    for name, (ours, floor) in calls.items():  # warm-up: each path once
        ours(), floor()
    for r in range(reps):
        for name in FIGURES[r % 4:] + FIGURES[:r % 4]:
            ours, floor = calls[name]
            pair = [("nbddp", ours), ("floor", floor)]
            for side, call in (pair if r % 2 == 0 else pair[::-1]):
                times[f"{name}/{side}"].append(_timed(call))
    med = {k: statistics.median(v) for k, v in times.items()}
    apply_floor = med["run/floor"]
    figures = {name: {"nbddp_s": med[f"{name}/nbddp"], "floor_s": med[f"{name}/floor"],
                      "x_floor": med[f"{name}/nbddp"] / med[f"{name}/floor"],
                      "x_apply_floor": med[f"{name}/nbddp"] / apply_floor} for name in FIGURES}
    release = {name: _release_after(session, calls[name][0]) for name in FIGURES}
    release["big_fit"] = big_fit_release(session, big_layers)
    return {"reps": reps, "apply_floor_s": apply_floor, "figures": figures, "release": release, "raw": times}


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows: each figure's seconds and its ratio to its own floor."""
    out = [{"bench": "latency/warm", "competitor": name, "metric": "s/call", "median": f["nbddp_s"],
            "ratio": f["x_floor"], "ratio_of": "x its bare-ipyparallel floor"} for name, f in res["figures"].items()]
    out.append({"bench": "latency/warm", "competitor": "bare apply", "metric": "s/call", "median": res["apply_floor_s"],
                "ratio": 1.0, "ratio_of": "the floor"})
    floor = res["apply_floor_s"]
    for name, cost in res["release"].items():
        label = f"{cost['params'] / 1e6:.0f}M-parameter fit" if name == "big_fit" else name
        spent = cost["collect_s"] + cost["full_collect_s"] + cost["trim_s"] + cost["cuda_s"]
        out.append({"bench": "latency/release", "competitor": f"after {label}", "metric": "give-back s",
                    "median": spent, "ratio": spent / floor, "ratio_of": "x the bare apply floor"})
    return out
