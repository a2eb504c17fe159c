"""2-D meshes on 4 CPU ranks: pipelines x data parallel and tensor parallel x data parallel, equal to one process.

Needs its own workers (``fresh_workers``): the suite's shared session has 2
workers, and a ``dp=2 x pp=2`` or ``dp=2 x tp=2`` mesh needs 4. So this
module starts ONE 4-worker session for all its tests (module scope) and
stops it at the end; the next test that asks for ``workers`` starts the
usual 2 again. The models and the single-process reference are those of
``test_topologies.py``.
"""

from __future__ import annotations

import copy

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

import nbddp
import test_topologies as T

pytestmark = [pytest.mark.fresh_workers, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def four(_suite_session):
    """4 CPU workers for this module; the shared 2 are stopped first (a session has one set of workers)."""
    cloudpickle.register_pickle_by_value(T)  # its models travel by value, as this module's do
    nbddp.stop()
    nbddp.start(n=4, backend="gloo")
    yield
    nbddp.stop()
    cloudpickle.unregister_pickle_by_value(T)


CASES = [
    # GPipe with DDP over dp: torch's reducer asserts under that schedule; nbddp averages the gradients itself
    ("gpipe x ddp", dict(strategy=nbddp.Pipeline(stages=2, microbatches=2, schedule="gpipe"), mesh={"dp": 2, "pp": 2})),
    ("1f1b x fsdp, adamw, accumulation", dict(strategy=nbddp.Pipeline(stages=2, microbatches=2, dp="fsdp"),
                                              mesh={"dp": 2, "pp": 2}, optimizer=torch.optim.AdamW, lr=1e-2,
                                              grad_accum=2)),
    ("tp x ddp, adamw, accumulation, clipping", dict(strategy="ddp", mesh={"dp": 2, "tp": 2}, optimizer=torch.optim.AdamW,
                                                     lr=1e-2, grad_accum=2, clip_grad_norm=0.05)),
    ("tp x fsdp", dict(strategy=nbddp.TensorParallel(dp="fsdp"), mesh={"dp": 2, "tp": 2})),
]


@pytest.mark.parametrize("case,kw", CASES, ids=[c[0] for c in CASES])
def test_a_2d_mesh_trains_the_weights_one_process_trains(four, case, kw):
    val = T.data(21)  # 11 and 10 samples for the two data-parallel ranks; partial last batches
    h, trained, expected, _ = T.same_as_one_process(ref={"dp": 2}, epochs=2, val_data=val, **kw)
    assert T.max_diff(trained, expected) < 1e-5, case
    with torch.no_grad():
        assert h.epochs[-1]["val_loss"] == pytest.approx(F.mse_loss(expected(val[0]), val[1]).item(), rel=1e-9)
    kind = "stage" if "pp" in kw["mesh"] else "tp_rank"
    assert [(r["dp_rank"], r[kind]) for r in h.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert h.steps[-1]["step"] == 2 * 64 // (8 * 2 * kw.get("grad_accum", 1))  # batch_size is per dp rank


def test_a_transformer_block_under_tp_x_fsdp_is_that_of_one_process(four):
    xy = T.data(32, seq=5)
    h, trained, expected, _ = T.same_as_one_process(nbddp.TensorParallel(dp="fsdp"), model_fn=lambda: _block(), xy=xy,
                                                    mesh={"dp": 2, "tp": 2}, batch_size=4, ref={"dp": 2})
    assert T.max_diff(trained, expected) < 1e-5
    total = sum(p.numel() * 8 for p in trained.parameters())
    assert all(r["param_bytes"] < 0.4 * total for r in h.ranks), "split over tp, then sharded over dp"


def _block():
    torch.manual_seed(0)
    return copy.deepcopy(T.Block()).double()


def test_predict_and_evaluate_on_4_ranks_equal_one_process(four):
    """Issue 32 on 4 ranks: 97 samples in blocks of 24, 24, 24, 25, in order; a kept FSDP model over 4 shards; exact F1.

    Then the 2-D meshes: a kept dp=2 x pp=2 pipeline and a dp=2 x tp=2 model, each copy predicting its block
    (48 and 49 samples), the last stage's (tp rank 0's) outputs gathered in the dataset's order.
    """
    from torchmetrics.classification import MulticlassF1Score

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(97, 6, generator=g), torch.randint(0, 3, (97,), generator=g)
    expected = model.eval()(x).detach()
    assert torch.allclose(nbddp.predict(model, (x, y), batch_size=10, live=False), expected, atol=1e-6)
    nbddp.dist_fit(model, (x, y), batch_size=8, epochs=1, strategy="fsdp", keep="sharded", live=False)
    expected = model.eval()(x).detach()
    assert torch.allclose(nbddp.predict("sharded", (x, y), batch_size=10, live=False), expected, atol=1e-5)
    f1 = MulticlassF1Score(3, average="macro")
    f1.update(expected, y)
    got = nbddp.evaluate("sharded", (x, y), batch_size=10, live=False, metrics={"f1": MulticlassF1Score(3, average="macro")})
    assert abs(got["f1"] - float(f1.compute())) < 1e-6
    for mesh, strategy in (({"dp": 2, "pp": 2}, nbddp.Pipeline(stages=2, microbatches=2)),
                           ({"dp": 2, "tp": 2}, nbddp.TensorParallel())):
        trained = copy.deepcopy(model)
        nbddp.dist_fit(trained, (x, y), batch_size=8, epochs=1, strategy=strategy, mesh=mesh, keep="meshed",
                       live=False)
        expected = trained.eval()(x).detach()
        out = nbddp.predict("meshed", (x, y), batch_size=10, live=False)
        assert out.shape == (97, 3) and torch.allclose(out, expected, atol=1e-5), mesh
        f1 = MulticlassF1Score(3, average="macro")
        f1.update(expected, y)
        got = nbddp.evaluate("meshed", (x, y), batch_size=10, live=False,
                             metrics={"f1": MulticlassF1Score(3, average="macro")})
        assert abs(got["f1"] - float(f1.compute())) < 1e-6, mesh
    nbddp.run_cell("del sharded, meshed")


def test_targets_take_every_other_rank_of_four(four, ipython_shell, capsys):
    """``%%ddp --targets ::2``, ipyparallel's slice, runs on ranks 0 and 2 of 4; ``--noblock`` hands back each
    chosen rank's value."""
    ipython_shell.run_line_magic("load_ext", "nbddp")
    try:
        capsys.readouterr()
        ipython_shell.run_cell_magic("ddp", "--targets ::2", "print('ran on', rank, 'of', world_size)")
        assert sorted(capsys.readouterr().out.splitlines()) == ["[rank 0] ran on 0 of 4", "[rank 2] ran on 2 of 4"]
        handle = ipython_shell.run_cell_magic("ddp", "--targets 1: --noblock", "rank * 10")
        assert handle.ranks == [1, 2, 3] and handle.result(timeout=60) == [10, 20, 30]
    finally:
        ipython_shell.run_line_magic("unload_ext", "nbddp")
