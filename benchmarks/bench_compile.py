"""``dist_fit(compile=True)`` against eager on a small transformer, 2 ranks, in one run:

* **throughput**: samples/s over ``timings['train_s']`` less the slowest
  rank's ``compile_s`` (the first step's compile is inside the loop), of an
  eager fit and of the second compiled fit (graphs from the session's cache);
  reported as measured, whatever it is (``samples_per_s_with_compile`` keeps
  the compile in);
* **first against second fit's compile time**: ``History.ranks[i]["compile_s"]``
  of the first compiled fit (cold: Dynamo, AOTAutograd and Inductor with gcc)
  and of the second (the same model unpickled afresh: Dynamo traces again,
  the graphs come from the session's Inductor cache). Goal: the second at
  least 5x below the first;
* **rank 1 against rank 0**: the first fit's compile time per rank. Both
  compile at once (a fit's ranks start their first step together), so
  neither can reuse the other's graphs: each compiles them and writes them
  to the shared cache. Goal: rank 1 no slower than rank 0 plus 20 %;
* **a new session** (``restored``): the compiled graphs saved with
  ``nbddp.compile_cache(save=...)``, the workers restarted (new engines,
  the session's cache directory removed), the file loaded, and the same fit
  run: its compile time against the first fit's. A new engine still imports
  Inductor and probes the CPU's vector ISA with gcc (tens of seconds on 2
  shared cores), which no cache file carries;
* **rank 1 after rank 0** (``in_turn``): what the shared cache saves a rank
  that compiles what a peer already compiled. Outside a fit (``nbddp.run``),
  the ranks compile one step of a model of another width in turn, rank 0
  first, each with the session's cache directory; a rank starts once the
  rank before it left a file saying it is done (no collective: a cold
  compile may outlast the process group's timeout).

Fresh workers first (``nbddp.restart()``): a worker's first compile imports
Inductor, which is not the compile.

    python benchmarks/bench_compile.py [--quick]     # -> benchmarks/results/<date>_compile.json
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import cloudpickle  # noqa: E402

from benchmarks import common  # noqa: E402

cloudpickle.register_pickle_by_value(_sys.modules[__name__])  # compile_in_turn runs on the workers

NAME = "compile"


def make_model(width: int, layers: int, vocab: int, seq: int):
    """A small causal transformer LM (embedding, ``layers`` pre-norm blocks, head) over ``seq`` tokens."""
    import torch
    import torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.zeros(seq, width))
            self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                                    batch_first=True, norm_first=True)
                                         for _ in range(layers)])
            self.head = nn.Linear(width, vocab)
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

        def forward(self, x):
            h = self.embed(x) + self.pos
            for block in self.blocks:
                h = block(h, src_mask=self.mask)
            return self.head(h).transpose(1, 2)  # (batch, vocab, seq): F.cross_entropy's layout for a sequence

    return LM()


def make_data(n: int, vocab: int, seq: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return x, x.roll(-1, dims=1)


def one_fit(size: dict[str, int], compile: Any, world: int = 2) -> dict[str, Any]:
    import nbddp
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = make_model(size["width"], size["layers"], size["vocab"], size["seq"])
    x, y = make_data(size["rows"], size["vocab"], size["seq"])
    h = nbddp.dist_fit(model, (x, y), epochs=1, batch_size=size["batch"], shuffle=False, live=False,
                       loss_fn=F.cross_entropy, compile=compile)
    samples = len(x) // (world * size["batch"]) * world * size["batch"]
    compile_s = max((r.get("compile_s") or 0.0) for r in h.ranks)
    return {"samples_per_s": samples / (h.timings["train_s"] - compile_s),  # the steps, not the compile inside them
            "samples_per_s_with_compile": samples / h.timings["train_s"], "train_s": h.timings["train_s"],
            "compile_s": [r.get("compile_s") for r in h.ranks],
            "cache_hits": [r.get("compile_cache_hits") for r in h.ranks],
            "recompiles": [r["recompiles"] for r in h.compile_report]}


def compile_in_turn(size: dict[str, int], cache_dir: str) -> dict[str, float]:
    """On every rank, in rank order: compile one step (forward, backward) with the session's cache; time, hits."""
    import os
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from nbddp.protocol.compile_settings import CompileSpec
    from nbddp.worker.strategies.compiling import prepare_inductor

    def hits() -> int:
        return int(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])

    rank = dist.get_rank()
    prepare_inductor(CompileSpec(cache_dir=cache_dir))
    torch.manual_seed(0)
    model = make_model(size["width"], size["layers"], size["vocab"], size["seq"])
    x, y = make_data(size["batch"], size["vocab"], size["seq"])
    before = os.path.join(cache_dir, f"in-turn-{size['width']}-done-{rank - 1}")
    while rank > 0 and not os.path.exists(before):  # the rank before is compiling
        time.sleep(0.2)
    start, hits0 = time.perf_counter(), hits()
    F.cross_entropy(torch.compile(model)(x), y).backward()
    took = time.perf_counter() - start
    open(os.path.join(cache_dir, f"in-turn-{size['width']}-done-{rank}"), "w").close()
    return {"compile_s": took, "cache_hits": hits() - hits0}


def _restored(size: dict[str, int], world: int) -> dict[str, Any]:
    """Save the session's compiled graphs, restart the workers, load the file, fit again (the cache file goes)."""
    import os
    import tempfile

    import nbddp

    folder = tempfile.mkdtemp(prefix="nbddp-bench-compile-")
    try:
        saved = nbddp.compile_cache(save=os.path.join(folder, "cache.bin"))
        nbddp.restart()
        loaded = nbddp.compile_cache(load=saved["path"])
        fit = one_fit(size, True, world)
    finally:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    return {"fit": fit, "file": {"bytes": saved["bytes"], "saved": saved["artifacts"], "loaded": loaded["artifacts"]}}


def main(quick: bool = False) -> dict:
    import nbddp

    size = {"width": 64, "layers": 2, "vocab": 128, "seq": 32, "rows": 256 if quick else 1024, "batch": 16}
    world = common.cuda_count() or 2  # one rank per GPU (nccl); 2 CPU workers (gloo) without CUDA
    out: dict[str, Any] = {"size": size, "world": world}
    common.nbddp_start(world)
    nbddp.restart()
    one_fit(dict(size, rows=64), False, world)  # imports and first-fit costs on each worker, eager
    out["eager"] = one_fit(size, False, world)
    out["first"] = one_fit(size, True, world)
    out["second"] = one_fit(size, True, world)
    # gpu_check.sh's --quick run on CUDA keeps to eager against compiled: its time is capped at 90 s (COMPILE_TIMEOUT)
    extras = world > 1 and not (quick and common.cuda_count())
    if extras:
        from nbddp.protocol.compile_settings import session_cache_dir
        from nbddp.session.session import get_session

        out["in_turn"] = nbddp.run(compile_in_turn, dict(size, width=48),
                                   session_cache_dir(get_session().file_prefix))
        restored = _restored(size, world)
        out["restored"], out["restored_cache_file"] = restored["fit"], restored["file"]
    cold, warm = out["first"]["compile_s"], out["second"]["compile_s"]
    out["second_over_first_compile"] = common.ratio(max(warm), min(cold))
    out["rank1_over_rank0_compile"] = common.ratio(cold[1], cold[0]) if world > 1 else None
    if extras:
        out["restored_over_first_compile"] = common.ratio(max(out["restored"]["compile_s"]), min(cold))
        out["rank1_after_rank0_compile"] = common.ratio(out["in_turn"][1]["compile_s"], out["in_turn"][0]["compile_s"])
    out["compiled_over_eager_throughput"] = common.ratio(out["second"]["samples_per_s"], out["eager"]["samples_per_s"])
    out["goals"] = {"second_fit_5x_faster": out["second_over_first_compile"] <= 0.2,
                    "rank1_within_20pct": None if world == 1 else out["rank1_over_rank0_compile"] <= 1.2,
                    "rank1_after_rank0_within_20pct": out["rank1_after_rank0_compile"] <= 1.2 if extras else None}
    common.print_table([{"fit": k, "samples_per_s": out[k]["samples_per_s"],
                         **{f"compile_s r{r}": s for r, s in enumerate(out[k]["compile_s"])}}
                        for k in ("eager", "first", "second", "restored") if k in out],
                       title=f"dist_fit(compile=True), {world} ranks")
    if extras:
        common.print_table([{"rank": r, **row} for r, row in enumerate(out["in_turn"])],
                           title="compiled in turn, one shared cache (rank 0 first)")
    return out


if __name__ == "__main__":
    common.cli(main, NAME)
