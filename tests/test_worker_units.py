"""Worker pieces on their own, in this process (no engines): batches, precision, resume checks."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nbddp.fit.option_checks import make_config
from nbddp.worker.strategies.precision import precision_tools
from nbddp.worker.training.setup import check_resumable
from nbddp.worker.data.batches import BatchError, batch_size_of, run_batch
from nbddp.worker.data.datasets import SkipSampler, StridedSampler


class _Keyword(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 1)

    def forward(self, x, labels):
        loss = F.mse_loss(self.lin(x).squeeze(1), labels)
        if self.kind == "tensor":
            return loss
        if self.kind == "attr":
            return types.SimpleNamespace(loss=loss)
        if self.kind == "dict":
            return {"loss": loss, "logits": None}
        return {"logits": loss}


@pytest.mark.parametrize("kind", ["tensor", "attr", "dict"])
def test_dict_batches_take_the_loss_from_the_output(kind):
    batch = {"x": torch.randn(4, 3), "labels": torch.randn(4)}
    loss, n, extras, _, target = run_batch(_Keyword(kind), batch, None, None)
    assert loss.shape == () and n == 4 and extras == {} and target is batch["labels"]


def test_batch_form_errors_say_how_to_fix_them():
    batch = {"x": torch.randn(4, 3), "labels": torch.randn(4)}
    with pytest.raises(BatchError, match="must be the loss, have .loss or a 'loss' entry; got dict"):
        run_batch(_Keyword("nothing"), batch, None, None)
    with pytest.raises(BatchError, match="step_fn returned a dict without 'loss' \\(keys: \\['l'\\]\\)"):
        run_batch(nn.Linear(3, 1), (torch.randn(2, 3), torch.randn(2, 1)), None, lambda m, b: {"l": 1})
    with pytest.raises(BatchError, match="the loss must be a scalar, got a tensor of shape \\(2, 1\\)"):
        run_batch(nn.Linear(3, 1), (torch.randn(2, 3), torch.randn(2, 1)), lambda o, t: (o - t) ** 2, None)
    with pytest.raises(BatchError, match="the loss must be a tensor, got float"):
        run_batch(nn.Linear(3, 1), (torch.randn(2, 3), torch.randn(2, 1)), None, lambda m, b: 1.5)
    with pytest.raises(BatchError, match="neither \\(x, y\\), \\(x1, ..., y\\) nor a dict"):
        run_batch(nn.Linear(3, 1), torch.randn(2, 3), None, None)
    with pytest.raises(BatchError, match="returned tuple, not a tensor, and no loss_fn was given"):
        run_batch(lambda x: (x, x), (torch.randn(2, 3), torch.randn(2)), None, None)
    with pytest.raises(BatchError, match="cannot tell how many samples a batch of type str holds"):
        batch_size_of("abc")


def test_default_loss_is_cross_entropy_for_labels_and_mse_for_values():
    out = torch.randn(5, 3)
    labels = torch.tensor([0, 1, 2, 1, 0])
    loss, *_ = run_batch(lambda x: x, (out, labels), None, None)
    assert loss.item() == pytest.approx(F.cross_entropy(out, labels).item())
    values = torch.randn(5, 3)
    loss, *_ = run_batch(lambda x: x, (out, values), None, None)
    assert loss.item() == pytest.approx(F.mse_loss(out, values).item())


def test_fp16_on_cpu_and_sync_batchnorm_on_cpu_are_refused_on_the_worker_in_the_kernels_words():
    from nbddp.protocol.fit_options import check_device_rules

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"precision='16-mixed'\) needs CUDA GPUs .* workers run on \['cpu'\]; "
                                         r"on CPU workers use precision='bf16-mixed'"):
        precision_tools("16-mixed", cpu)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) needs CUDA GPUs: SyncBatchNorm has no CPU kernel, and "
                                         r"the workers run on \['cpu'\]"):
        check_device_rules("32-true", True, {"cpu"})
    autocast, scaler = precision_tools("bf16-mixed", cpu)
    with autocast():
        assert nn.Linear(3, 3)(torch.randn(2, 3)).dtype == torch.bfloat16
    assert scaler is None


def test_a_mid_epoch_checkpoint_needs_the_same_world_and_batch_size():
    cfg = make_config(batch_size=8)
    saved = {"batches_done": 3, "world_size": 2, "batch_size": 8}
    check_resumable(saved, cfg, 2, "c.pt")
    check_resumable({**saved, "batches_done": 0, "world_size": 4}, cfg, 2, "c.pt")  # epoch end: anything goes
    with pytest.raises(ValueError, match="saved mid-epoch with world_size=4, batch_size=8, but this fit runs world_size=2"):
        check_resumable({**saved, "world_size": 4}, cfg, 2, "c.pt")


def test_samplers_skip_and_stride_without_padding():
    inner = StridedSampler(11, 1, 2)
    assert list(inner) == [1, 3, 5, 7, 9] and len(inner) == 5
    skip = SkipSampler(inner, 2)
    assert list(skip) == [5, 7, 9] and len(skip) == 3


def test_feature_options_are_checked_in_the_kernel_with_the_fix_named(tmp_path):
    with pytest.raises(ValueError, match=r"precision=\.\.\.\) must be one of .* got 'fp16' \(did you mean '16-mixed'\?\)"):
        make_config(precision="fp16")
    with pytest.raises(ValueError, match=r"grad_accum=\.\.\.\) must be >= 1, got 0"):
        make_config(grad_accum=0)
    with pytest.raises(ValueError, match=r"clip_grad_norm=\.\.\.\) must be > 0.0, got 0"):
        make_config(clip_grad_norm=0)
    with pytest.raises(ValueError, match=r"checkpoint_every=\.\.\.\) needs checkpoint_dir=\.\.\."):
        make_config(checkpoint_every=10)
    with pytest.raises(ValueError, match=r"resume=True\) resumes from checkpoint_dir; pass checkpoint_dir="):
        make_config(resume=True)
    with pytest.raises(TypeError, match=r"resume=\.\.\.\) must be True/False or a checkpoint path, got int"):
        make_config(resume=1)
    with pytest.raises(TypeError, match=r"checkpoint_dir=\.\.\.\) must be a path, got int"):
        make_config(checkpoint_dir=3)
    cfg = make_config(checkpoint_dir=tmp_path, resume=tmp_path / "step-00000001.pt", val_every="epoch")
    assert cfg.checkpoint_dir == str(tmp_path) and cfg.resume.endswith("step-00000001.pt") and cfg.val_every is None


def test_a_key_the_worker_does_not_hold_is_a_clear_error():
    from nbddp.protocol.data_forms import DataSpec
    from nbddp.worker.data.datasets import keep_only, materialise

    cache = {"a": "dataset-a", "b": "dataset-b"}
    keep_only(cache, ["b"])
    assert cache == {"b": "dataset-b"}
    assert materialise(DataSpec(key="b"), cache) == "dataset-b"
    with pytest.raises(RuntimeError, match=r"only the key of a resident dataset \(a\).*nbddp.restart\(\)"):
        materialise(DataSpec(key="a"), cache)


def test_a_stop_signal_that_lands_after_the_loop_is_a_flag_not_a_keyboard_interrupt():
    """The kernel signals every rank; one rank's SIGINT may arrive after the group already stopped."""
    import os
    import signal

    from nbddp.worker.engine.rank_state import STATE, stop_on_sigint

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # what the engine installs for a task
    try:
        with stop_on_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            assert STATE.stop_requested, "inside the task the signal is a stop request"
        STATE.stop_requested = False
        os.kill(os.getpid(), signal.SIGINT)  # late: the rank already left the loop (this raised KeyboardInterrupt)
        assert STATE.stop_requested
        with stop_on_sigint():
            assert not STATE.stop_requested, "the next task starts without the old request"
    finally:
        signal.signal(signal.SIGINT, before)


def test_every_cuda_figure_a_rank_measures_reaches_history_ranks(monkeypatch):
    """``History.ranks`` carries what ``RANK_SLOTS`` names: a figure cuda_memory() measures must have a slot."""
    from nbddp.worker.training import report
    from nbddp.worker.memory import usage
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 1)
    measured = usage.cuda_memory(torch.device("cuda", 0))
    assert set(measured) == {"cuda_allocated", "cuda_reserved", "cuda_peak"}
    assert set(measured) <= set(report.RANK_SLOTS)
