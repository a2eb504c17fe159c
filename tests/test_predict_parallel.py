"""``nbddp.predict``/``evaluate`` on models kept by model-parallel fits, on the shared 2 CPU workers.

A kept pipeline (2 stages on 2 ranks: one model copy), a kept
tensor-parallel model, and a kept FSDP model over a stream: the outputs
equal a loop in this process over the same data, in order. The models are
float64 where equality is the point.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from nbddp.protocol.errors import WorkerDied, WorkerError

pytestmark = pytest.mark.timeout(240)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def data(n: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


def kept(name: str, strategy, precision: str = "32-true") -> nn.Module:
    """A short fit that keeps the model as ``name``; the notebook's model holds the same trained weights."""
    model, (x, y) = mlp(), data(32)
    if precision != "32-true":
        model = model.float()
        x = x.float()
    nbddp.dist_fit(model, (x, y), batch_size=8, epochs=1, lr=0.05, loss_fn=F.cross_entropy, live=False,
                   strategy=strategy, keep=name, precision=precision)
    return model.eval()


def test_a_kept_pipeline_predicts_in_order_equal_to_one_process(workers, tmp_path):
    """2 stages on 2 ranks; 37 samples in batches of 10 (the last one padded to 10, and cut back); 4 micro-batches.

    Only the last stage (rank 1) holds outputs: it alone sends them, or writes a part with to=."""
    model = kept("staged", nbddp.Pipeline(stages=2, microbatches=4))
    x, y = data()
    with torch.no_grad():
        expected = model(x)
    out = nbddp.predict("staged", (x, y), batch_size=10, live=False)
    assert out.shape == (37, 3) and torch.allclose(out, expected, atol=1e-12)
    out, ids = nbddp.predict("staged", Stream(x, y), batch_size=4, live=False)  # one copy: the whole stream
    assert torch.equal(ids, torch.arange(37)) and torch.allclose(out, expected, atol=1e-12)
    paths = nbddp.predict("staged", (x, y), batch_size=10, live=False, to=tmp_path / "parts")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["part-00001.pt"]
    assert torch.allclose(torch.load(paths[0])["value"], expected, atol=1e-12)
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    f1, auroc = MulticlassF1Score(3, average="macro"), MulticlassAUROC(3)
    f1.update(expected.float(), y)
    auroc.update(expected.float(), y)
    got = nbddp.evaluate("staged", (x, y), batch_size=10, live=False, loss_fn=F.cross_entropy,
                         metrics={"f1": MulticlassF1Score(3, average="macro"), "auroc": MulticlassAUROC(3)})
    assert abs(got["f1"] - float(f1.compute())) < 1e-6 and abs(got["auroc"] - float(auroc.compute())) < 1e-6
    assert got["loss"] == pytest.approx(F.cross_entropy(expected, y).item(), rel=1e-9)
    # step_fn's model stands for the pipeline on the batch: the same step as for a whole model, on the last stage
    step = nbddp.predict("staged", (x, y), batch_size=10, live=False,
                         step_fn=lambda m, b: {"label": m(b[0]).argmax(1), "right": m(b[0]).argmax(1) == b[1]})
    assert torch.equal(step["label"], expected.argmax(1)) and torch.equal(step["right"], expected.argmax(1) == y)
    pulled = nbddp.pull("staged", rank=1)["staged"]  # the record of the rank's part stays on the worker
    assert torch.allclose(pulled(model[:4](x)), expected, atol=1e-12)
    nbddp.run_cell("del staged")


def test_interleaved_stages_of_a_kept_pipeline_predict_in_order(workers):
    """Four stages, two per rank (0 and 2 on rank 0): the interleaved schedule's forward-only pass."""
    model = kept("four", nbddp.Pipeline(stages=4, microbatches=2, schedule="interleaved"))
    x, y = data()
    with torch.no_grad():
        expected = model(x)
    assert torch.allclose(nbddp.predict("four", (x, y), batch_size=8, live=False), expected, atol=1e-12)
    nbddp.run_cell("del four")


def test_a_kept_tensor_parallel_model_predicts_as_one_process(workers):
    model = kept("split", nbddp.TensorParallel())
    x, y = data()
    with torch.no_grad():
        expected = model(x)
    out = nbddp.predict("split", (x, y), batch_size=10, live=False,
                        step_fn=lambda m, b: {"logits": m(b[0]), "label": m(b[0]).argmax(1)})
    assert torch.allclose(out["logits"], expected, atol=1e-10) and torch.equal(out["label"], expected.argmax(1))
    from torchmetrics.classification import MulticlassF1Score

    f1 = MulticlassF1Score(3, average="macro")
    f1.update(expected.float(), y)
    got = nbddp.evaluate("split", (x, y), batch_size=10, live=False, metrics={"f1": MulticlassF1Score(3, average="macro"),
                                                                             "acc": accuracy})
    assert abs(got["f1"] - float(f1.compute())) < 1e-6
    assert abs(got["acc"] - float(accuracy(expected, y).double().mean())) < 1e-9
    nbddp.run_cell("del split")


def accuracy(outputs, targets):
    return (outputs.argmax(1) == targets).float()


def test_a_kept_fsdp_model_predicts_a_stream_whose_ends_differ_by_rank(workers):
    """37 samples: rank 0 reads 19 (batches 4, 4, 4, 4, 3), rank 1 reads 18: at the last batch rank 1 runs a dummy
    forward (its parameters' all-gathers need it) and drops its output."""
    model = kept("sharded", "fsdp")
    x, y = data()
    with torch.no_grad():
        expected = model(x)
    out, ids = nbddp.predict("sharded", Stream(x, y), batch_size=4, live=False)
    assert torch.equal(ids, torch.arange(37)) and torch.allclose(out, expected, atol=1e-12)
    got = nbddp.evaluate("sharded", Stream(x, y), batch_size=4, live=False, metrics={"acc": accuracy})
    assert abs(got["acc"] - float(accuracy(expected, y).double().mean())) < 1e-9
    nbddp.run_cell("del sharded")


@pytest.mark.faults  # ranks fail: the group is formed again (seconds), out of the quick tier
def test_what_a_collective_forward_cannot_run_fails_on_every_rank_naming_the_fix(workers):
    """Raised on every rank at the same batch (no rank left waiting in a forward): a dict batch for a pipeline's
    stages; a stream with no sample for rank 1 under a kept FSDP model."""
    x, y = data()
    kept("staged", nbddp.Pipeline(stages=2, microbatches=2))
    with pytest.raises(WorkerError, match=r"a kept nbddp.Pipeline predicts \(x,\), \(x, y\).*got a dict batch"):
        nbddp.predict("staged", [{"x": row} for row in x[:4]], batch_size=2, live=False)
    workers.wait_healed()
    kept("sharded", "fsdp")
    with pytest.raises(WorkerError, match=r"rank 1 got no sample of the stream, while rank 0 did.*at least as many"):
        nbddp.predict("sharded", Stream(x[:1], y[:1]), batch_size=4, live=False)
    workers.wait_healed()
    nbddp.run_cell("del staged, sharded")


def test_predict_runs_at_the_kept_models_fit_precision_unless_told(workers):
    """A bf16 fit predicts under bf16 autocast (its logits are bf16); precision="32-true" gives float32 back."""
    kept("half", "ddp", precision="bf16-mixed")
    x, _ = data()
    assert nbddp.predict("half", (x.float(),), batch_size=10, live=False).dtype == torch.bfloat16
    full = nbddp.predict("half", (x.float(),), batch_size=10, live=False, precision="32-true")
    assert full.dtype == torch.float32
    kept("whole", "ddp")
    assert nbddp.predict("whole", (x,), batch_size=10, live=False).dtype == torch.float64
    nbddp.run_cell("del half, whole")


def test_a_stopped_predict_on_a_collective_model_returns_nothing_and_the_next_call_works(workers, tmp_path):
    """The stop reaches the ranks at different moments; the lockstep agreement stops both at the same batch (a rank
    that stopped alone would leave the other waiting in a tensor-parallel all-reduce)."""
    import time

    from test_predict import Slow, both_started

    model = kept("split", nbddp.TensorParallel())
    x, _ = data()
    pids = nbddp.run(os.getpid)
    handle = nbddp.predict("split", (x,), batch_size=1, live=False, block=False, step_fn=Slow(str(tmp_path), 0.1))
    deadline = time.monotonic() + 60
    while not both_started(tmp_path)() and time.monotonic() < deadline:
        time.sleep(0.05)
    handle.stop()
    with pytest.raises(KeyboardInterrupt, match="returns nothing"):
        handle.wait()
    assert nbddp.run(os.getpid) == pids, "both ranks stopped cleanly: none was killed and replaced"
    with torch.no_grad():
        assert torch.allclose(nbddp.predict("split", (x[:5],), batch_size=2, live=False), model(x[:5]), atol=1e-10)
    nbddp.run_cell("del split")


class RaiseOnRank1:
    """A step that raises on rank 1 at the batch holding sample 20, while rank 0 goes into the forward's
    all-reduce and waits there for rank 1."""

    def __call__(self, model, batch):
        import torch.distributed as dist

        if dist.get_rank() == 1 and bool((batch[0][:, 0] == 1000.0).any()):
            raise ValueError("a sample out of range")
        return model(batch[0])


@pytest.mark.faults  # a rank fails and its peer, stuck in a collective, is replaced: out of the quick tier
def test_a_rank_that_raises_inside_a_collective_forward_is_named_and_its_waiting_peer_replaced(workers):
    kept("split", nbddp.TensorParallel())
    x, _ = data()
    x[20, 0] = 1000.0  # one copy: both ranks read the whole set; batches of 10 from 0: the one holding 20 is 20..29
    with pytest.raises(WorkerError, match=r"rank 1.*ValueError: a sample out of range.*samples 20\.\.29") as info:
        nbddp.predict("split", (x,), batch_size=10, live=False, step_fn=RaiseOnRank1())
    assert info.value.rank == 1
    workers.wait_healed()
    assert nbddp.predict(mlp(), (x[:4],), batch_size=2, live=False).shape == (4, 3)  # the next call works
    nbddp.run_cell("split = None\ndel split")  # a replaced rank holds nothing under it any more, the other may


class MarkThenSlow:
    """A step (run on the pipeline's last stage) that marks its first batch at ``path``, then takes ``delay`` s a
    batch, so that a kill lands mid-predict."""

    def __init__(self, path: str, delay: float):
        self.path, self.delay = path, delay

    def __call__(self, model, batch) -> torch.Tensor:
        import time

        if not os.path.exists(self.path):
            open(self.path, "w").close()
        time.sleep(self.delay)
        return model(batch[0])


def test_a_kept_pipelines_step_stand_in_refuses_what_only_a_whole_model_can_do():
    from nbddp.worker.inference.pipeline_step import PipelineOutputs, PipelineStepError

    x = torch.zeros(4, 6)
    model = PipelineOutputs("outputs", (x,))
    assert model(x) == "outputs" and model(x.clone()) == "outputs"  # the batch's inputs, or equal ones
    with pytest.raises(PipelineStepError, match=r"called model\(a tensor of shape \(4, 6\), mask=...\), not on the "
                                                r"batch's inputs \(a tensor of shape \(4, 6\)\).*return_weights=True"):
        model(x, mask=None)
    with pytest.raises(AttributeError, match=r"asked for model.encoder: no rank holds the whole model.*call it once"):
        model.encoder(x)


@pytest.mark.faults  # ranks fail or are killed: the group is formed again twice (seconds), out of the quick tier
def test_faults_in_a_kept_pipelines_predict_name_the_rank_and_the_next_call_works(workers, tmp_path):
    """A step that misuses the pipeline's stand-in fails on the last stage (rank 1), named; a first stage killed
    mid-predict (its peer waits for it in a recv) is named with its signal; both times the peers are replaced."""
    x, y = data()
    kept("staged", nbddp.Pipeline(stages=2, microbatches=2))
    with pytest.raises(WorkerError, match=r"rank 1.*PipelineStepError: a kept pipeline's step_fn called model\(a "
                                          r"tensor of shape \(10, 6\)\), not on the batch's inputs"):
        nbddp.predict("staged", (x, y), batch_size=10, live=False, step_fn=lambda m, b: m(b[0] * 2))
    workers.wait_healed()
    kept("staged", nbddp.Pipeline(stages=2, microbatches=2))
    victim, marker = workers.placements[0], str(tmp_path / "started")
    handle = nbddp.predict("staged", (x, y), batch_size=1, live=False, block=False, step_fn=MarkThenSlow(marker, 0.1))
    deadline = time.time() + 120
    while not os.path.exists(marker) and time.time() < deadline and not handle.done():
        time.sleep(0.05)
    assert os.path.exists(marker), "the last stage never started predicting"
    os.kill(victim.pid, signal.SIGKILL)  # a real engine process, by pid
    killed = time.time()
    with pytest.raises(WorkerDied) as info:
        handle.wait()
    assert time.time() - killed < 30.0  # seconds, not a process-group timeout
    assert info.value.rank == 0 and "SIGKILL" in str(info.value) and f"pid {victim.pid}" in str(info.value)
    workers.wait_healed()
    assert victim.pid not in [p.pid for p in workers.placements]
    assert nbddp.predict(mlp(), (x[:4],), batch_size=2, live=False).shape == (4, 3)  # the next call works
    nbddp.run_cell("staged = None\ndel staged")  # a replaced rank holds nothing under it any more, the other may
