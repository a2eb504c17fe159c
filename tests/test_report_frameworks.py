"""What frameworks log, in nbddp's live view: HF ``Trainer``, Lightning Fabric, accelerate, and ``torchrun``.

Each framework runs on the suite's 2 CPU workers with at most the one
documented line (``nbddp.lightning_logger()``, ``nbddp.accelerate_tracker()``;
the HF ``Trainer`` needs none), and its logged values arrive in the call's
History and view. Every test here imports a framework into the workers (or
starts two torchrun processes): all are ``heavy``.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import nbddp
from nbddp.cells import reported_call
from nbddp.live.text import TextView
from nbddp.protocol.host import free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.heavy]

HF_CELL = """
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 50, (12,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": ids.sum() % 2}

torch.manual_seed(1)
config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16)
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=4, max_steps=MAX_STEPS, learning_rate=1e-2,
                         report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens())
trainer.train()
hf_last = trainer.state.global_step
"""


@pytest.fixture
def runs(monkeypatch):
    """The reporting calls of the test, each with a text view writing into a buffer."""
    made: list[reported_call.ReportedRun] = []
    real_init = reported_call.ReportedRun.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(reported_call.ReportedRun, "__init__", remember)
    monkeypatch.setattr(reported_call, "choose_view", lambda live: TextView(stream=io.StringIO(), every=0.0))
    return made


def test_an_hf_trainer_in_a_cell_shows_its_logged_loss_with_no_change(workers, runs, tmp_path):
    """Heavy: transformers imported into both workers, a Trainer built and run there."""
    pytest.importorskip("transformers")
    nbddp.push(OUT=str(tmp_path / "hf"), MAX_STEPS=6)
    nbddp.run_cell(HF_CELL, stream=False)
    history = nbddp.last_history()
    assert [r["step"] for r in history.steps if "loss" in r] == list(range(1, 7))
    assert {"loss", "learning_rate", "grad_norm"} <= set(history.metrics)
    # the Trainer's logged loss is already the ranks' mean: both ranks report the same value
    for step in range(1, 7):
        own = [r["loss"] for r in history.rank_steps if r["step"] == step and "loss" in r]
        assert len(own) == 2 and own[0] == pytest.approx(own[1], abs=1e-6)
    assert "loss" in runs[-1].view.stream.getvalue()


def test_a_stop_ends_an_hf_trainer_on_every_rank_at_one_step(workers, runs, tmp_path):
    """Heavy: as above, stopped from the notebook part-way (the Stop button's request) through should_stop."""
    pytest.importorskip("transformers")
    nbddp.push(OUT=str(tmp_path / "hf"), MAX_STEPS=100000)

    def stop_when_running():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (runs and len(runs[-1].history.steps) >= 3):
            time.sleep(0.05)
        if runs:
            runs[-1].request_stop()

    stopper = threading.Thread(target=stop_when_running, daemon=True)
    stopper.start()
    nbddp.run_cell(HF_CELL, stream=False)
    stopper.join(10)
    last = nbddp.pull("hf_last", ranks=[0, 1])["hf_last"]
    assert last[0] == last[1] and 3 <= last[0] < 100000
    history = nbddp.last_history()
    assert history.status == "interrupted" and history.last_step == last[0]


FABRIC_CELL = """
import torch, nbddp
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", loggers=nbddp.lightning_logger())
fabric.launch()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
g = torch.Generator().manual_seed(fabric.global_rank)
for step in range(5):
    x = torch.randn(8, 4, generator=g)
    loss = model(x).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.log_dict({"loss": loss, "rank_seen": float(fabric.global_rank)}, step=step)
"""


def test_a_lightning_fabric_loop_shows_its_logged_metrics(workers, runs):
    """Heavy: Lightning imported into both workers."""
    pytest.importorskip("lightning")
    nbddp.run_cell(FABRIC_CELL, stream=False)
    history = nbddp.last_history()
    assert [r["step"] for r in history.steps] == [0, 1, 2, 3, 4]
    assert all(r["rank_seen"] == 0.5 for r in history.steps)  # the mean of 0 and 1: every rank reported
    for record in history.steps:
        own = [r["loss"] for r in history.rank_steps if r["step"] == record["step"]]
        assert record["loss"] == pytest.approx(sum(own) / 2, abs=1e-6)


def _accelerate_loop():
    import nbddp
    from accelerate import Accelerator

    accelerator = Accelerator(log_with=nbddp.accelerate_tracker())
    accelerator.init_trackers("nbddp-test")
    for step in range(4):
        accelerator.log({"loss": 1.0 / (step + 1), "note": "text is skipped"}, step=step)
    accelerator.end_training()
    return accelerator.process_index


def test_an_accelerate_tracker_shows_what_accelerator_log_logs(workers, runs):
    """Heavy: accelerate imported into both workers; it logs from rank 0 only."""
    pytest.importorskip("accelerate")
    out = nbddp.run(_accelerate_loop)
    assert out == [0, 1]
    assert [(r["step"], r["loss"]) for r in out.history.steps] == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)]
    assert {r["rank"] for r in out.history.rank_steps} == {0}


SCRIPT = """
import time
import torch.distributed as dist
import nbddp

dist.init_process_group("gloo")
t0 = time.perf_counter()
for step in range(1000):
    nbddp.report(step, loss=1.0)
per_call = (time.perf_counter() - t0) / 1000
assert nbddp.should_stop() is False
print(f"rank {dist.get_rank()} per-call {per_call * 1e9:.0f} ns", flush=True)
dist.destroy_process_group()
"""


def test_a_script_that_reports_runs_unchanged_under_torchrun(tmp_path):
    """Heavy: two torchrun processes (torch imported twice); outside nbddp report does nothing."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(nbddp.__file__))}
    port = free_port("127.0.0.1")
    # its own session: on a timeout the launcher and both of its ranks are killed together, nothing left behind
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-2000:]
    lines = sorted(line for line in stdout.splitlines() if "per-call" in line)
    assert [line.split()[1] for line in lines] == ["0", "1"]


LIGHTNING_TRAINER = """
import torch, lightning, nbddp

class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train_loss", loss)
        self.log("rank_seen", float(self.global_rank))
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, log_every_n_steps=1,
                            logger=nbddp.lightning_logger(), enable_progress_bar=False, enable_checkpointing=False,
                            enable_model_summary=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
"""


def test_a_lightning_trainer_shows_its_logged_metrics(workers, runs):
    """Heavy: Lightning's Trainer imported into both workers and run there."""
    pytest.importorskip("lightning")
    nbddp.run_cell(LIGHTNING_TRAINER, stream=False)
    history = nbddp.last_history()
    assert "train_loss" in history.metrics and len(history.steps) >= 5
    assert all(r["rank_seen"] == 0.5 for r in history.steps if "rank_seen" in r)
