"""``nbddp.predict`` and ``nbddp.evaluate`` on the shared 2 CPU workers: order, exactness, faults, bad input.

The outputs are compared with a loop over the same data in this process:
every sample once, in the dataset's order, whatever the length (97 samples on
2 ranks: blocks of 48 and 49).
"""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp
from interrupts import interrupt_when
from nbddp.protocol.errors import ShippingError, WorkerError
from nbddp.shipping.batched_outputs import assemble, batches_of, join

pytestmark = pytest.mark.timeout(180)


def net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))


def data(n: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


class Rows(torch.utils.data.Dataset):
    """A map-style dataset of ``(x, y)`` rows (not a TensorDataset: the generic path)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Numbers(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


class Stream(torch.utils.data.IterableDataset):
    """``(x[i], y[i])`` in order, read by iterating: the length is known only at the end."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


class SelfSharding(Stream):
    shards_itself = True


# ---- the outputs, put together (no workers) -----------------------------------------------------------------


def test_parts_join_in_rank_order_and_fall_back_to_a_list_of_batches():
    a, b = torch.arange(6.).view(3, 2), torch.arange(6., 10.).view(2, 2)
    assert torch.equal(assemble([{"kind": "tensor", "value": a, "rows": [2, 1]}, {"kind": "empty", "value": None,
                                                                                  "rows": []},
                                 {"kind": "tensor", "value": b, "rows": [2]}], "tensor"), torch.cat([a, b]))
    # trailing shapes differ between ranks: the batches, cut back as each rank ran them
    c = torch.zeros(2, 3)
    out = assemble([{"kind": "tensor", "value": a, "rows": [2, 1]}, {"kind": "tensor", "value": c, "rows": [2]}],
                   "tensor")
    assert [t.shape for t in out] == [(2, 2), (1, 2), (2, 3)]
    parts = [{"kind": "dict", "value": {"p": a}, "rows": [3]}, {"kind": "list", "value": ["x"], "rows": [1]}]
    assert [type(v) for v in assemble(parts, "tensor")] == [dict, str]
    assert join([{"p": a}, {"p": b}])[0] == "dict" and join([1, 2]) == ("list", [1, 2]) and join([])[0] == "empty"
    assert torch.equal(batches_of({"kind": "dict", "value": {"p": a}, "rows": [1, 2]})[1]["p"], a[1:])


# ---- predict ---------------------------------------------------------------------------------------------------------


def test_97_samples_on_2_ranks_equal_a_one_process_loop_in_order(workers):
    model, (x, y) = net(), data()
    expected = model.eval()(x).detach()
    model.train()
    out = nbddp.predict(model, Rows(x, y), batch_size=10, live=False)
    assert out.shape == (97, 3) and torch.allclose(out, expected, atol=1e-6)
    assert model.training  # the notebook's model is left as it was
    # a factory, built with the same seed on every rank; a tuple of tensors; a dict step
    got = nbddp.predict(net, (x,), batch_size=16, live=False,
                        step_fn=lambda m, b: {"logits": m(b[0]), "label": m(b[0]).argmax(1)})
    assert set(got) == {"logits", "label"} and torch.allclose(got["logits"], expected, atol=1e-6)
    assert torch.equal(got["label"], expected.argmax(1))


def test_eval_mode_inference_mode_and_lists_for_what_does_not_concatenate(workers):
    x, y = data(9)  # blocks of 4 and 5 samples: batches of 2, 2 | 2, 2, 1
    seen = nbddp.predict(net(), (x, y), batch_size=2, live=False,
                         step_fn=lambda m, b: [(m.training, torch.is_inference_mode_enabled(), b[0].shape[0])])
    assert seen == [[(False, True, 2)]] * 4 + [[(False, True, 1)]]
    batches = nbddp.predict(net(), (x, y), batch_size=2, live=False, output="list")
    assert [len(b) for b in batches] == [2, 2, 2, 2, 1]
    assert torch.allclose(torch.cat(batches), net().eval()(x).detach(), atol=1e-6)
    kept = [b.clone() for b in batches]
    nbddp.predict(net(), (x * 2, y), batch_size=2, live=False, output="list")  # the workers reuse their output files
    assert all(torch.equal(a, b) for a, b in zip(batches, kept))  # what the first call returned is its own
    half = nbddp.predict(net(), (x, y), batch_size=2, live=False, precision="bf16")  # bf16 autocast on the CPU
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), net().eval()(x).detach(), atol=5e-2)


class Exploding(nn.Module):
    """Raises on a batch holding a sample whose first feature is over 100."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0] > 100).any():
            raise ValueError("a sample out of range")
        return x


class Slow:
    """A step that marks its rank's first batch in ``folder``, then takes ``delay`` s a batch."""

    def __init__(self, folder: str, delay: float):
        self.folder, self.delay = folder, delay

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        import torch.distributed as dist

        mark = os.path.join(self.folder, f"rank{dist.get_rank()}")
        if not os.path.exists(mark):
            open(mark, "w").close()
        time.sleep(self.delay)
        return model(batch[0])


def both_started(folder) -> callable:
    return lambda: len(glob.glob(os.path.join(str(folder), "rank*"))) == 2


@pytest.mark.faults  # a rank fails: the group is formed again (seconds), out of the quick tier
def test_a_rank_that_raises_is_named_with_its_samples_and_the_next_call_works(workers):
    x = torch.zeros(97, 6)
    x[80, 0] = 1000.0  # rank 1's block is 48..96; batches of 10 from 48: the one holding 80 is 78..87
    with pytest.raises(WorkerError, match=r"rank 1.*ValueError: a sample out of range.*samples 78\.\.87") as info:
        nbddp.predict(Exploding(), (x,), batch_size=10, live=False)
    assert info.value.rank == 1 and "PredictionFailed" in info.value.exc_type
    workers.wait_healed()
    assert nbddp.predict(Exploding(), (x[:40],), batch_size=10, live=False).shape == (40, 6)


def test_an_interrupted_predict_returns_nothing_and_the_next_call_works(workers, tmp_path):
    x, _ = data()
    t = {}
    with interrupt_when(both_started(tmp_path), timeout=60, on_signal=lambda i: t.setdefault("sent", time.time())), \
            pytest.raises(KeyboardInterrupt, match="interrupted: it returns nothing"):
        nbddp.predict(net(), (x,), batch_size=1, live=False, step_fn=Slow(str(tmp_path), 0.1))
    assert time.time() - t["sent"] < 3.0  # stopped before the next batch, not at the end (~5 s of batches)
    workers.wait_healed()
    assert nbddp.predict(net(), (x[:4],), batch_size=2, live=False).shape == (4, 3)


def test_block_false_gives_a_handle_that_waits_or_stops(workers, tmp_path):
    x, _ = data(20)
    handle = nbddp.predict(net(), (x,), batch_size=4, block=False, live=False)
    assert torch.allclose(handle.wait(), net().eval()(x).detach(), atol=1e-6) and handle.done()
    assert handle.timings["total_s"] >= handle.timings["predict_s"] > 0
    slow = nbddp.predict(net(), (x,), batch_size=1, block=False, live=False, step_fn=Slow(str(tmp_path), 0.2))
    assert "running" in repr(slow)
    with pytest.raises(TimeoutError, match="still running after 0.01 s"):
        slow.wait(timeout=0.01)
    slow.stop()
    with pytest.raises(KeyboardInterrupt, match="returns nothing"):
        slow.wait()


def test_the_progress_line_counts_batches_and_ends_with_a_summary(workers, capsys, tmp_path):
    x, _ = data(24)  # 12 batches a rank, 0.2 s each: the heartbeats (about 1 s apart) report batches done
    nbddp.predict(net(), (x,), batch_size=1, step_fn=Slow(str(tmp_path), 0.2))
    out = capsys.readouterr().out
    assert "/24 batches on 2 ranks" in out and out.rstrip().splitlines()[-1].strip().startswith(
        "nbddp.predict: done in")


# ---- evaluate ----------------------------------------------------------------------------------------------------


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(1) == targets).float()


@pytest.mark.heavy
def test_evaluate_f1_and_auroc_equal_torchmetrics_in_one_process(workers):
    """Heavy: torchmetrics imported into both workers for the first time in a test process (about 10 CPU-seconds)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    model, (x, y) = net(), data()
    got = nbddp.evaluate(model, Rows(x, y), batch_size=10, live=False, loss_fn=F.cross_entropy,
                         metrics={"f1": MulticlassF1Score(3, average="macro"), "auroc": MulticlassAUROC(3),
                                  "acc": accuracy, "acc_mean": lambda o, t: accuracy(o, t).mean()})
    logits = model.eval()(x).detach()
    f1, auroc = MulticlassF1Score(3, average="macro"), MulticlassAUROC(3)
    f1.update(logits, y)
    auroc.update(logits, y)
    assert set(got) == {"f1", "auroc", "acc", "acc_mean", "loss"}
    assert abs(got["f1"] - float(f1.compute())) < 1e-6 and abs(got["auroc"] - float(auroc.compute())) < 1e-6
    assert abs(got["acc"] - float(accuracy(logits, y).mean())) < 1e-6
    assert abs(got["acc_mean"] - got["acc"]) < 1e-6  # a batch mean, weighted by the batch's samples: exact too
    assert abs(got["loss"] - float(F.cross_entropy(logits, y))) < 1e-6
    assert isinstance(torchmetrics.Metric, type)


class Dicts(torch.utils.data.Dataset):
    """Hugging Face style rows: ``{"input_ids": ..., "labels": ...}``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


class Classifier(nn.Module):
    """Returns an object with ``.logits`` and, given labels, ``.loss``: as a transformers model does."""

    def __init__(self):
        super().__init__()
        self.body = net()

    def forward(self, input_ids, labels=None):
        from types import SimpleNamespace

        logits = self.body(input_ids)
        return SimpleNamespace(logits=logits, loss=F.cross_entropy(logits, labels) if labels is not None else None)


def test_evaluate_takes_dict_batches_and_hooks_for_outputs_and_targets(workers):
    """A dict batch runs as model(**batch): its .logits go to the metrics, its .loss is "loss", "labels" the targets;
    step_fn and target_fn say what the outputs and targets are for anything else. All equal one process."""
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    model, (x, y) = Classifier(), data()
    logits = model.eval()(x).logits.detach()
    f1, auroc = MulticlassF1Score(3, average="macro"), MulticlassAUROC(3)
    f1.update(logits, y)
    auroc.update(logits.softmax(1), y)
    got = nbddp.evaluate(model, Dicts(x, y), batch_size=10, live=False,
                         metrics={"f1": MulticlassF1Score(3, average="macro"), "acc": accuracy})
    assert set(got) == {"f1", "acc", "loss"}
    assert abs(got["f1"] - float(f1.compute())) < 1e-6 and abs(got["acc"] - float(accuracy(logits, y).mean())) < 1e-6
    assert abs(got["loss"] - float(F.cross_entropy(logits, y))) < 1e-6  # batch means weighted by their samples
    got = nbddp.evaluate(model, (x, y, y * 0), batch_size=10, live=False, metrics={"auroc": MulticlassAUROC(3)},
                         step_fn=lambda m, b: m(b[0]).logits.softmax(1), target_fn=lambda b: b[1])
    assert abs(got["auroc"] - float(auroc.compute())) < 1e-6


@pytest.mark.faults  # a rank fails: the group is formed again (seconds), out of the quick tier
def test_evaluate_errors_on_the_workers_name_the_fix(workers):
    x, y = data(10)
    with pytest.raises(WorkerError, match=r"metrics\['two'\] returned 2 values for a batch of 5 samples"):
        nbddp.evaluate(net(), (x, y), batch_size=5, live=False, metrics={"two": lambda o, t: o[:2, 0]})
    workers.wait_healed()
    with pytest.raises(WorkerError, match=r"needs the targets of each batch.*\(x, y\) or \(x1, \.\.\., y\) batches, or "
                                          r"dicts with 'labels'.*length 1\. Pass target_fn="):
        nbddp.evaluate(net(), (x,), batch_size=5, live=False, metrics={"acc": accuracy})
    workers.wait_healed()


# ---- bad input ---------------------------------------------------------------------------------------------------


def test_bad_arguments_are_refused_before_any_worker_runs(workers):
    x, y = data(10)
    cases = [
        (ValueError, r"output=\.\.\.\) must be 'tensor'.*'list'.*got 'table'", dict(output="table")),
        (TypeError, r"model=\.\.\.\) must be a torch.nn.Module.*got int 3", dict(model=3)),
        (TypeError, r"the class Rows, which is not an nn.Module", dict(model=Rows)),
        (ValueError, r"batch_size=\.\.\.\) is the number of samples.*got 0", dict(batch_size=0)),
        (ValueError, r"precision=\.\.\.\) must be one of.*got 'fp8'", dict(precision="fp8")),
        (ValueError, r"DataLoader\(batch_size=None\) over a stream",
         dict(data=torch.utils.data.DataLoader(Numbers(), batch_size=None))),
        (ValueError, r"data=\.\.\.\) is empty", dict(data=(x[:0],))),
        (TypeError, r"step_fn=\.\.\.\) must be callable, got int", dict(step_fn=3)),
        (TypeError, r"block=\.\.\.\) must be True or False", dict(block="no")),
    ]
    for exc, match, change in cases:
        kwargs = {"model": net(), "data": (x,), "batch_size": 2, "live": False, **change}
        with pytest.raises(exc, match=match):
            nbddp.predict(kwargs.pop("model"), kwargs.pop("data"), **kwargs)
    with pytest.raises(ShippingError, match=r"nbddp.predict\(step_fn=\.\.\.\) cannot be sent"):
        lock = __import__("threading").Lock()
        nbddp.predict(net(), (x,), batch_size=2, live=False, step_fn=lambda m, b, lock=lock: m(b[0]))


def test_metrics_that_are_neither_metric_objects_nor_functions_are_refused(workers):
    x, y = data(10)
    with pytest.raises(TypeError, match=r"metrics=\{'f1': \.\.\.\}\) got int 3, which has no update or compute\(\): "
                                        r"a metric needs update\(outputs, targets\) and compute\(\)"):
        nbddp.evaluate(net(), (x, y), metrics={"f1": 3})

    class HalfMetric:
        def update(self, outputs, targets):
            pass

    with pytest.raises(TypeError, match=r"which has no compute\(\)"):
        nbddp.evaluate(net(), (x, y), metrics={"half": HalfMetric()})
    with pytest.raises(TypeError, match=r"metrics=\.\.\.\) must be a non-empty dict"):
        nbddp.evaluate(net(), (x, y), metrics=[accuracy])


@pytest.mark.faults  # a rank fails: the group is formed again (seconds), out of the quick tier
def test_what_only_a_worker_can_see_fails_naming_the_fix(workers):
    x, y = data(10)
    with pytest.raises(WorkerError, match=r"the model factory returned int, not a torch.nn.Module"):
        nbddp.predict(lambda: 3, (x,), batch_size=2, live=False)
    workers.wait_healed()
    with pytest.raises(WorkerError, match=r"this stream splits itself"):
        nbddp.predict(net(), SelfSharding(x, y), batch_size=2, live=False)
    workers.wait_healed()


# ---- streams -----------------------------------------------------------------------------------------------------


def test_a_stream_comes_back_in_the_order_its_samples_came_with_their_ids(workers):
    model, (x, y) = net(), data()
    expected = model.eval()(x).detach()
    out, ids = nbddp.predict(model, Stream(x, y), batch_size=10, live=False)  # rank r takes samples r, r + 2, ...
    assert torch.equal(ids, torch.arange(97)) and torch.allclose(out, expected, atol=1e-6)
    batches, batch_ids = nbddp.predict(model, lambda: Stream(x[:9], y[:9]), batch_size=2, live=False, output="list")
    assert [b.tolist() for b in batch_ids] == [[0, 2], [1, 3], [4, 6], [5, 7], [8]]
    assert all(torch.allclose(b, expected[i], atol=1e-6) for b, i in zip(batches, batch_ids))
    from torchmetrics.classification import MulticlassF1Score

    f1 = MulticlassF1Score(3, average="macro")
    f1.update(expected, y)
    got = nbddp.evaluate(model, Stream(x, y), batch_size=10, live=False,
                         metrics={"f1": MulticlassF1Score(3, average="macro"), "acc": accuracy})
    assert abs(got["f1"] - float(f1.compute())) < 1e-6
    assert abs(got["acc"] - float(accuracy(expected, y).mean())) < 1e-6


# ---- kept models (dist_fit(keep=...)) ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_kept_model_predicts_where_it_is_equal_to_its_weights_in_one_process(workers, strategy):
    """FSDP: each rank holds half of every parameter; the forwards gather them, in lockstep (97 = 48 + 49 samples)."""
    model, (x, y) = net(), data()
    nbddp.dist_fit(model, (x, y), batch_size=16, epochs=1, keep="kept", live=False, strategy=strategy)
    expected = model.eval()(x).detach()  # the trained weights came back into the notebook's model
    out = nbddp.predict("kept", (x, y), batch_size=10, live=False)
    assert torch.allclose(out, expected, atol=1e-5)
    from torchmetrics.classification import MulticlassF1Score

    f1 = MulticlassF1Score(3, average="macro")
    f1.update(expected, y)
    got = nbddp.evaluate("kept", (x, y), batch_size=10, live=False, metrics={"f1": MulticlassF1Score(3, average="macro")})
    assert abs(got["f1"] - float(f1.compute())) < 1e-6
    nbddp.run_cell("del kept")


def test_a_kept_name_the_workers_do_not_hold_is_refused_before_anything_runs(workers):
    x, _ = data(10)
    with pytest.raises(ValueError, match=r"rank\(s\) 0, 1 hold nothing named 'nothing_here'.*keep='nothing_here'"):
        nbddp.predict("nothing_here", (x,), batch_size=2, live=False)
    nbddp.push(not_a_model=3)
    with pytest.raises(ValueError, match=r"holds not a module \(int\) on the workers: predict runs a module bound"):
        nbddp.predict("not_a_model", (x,), batch_size=2, live=False)
    nbddp.run_cell("del not_a_model")
    with pytest.raises(ValueError, match=r"must be a Python identifier"):
        nbddp.predict("not a name", (x,), batch_size=2, live=False)


# ---- to=: parts written on the workers --------------------------------------------------------------------------


def test_to_a_directory_or_a_pt_file_writes_owner_only_parts_in_order(workers, tmp_path):
    model, (x, y) = net(), data()
    expected = model.eval()(x).detach()
    paths = nbddp.predict(model, (x, y), batch_size=10, live=False, to=tmp_path / "preds")
    assert [os.path.basename(p) for p in paths] == ["part-00000.pt", "part-00001.pt"]
    parts = [torch.load(p) for p in paths]
    assert [(p["first"], p["samples"]) for p in parts] == [(0, 48), (48, 49)]
    assert torch.allclose(torch.cat([p["value"] for p in parts]), expected, atol=1e-6)
    assert os.stat(tmp_path / "preds").st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in [*paths, tmp_path / "preds" / "index.pt"]} == {0o600}
    assert torch.load(tmp_path / "preds" / "index.pt")["parts"] == paths
    paths = nbddp.predict(model, (x, y), batch_size=10, live=False, to=str(tmp_path / "out.pt"))
    assert paths == [str(tmp_path / f"out.part-0000{r}.pt") for r in (0, 1)]
    assert torch.load(tmp_path / "out.pt")["samples"] == [48, 49]


def test_a_to_path_that_cannot_be_written_is_refused_before_anything_runs(workers, tmp_path, monkeypatch):
    x, _ = data(10)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"a_file is a file, not a directory"):
        nbddp.predict(net(), (x,), batch_size=2, live=False, to=tmp_path / "a_file" / "x.pt")
    with pytest.raises(TypeError, match=r"to=\.\.\.\) must be a path.*got int 3"):
        nbddp.predict(net(), (x,), batch_size=2, live=False, to=3)
    # a folder no one can make a file in, whatever os.access says to root (issue 44: the workers' FileNotFoundError
    # came back as a WorkerError)
    with pytest.raises(ValueError, match=r"to='/proc/nonexistent/x.pt'\) cannot be written: making a file in /proc "
                                         r"failed \(.*\)\. Choose a directory you can write to"):
        nbddp.predict(net(), (x,), batch_size=2, live=False, to="/proc/nonexistent/x.pt")
    assert not list(tmp_path.glob(".nbddp-write-check-*"))
    nbddp.predict(net(), (x,), batch_size=2, live=False, to=tmp_path / "fine.pt")
    assert not list(tmp_path.glob(".nbddp-write-check-*"))  # the probe file is gone
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as a user without write access (tests run as root)
    with pytest.raises(ValueError, match=r"cannot be written: .* is not writable by this user"):
        nbddp.predict(net(), (x,), batch_size=2, live=False, to=tmp_path / "new" / "deeper")


def test_dist_fit_metric_objects_are_exact_over_the_validation_set(workers):
    """The same metrics= in dist_fit: F1 and AUROC of the last epoch equal one process's on the trained model."""
    from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score

    model, (x, y) = net(), data()
    (vx, vy) = data(53)
    history = nbddp.dist_fit(model, (x, y), val_data=(vx, vy), batch_size=16, epochs=2, live=False,
                             metrics={"f1": MulticlassF1Score(3, average="macro"), "auroc": MulticlassAUROC(3),
                                      "acc": accuracy})
    logits = model.eval()(vx).detach()
    f1, auroc = MulticlassF1Score(3, average="macro"), MulticlassAUROC(3)
    f1.update(logits, vy)
    auroc.update(logits, vy)
    last = history.epochs[-1]
    assert abs(last["val_f1"] - float(f1.compute())) < 1e-6 and abs(last["val_auroc"] - float(auroc.compute())) < 1e-6
    assert abs(last["val_acc"] - float(accuracy(logits, vy).mean())) < 1e-6  # (a state kept from epoch 0 would differ)
