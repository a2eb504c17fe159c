"""Pipeline and tensor parallelism on the suite's 2 CPU workers: equal to one process, and everything dist_fit does.

Each fit is compared with the same global batches trained in this process
(``reference``): the batches each data-parallel rank's sampler gives, joined.
float64 where exact equality is the point (the probe measured 0.0 there).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

import nbddp

pytestmark = pytest.mark.timeout(300)


def mlp(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                         nn.Tanh(), nn.Linear(width, 3)).double()


class Attention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4):
        super().__init__()
        self.head_dim = d // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """A transformer block: TP splits q/k/v and fc1 by output features, o_proj and fc2 by input features."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d)
        self.fc1, self.fc2 = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stack(nn.Module):
    """Not an nn.Sequential: a pipeline cuts it at its repeated blocks (traced)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def data(n: int = 64, seq: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    if seq:
        return torch.randn(n, seq, 16, generator=g, dtype=dtype), torch.randn(n, seq, 16, generator=g, dtype=dtype)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype)


def reference(model, xy, *, batch_size=8, dp=1, epochs=1, optimizer=torch.optim.SGD, lr=0.1, grad_accum=1, clip=None,
              seed=0, autocast=False):
    """The same global batches in this process: every dp rank's b-th batch, joined; the mean loss of them."""
    x, y = xy
    ds = TensorDataset(x, y)
    samplers = [DistributedSampler(ds, num_replicas=dp, rank=r, shuffle=True, seed=seed) for r in range(dp)]
    opt = optimizer(model.parameters(), lr=lr)
    model.epoch_losses = []
    for epoch in range(epochs):
        losses = []
        shards = []
        for s in samplers:
            s.set_epoch(epoch)
            shards.append(list(s))
        batches = len(shards[0]) // batch_size
        for start in range(0, batches, grad_accum):
            window = min(grad_accum, batches - start)
            for b in range(start, start + window):
                idx = [i for shard in shards for i in shard[b * batch_size:(b + 1) * batch_size]]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = F.mse_loss(model(x[idx]), y[idx])
                (loss.float() / window).backward()
                losses.append(loss.item())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        model.epoch_losses.append(sum(losses) / len(losses))  # batches of one size: the mean over the samples
    return model


def fit(model, xy, strategy, **kw):
    options = dict(batch_size=8, epochs=1, optimizer=torch.optim.SGD, lr=0.1, live=False, loss_fn=F.mse_loss)
    options.update(kw)
    return nbddp.dist_fit(model, xy, strategy=strategy, **options)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


def same_as_one_process(strategy, model_fn=mlp, xy=None, ref=None, **kw):
    """Train ``model_fn()`` with ``strategy`` and in this process; return (history, distributed, reference, base)."""
    xy = xy if xy is not None else data()
    base = model_fn()
    trained = copy.deepcopy(base)
    h = fit(trained, xy, strategy, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("batch_size", "epochs", "optimizer", "lr", "grad_accum")}
    if "clip_grad_norm" in kw:
        ref_kw["clip"] = kw["clip_grad_norm"]
    expected = reference(copy.deepcopy(base), xy, **{**ref_kw, **(ref or {})})
    assert max_diff(trained, base) > 1e-3, "the weights did not train"
    # the loss of the last stage (or of one rank of a TP group), reduced over the data-parallel ranks
    assert [e["loss"] for e in h.epochs] == pytest.approx(expected.epoch_losses, rel=1e-6)
    return h, trained, expected, base


# ---- correctness -------------------------------------------------------------------


def test_a_pipeline_trains_the_weights_one_process_trains(workers):
    """GPipe and 1F1B, SGD and AdamW (one test: four small fits on warm workers)."""
    for schedule in ("gpipe", "1f1b"):
        for optimizer, lr in ((torch.optim.SGD, 0.1), (torch.optim.AdamW, 1e-2)):
            h, trained, expected, _ = same_as_one_process(nbddp.Pipeline(stages=2, microbatches=4, schedule=schedule),
                                                          optimizer=optimizer, lr=lr)
            assert max_diff(trained, expected) < 1e-5, (schedule, optimizer)
    assert [r["stage"] for r in h.ranks] == [0, 1] and [r["dp_rank"] for r in h.ranks] == [0, 0]
    sizes = [sum(p.numel() * 8 for p in part.parameters()) for part in (expected[:4], expected[4:])]
    assert [r["param_bytes"] for r in h.ranks] == sizes, "each rank holds its stage's parameters only"


def test_interleaved_stages_accumulation_and_global_clipping_are_those_of_one_process(workers):
    """Four stages on two ranks (0 and 2 on rank 0); the clip bites (the norm is far above 0.05)."""
    strategy = nbddp.Pipeline(stages=4, microbatches=2, schedule="interleaved")
    h, trained, expected, _ = same_as_one_process(strategy, grad_accum=2, clip_grad_norm=0.05, epochs=2)
    assert max_diff(trained, expected) < 1e-5
    assert [r["stage"] for r in h.ranks] == [[0, 2], [1, 3]]
    assert h.steps[-1]["step"] == 8  # 64 samples, 8 per batch, 2 per step, 2 epochs


def test_tensor_parallel_trains_an_mlp_as_one_process(workers):
    h, trained, expected, base = same_as_one_process(nbddp.TensorParallel(), optimizer=torch.optim.AdamW, lr=1e-2,
                                                     grad_accum=2, clip_grad_norm=0.05)
    assert max_diff(trained, expected) < 1e-5
    assert [r["tp_rank"] for r in h.ranks] == [0, 1]
    total = sum(p.numel() * 8 for p in base.parameters())
    assert all(r["param_bytes"] < 0.7 * total for r in h.ranks), "the split layers hold half their weights per rank"


def test_tensor_parallel_trains_a_transformer_block_as_one_process(workers):
    def block():
        torch.manual_seed(0)
        return Block().double()

    xy = data(32, seq=5)
    h, trained, expected, _ = same_as_one_process(nbddp.TensorParallel(), model_fn=block, xy=xy)
    assert max_diff(trained, expected) < 1e-5
    losses = [e["loss"] for e in h.epochs]
    assert len(losses) == 1 and losses[0] > 0


def test_a_model_that_is_not_sequential_is_cut_at_its_repeated_blocks_and_validated(workers):
    """Traced into two stages; validation runs a 21-sample set (a partial last batch is padded, then cut back)."""
    xy = data()
    val = data(21)
    metrics = {"mae": lambda out, y: (out - y).abs().mean()}
    h, trained, expected, _ = same_as_one_process(nbddp.Pipeline(stages=2, microbatches=2), model_fn=lambda: _stack(),
                                                  xy=xy, val_data=val, metrics=metrics)
    assert max_diff(trained, expected) < 1e-5
    with torch.no_grad():
        out = expected(val[0])
    assert h.epochs[-1]["val_loss"] == pytest.approx(F.mse_loss(out, val[1]).item(), rel=1e-9)
    assert h.epochs[-1]["val_mae"] == pytest.approx(_batched_mae(out, val[1], 8), rel=1e-9)


def _stack():
    torch.manual_seed(0)
    return Stack().double()


def _batched_mae(out, y, b):
    """The metric as validation computes it: per batch, weighted by the batch's samples."""
    total = sum((out[i:i + b] - y[i:i + b]).abs().mean().item() * len(y[i:i + b]) for i in range(0, len(y), b))
    return total / len(y)


def test_bf16_trains_close_to_one_process_under_both(workers):
    xy = data(dtype=torch.float32)
    for strategy in (nbddp.Pipeline(stages=2, microbatches=2), nbddp.TensorParallel()):
        base = mlp().float()
        trained = copy.deepcopy(base)
        h = fit(trained, xy, strategy, precision="bf16-mixed")
        expected = reference(copy.deepcopy(base), xy, autocast=True)
        assert h.status == "completed" and max_diff(trained, expected) < 2e-2, strategy
        assert max_diff(trained, base) > 1e-2


# ---- what dist_fit does ------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [nbddp.Pipeline(stages=2, microbatches=2), nbddp.TensorParallel()],
                         ids=["pipeline", "tensor"])
def test_a_mid_epoch_checkpoint_resumes_exactly_and_keep_binds_each_ranks_part(workers, strategy, tmp_path):
    xy = data()
    base = mlp()
    model = copy.deepcopy(base)
    h1 = fit(model, xy, strategy, epochs=2, optimizer=torch.optim.AdamW, lr=1e-2, checkpoint_dir=tmp_path,
             checkpoint_every=3, max_steps=5)
    assert h1.steps[-1]["step"] == 5 and "step-00000005" in os.listdir(tmp_path)
    assert len([n for n in os.listdir(tmp_path / "step-00000005") if n.endswith(".distcp")]) == 2, "one file per rank"
    h2 = fit(model, xy, strategy, epochs=2, optimizer=torch.optim.AdamW, lr=1e-2, checkpoint_dir=tmp_path, resume=True,
             keep="part")
    assert h2.steps[0]["step"] > 5 and h2.steps[-1]["step"] == 16
    expected = reference(copy.deepcopy(base), xy, epochs=2, optimizer=torch.optim.AdamW, lr=1e-2)
    assert max_diff(model, expected) < 1e-5
    nbddp.run_cell("kept = sorted(part.state_dict())")
    kept = [nbddp.pull("kept", rank=r)["kept"] for r in (0, 1)]
    if strategy.name == "pipeline":
        assert kept == [["0.bias", "0.weight", "2.bias", "2.weight"], ["4.bias", "4.weight", "6.bias", "6.weight"]]
    else:
        assert kept[0] == kept[1] == sorted(base.state_dict())


def test_max_steps_and_an_interrupt_stop_every_stage_at_one_step(workers):
    xy = data(2048)
    model = mlp()
    handle = fit(model, xy, nbddp.Pipeline(stages=2, microbatches=2), epochs=50, block=False, log_every=1)
    deadline = time.monotonic() + 60
    while not handle.history.steps and time.monotonic() < deadline:
        time.sleep(0.05)
    handle.stop()
    h = handle.wait()
    assert h.status == "interrupted" and 0 < h.steps[-1]["step"] < 50 * 256
    h = fit(mlp(), xy, nbddp.TensorParallel(), max_steps=3)
    assert h.steps[-1]["step"] == 3 and h.status == "completed"


def test_a_tp_a_pipeline_and_an_fsdp_fit_run_one_after_another_in_either_order(workers):
    """TP, PP, FSDP, PP, TP: each fit makes its groups and meshes again; stale DTensor plans would fail or hang."""
    xy = data()
    strategies = [nbddp.TensorParallel(), nbddp.Pipeline(stages=2, microbatches=2), "fsdp",
                  nbddp.Pipeline(stages=2, microbatches=2, schedule="gpipe"), nbddp.TensorParallel()]
    expected = {1: reference(mlp(), xy), 2: reference(mlp(), xy, dp=2)}  # FSDP: two data-parallel ranks
    for strategy in strategies:
        model = mlp()
        fit(model, xy, strategy)
        assert max_diff(model, expected[2 if strategy == "fsdp" else 1]) < 1e-5, strategy


def test_the_planner_measures_each_strategy(workers):
    xy = data()
    report = nbddp.scaling_report(mlp(), xy, strategy=nbddp.Pipeline(stages=2, microbatches=2), batch_size=8,
                                  loss_fn=F.mse_loss, steps=2, warmup=1)
    assert [r["world_size"] for r in report.rows] == [1, 2]
    assert [r["topology"] for r in report.rows] == ["ddp", "pp=2 (1f1b)"]
    assert "2 (pp=2 (1f1b))" in repr(report)
    report = nbddp.scaling_report(mlp(), xy, mesh={"tp": 2}, strategy="fsdp", batch_size=8, loss_fn=F.mse_loss,
                                  steps=2, warmup=1)
    assert [r["topology"] for r in report.rows] == ["fsdp", "tp=2"] and all(r["samples_per_s"] > 0 for r in report.rows)
    found = nbddp.find_batch_size(mlp(), xy, strategy=nbddp.Pipeline(stages=2, microbatches=4), max_batch_size=10,
                                  loss_fn=F.mse_loss)
    assert found == 8, "multiples of the microbatches, up to the bound"
    assert nbddp.find_batch_size(mlp(), xy, strategy=nbddp.TensorParallel(), max_batch_size=2,
                                 loss_fn=F.mse_loss) == 2


# ---- bad input ----------------------------------------------------------------------


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        return self.fc(x)


BAD = [
    ("a split that leaves a stage empty", dict(strategy=nbddp.Pipeline(stages=2, split=["0"])), ValueError,
     r"split=\['0'\]\) leaves stage 0 of Sequential empty \(no parameters; parameters per stage: \[0, 707\]\)"),
    ("fewer microbatches than stages under 1F1B", lambda: dict(strategy=nbddp.Pipeline(stages=2, microbatches=1)),
     ValueError, r"schedule='1f1b'\) needs at least one micro-batch per stage, got microbatches=1 for stages=2"),
    ("a batch the microbatches do not divide", dict(strategy=nbddp.Pipeline(microbatches=4), batch_size=10), ValueError,
     r"batch_size=10\) does not split into microbatches=4 equal micro-batches.*batch_size=8 or 12"),
    ("a TP plan naming no module", dict(strategy=nbddp.TensorParallel(plan={"nope": "colwise"})), ValueError,
     r"plan=\.\.\.\) names 'nope', which Sequential does not have; its nn.Linear layers are: 0, 2, 4, 6"),
    ("a TP dimension the size does not divide", dict(model=Plain(), strategy=nbddp.TensorParallel(plan={"fc": "colwise"})),
     ValueError, r"fc \(Linear.*\) is split by its output features, 5, which 2 ranks do not divide"),
    ("a mesh whose product is not the world", dict(mesh={"dp": 2, "pp": 2}), ValueError,
     r"mesh=\{'dp': 2, 'pp': 2\}\) spans 4 ranks, but 2 workers are running"),
    ("a data-parallel mesh of the wrong size", dict(mesh={"dp": 4}), ValueError, r"spans 4 ranks, but 2 workers"),
    ("an unknown schedule", lambda: dict(strategy=nbddp.Pipeline(schedule="zigzag")), ValueError,
     r"schedule='zigzag'\) is not a schedule nbddp knows; use one of \('1f1b', 'gpipe', 'interleaved'\)"),
    ("an unknown mesh dimension", dict(mesh={"dp": 1, "xx": 2}), ValueError, r"unknown dimension\(s\) \['xx'\]"),
    ("a mesh that is not a dict", dict(mesh=[2, 2]), TypeError, r"mesh=\.\.\.\) must be a dict of dimension -> size"),
    ("a mesh size that is not an int", dict(mesh={"pp": 2.0}), TypeError, r"mesh=\.\.\.\)\(pp=\.\.\.\) must be an int"),
    ("pipeline and tensor parallel together", dict(mesh={"pp": 2, "tp": 2}), ValueError, r"together \(3-D\) are not"),
    ("a pipeline without a pp dimension", dict(strategy=nbddp.Pipeline(), mesh={"dp": 2}), ValueError,
     r"needs a 'pp' dimension of 2 or more in mesh=\.\.\., got mesh=\{'dp': 2\}"),
    ("stages the workers do not divide", dict(strategy=nbddp.Pipeline(stages=3, microbatches=3)), ValueError,
     r"Pipeline\(stages=3\) needs a multiple of 3 workers, but 2 are running"),
    ("more stages than the pp dimension", dict(strategy=nbddp.Pipeline(stages=3, microbatches=3), mesh={"pp": 2}),
     ValueError, r"holds one stage per rank, but the mesh's 'pp' dimension is 2; use stages=2, or schedule='interleaved'"),
    ("interleaved stages that are no multiple of pp",
     dict(strategy=nbddp.Pipeline(stages=3, schedule="interleaved", microbatches=3)), ValueError,
     r"stages=3\) on a pipeline of 2 ranks: each rank holds stages/pp pieces, so stages must be a multiple of 2"),
    ("interleaved microbatches torch cannot schedule",
     dict(strategy=nbddp.Pipeline(stages=4, schedule="interleaved", microbatches=5), batch_size=5), ValueError,
     r"microbatches=5\) on 2 ranks: torch's interleaved 1F1B needs a multiple of 2 micro-batches"),
    ("a step_fn under a pipeline", dict(strategy=nbddp.Pipeline(microbatches=2), step_fn=lambda m, b: m(b[0]).sum()),
     ValueError, r"step_fn=\.\.\.\) cannot run under nbddp.Pipeline: no rank holds the whole model"),
    ("too many stages for the model", dict(model=Plain(), strategy=nbddp.Pipeline(microbatches=2)), ValueError,
     r"cannot cut Plain: it has 0 repeated blocks"),
    ("more stages than pieces with parameters",
     dict(model=nn.Sequential(nn.Linear(6, 3), nn.Tanh()), strategy=nbddp.Pipeline(microbatches=2)), ValueError,
     r"cannot cut 2 pieces with 1 holding parameters into 2 stages"),
    ("a cut point that does not exist", dict(strategy=nbddp.Pipeline(microbatches=2, split=["9"])), ValueError,
     r"Sequential has no module '9'; name modules where a stage begins, such as 0, 1, 2"),
    ("cut points out of order", dict(strategy=nbddp.Pipeline(stages=4, schedule="interleaved", microbatches=2,
                                                             split=["4", "2", "6"])),
     ValueError, r"the cut points must be in the model's order"),
    ("no layers for tensor parallelism", dict(model=Plain(), strategy=nbddp.TensorParallel()), ValueError,
     r"TensorParallel\(plan=None\) found no layers to split in Plain.*Pass plan="),
    ("a dp that is no data parallelism", lambda: dict(strategy=nbddp.Pipeline(dp="tp")), ValueError,
     r"Pipeline\(dp=\.\.\.\) says what runs over the data-parallel dimension: 'ddp', 'fsdp'"),
    ("stages that are not an int", lambda: dict(strategy=nbddp.Pipeline(stages="2")), TypeError,
     r"Pipeline\(stages=\.\.\.\) must be an int, got str '2'"),
    ("one stage", lambda: dict(strategy=nbddp.Pipeline(stages=1)), ValueError, r"stages=\.\.\.\) must be >= 2, got 1"),
    ("a split that is not names", lambda: dict(strategy=nbddp.Pipeline(split=1.5)), TypeError,
     r"split=\.\.\.\) takes the names of the modules that begin a stage"),
    ("a split of odd items", lambda: dict(strategy=nbddp.Pipeline(split=[None])), TypeError,
     r"split=\.\.\.\) takes module names \(or an nn.Sequential's child indices\)"),
    ("a split of the wrong length", lambda: dict(strategy=nbddp.Pipeline(split=["2", "4"])), ValueError,
     r"names 2 cut point\(s\); 2 stages need 1"),
    ("a split that names a cut twice", lambda: dict(strategy=nbddp.Pipeline(stages=3, split=["2", "2"])), ValueError,
     r"names a cut point twice, which leaves a stage empty"),
    ("a plan that is not a dict", lambda: dict(strategy=nbddp.TensorParallel(plan=["fc1"])), TypeError,
     r"plan=\.\.\.\) must be None or a non-empty dict"),
    ("a plan with an unknown style", lambda: dict(strategy=nbddp.TensorParallel(plan={"0": "diagonal"})), ValueError,
     r"'0': 'diagonal' is not 'colwise', 'rowwise' or a"),
]


def test_bad_topologies_fail_before_training_with_the_fix(workers):
    """One test for all the cases (each is checked in the kernel, before anything is shipped)."""
    for case, kwargs, exc, match in BAD:
        with pytest.raises(exc, match=match):
            kw = kwargs() if callable(kwargs) else dict(kwargs)
            model = kw.pop("model", None) or mlp()
            fit(model, data(), kw.pop("strategy", "ddp"), **kw)
            pytest.fail(f"{case}: no error")
    assert nbddp.status()["running"], "nothing reached the workers"


def test_a_pipeline_refuses_dict_batches_on_the_workers(workers):
    dicts = [{"x": x, "labels": y} for x, y in zip(*data(16))]
    with pytest.raises(nbddp.WorkerError, match=r"Pipeline trains on \(x, y\) or \(x1, \.\.\., y\) batches"):
        fit(mlp(), dicts, nbddp.Pipeline(microbatches=2))


class Rows(torch.utils.data.IterableDataset):
    """A stream of (x, y) rows in order (shards_itself: every rank of the TP group reads all of it, as one dp rank)."""

    def __init__(self, xy):
        self.x, self.y = xy

    def __iter__(self):
        return iter(zip(self.x, self.y))


def test_a_stream_trains_under_tensor_parallelism_as_the_same_rows_in_a_map_style_dataset(workers):
    """Both ranks of the TP group read the stream's one data-parallel part: the weights of the ordered dataset."""
    xy = data(32)
    streamed, ordered = mlp(), mlp()
    fit(streamed, Rows(xy), nbddp.TensorParallel(), shuffle=False)
    fit(ordered, xy, nbddp.TensorParallel(), shuffle=False)
    assert max_diff(streamed, mlp()) > 1e-3 and max_diff(streamed, ordered) < 1e-12


def test_a_stream_under_a_pipeline_is_refused_naming_what_works(workers):
    with pytest.raises(ValueError, match=r"is a stream \(an IterableDataset\), and nbddp.Pipeline needs a map-style"):
        fit(mlp(), Rows(data(32)), nbddp.Pipeline(microbatches=2))


# ---- units: no workers ---------------------------------------------------------------------


def test_fp16_with_a_gradient_scaler_is_refused_under_model_parallelism():
    from nbddp.fit.parallel_checks import check_batch

    for strategy in (nbddp.Pipeline(), nbddp.TensorParallel()):
        with pytest.raises(ValueError, match=r"precision='16-mixed'\) cannot train under nbddp\.\w+: its gradient "
                                             r"scaler decides on each rank alone.*Use precision='bf16-mixed'"):
            check_batch(strategy, 8, None, "16-mixed")


def test_the_balanced_cut_makes_the_largest_stage_smallest():
    from nbddp.partitioning.pipeline_stages import balanced_cuts, plan_stages

    assert balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert balanced_cuts([10, 1, 1, 1, 1, 10], 3) == [1, 5]
    assert balanced_cuts([0, 5, 5], 2) == [2], "a piece without parameters never makes a stage of its own"
    assert plan_stages(mlp(), 2, None) == ["4"] and plan_stages(Stack(), 2, None) == ["blocks.1"]


def test_the_tp_plan_finds_the_usual_pairs():
    from nbddp.partitioning.tensor_plan import find_plan

    assert find_plan(Block()) == {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                                  "attn.o_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}
    assert find_plan(mlp()) == {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def test_a_rank_waiting_in_a_collective_is_waiting_and_its_peer_is_stalled():
    from nbddp.protocol.messages import Beat
    from nbddp.execution.stalls import MIN_STALL_S, StallWatch

    now = [0.0]
    watch = StallWatch([0, 1], clock=lambda: now[0])
    watch.feed(0, Beat(rank=0, seq=1, progress=5, phase="collective", step=3, micro=4, step_time_s=0.1, idle_s=0.0))
    watch.feed(1, Beat(rank=1, seq=1, progress=5, phase="forward", step=3, micro=4, step_time_s=0.1, idle_s=0.0))
    now[0] = MIN_STALL_S + 1
    assert [s["rank"] for s in watch.stalled()] == [1]
    assert [p["phase"] for p in watch.positions()] == ["waiting", "forward"]


class Branchy(nn.Module):
    def __init__(self, used=(0, 1)):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.used = used
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for i in self.used:
            x = self.blocks[i](x) if x.sum() > 0 else -self.blocks[i](x)  # data-dependent: torch.export refuses it
        return self.head(x)


class Skips(Branchy):
    def forward(self, x):
        for i in self.used:
            x = self.blocks[i](x)
        return self.head(x)


def test_a_model_that_cannot_be_traced_into_its_stages_is_refused_with_the_fix():
    from nbddp.partitioning.pipeline_stages import stage_modules

    example = (torch.randn(2, 6),)
    with pytest.raises(RuntimeError, match=r"could not trace Branchy into stages .*Write the model as an nn.Sequential"):
        stage_modules(Branchy(), ["blocks.1"], example)
    with pytest.raises(RuntimeError, match=r"tracing Skips gave 1 stages, not 2: a cut point in \['blocks.1'\] is not"):
        stage_modules(Skips(used=(0, 2)), ["blocks.1"], example)
