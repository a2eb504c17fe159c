"""Sharded training (FSDP2) on 2 CPU ranks: equal to DDP, half the parameters per rank, exact resume, checkpointing.

The model is a small transformer-like stack (an nn.ModuleList of identical
blocks), so the default sharding units are its blocks.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp

pytestmark = pytest.mark.timeout(300)


class Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 64)
        self.fc2 = nn.Linear(64, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, layers: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def data(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :4].argmax(1) + (x[:, 4] > 0).long()) % 4


def fit(model, strategy, **kw):
    options = dict(epochs=2, batch_size=16, lr=1e-2, shuffle=True, seed=3, live=False, loss_fn=F.cross_entropy)
    options.update(kw)
    return nbddp.dist_fit(model, data(), strategy=strategy, **options)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


@pytest.mark.parametrize("case", ["sgd", "adamw", "accumulation and clipping"])
def test_fsdp_trains_the_same_weights_as_ddp(workers, case):
    kwargs = {"sgd": dict(optimizer=torch.optim.SGD, lr=0.1),
              "adamw": dict(optimizer=torch.optim.AdamW),
              "accumulation and clipping": dict(optimizer=torch.optim.AdamW, grad_accum=2, clip_grad_norm=0.5)}[case]
    torch.manual_seed(0)
    base = Stack()
    ddp, fsdp = copy.deepcopy(base), copy.deepcopy(base)
    h_ddp = fit(ddp, "ddp", **kwargs)
    h_fsdp = fit(fsdp, "fsdp", **kwargs)
    assert max_diff(base, fsdp) > 1e-3, "the weights did not train"
    assert max_diff(ddp, fsdp) < 1e-5
    assert [e["loss"] for e in h_fsdp.epochs] == pytest.approx([e["loss"] for e in h_ddp.epochs], rel=1e-5)


def test_each_rank_holds_half_of_the_parameters_and_reports_its_memory(workers):
    model = Stack()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    h = fit(model, "fsdp", epochs=1)
    assert [r["rank"] for r in h.ranks] == [0, 1]
    for row in h.ranks:
        assert row["param_bytes"] == pytest.approx(total / 2, rel=0.05), (row, total)
        assert row["peak_mem"] > 0 and row["device"] == "cpu" and row["host"]
    assert sum(r["param_bytes"] for r in h.ranks) == pytest.approx(total, rel=0.01)
    h_ddp = fit(Stack(), "ddp", epochs=1)
    assert all(r["param_bytes"] == total for r in h_ddp.ranks)


def test_validation_under_fsdp_runs_in_lockstep_and_counts_no_padding(workers):
    """97 validation samples: rank 0 has 7 batches, rank 1 has 6; FSDP's forwards are collective."""
    torch.manual_seed(0)
    base = Stack()
    val = data(97, seed=1)
    metrics = {"acc": lambda out, y: (out.argmax(1) == y).float().mean()}
    h_ddp = fit(copy.deepcopy(base), "ddp", epochs=1, val_data=val, metrics=metrics)
    h_fsdp = fit(copy.deepcopy(base), "fsdp", epochs=1, val_data=val, metrics=metrics)
    for key in ("val_loss", "val_acc"):
        assert h_fsdp.epochs[-1][key] == pytest.approx(h_ddp.epochs[-1][key], rel=1e-5)


@pytest.mark.heavy
def test_resume_from_a_mid_epoch_sharded_checkpoint_is_exact(workers, tmp_path):
    """Heavy: three FSDP fits and a DCP checkpoint saved and loaded mid-epoch on 2 ranks."""
    torch.manual_seed(0)
    base = Stack()
    straight = copy.deepcopy(base)
    fit(straight, "fsdp", epochs=2, optimizer=torch.optim.AdamW)
    first = copy.deepcopy(base)
    h1 = fit(first, "fsdp", epochs=2, optimizer=torch.optim.AdamW, checkpoint_dir=tmp_path, checkpoint_every=5,
             max_steps=13)
    assert h1.steps[-1]["step"] == 13
    saved = sorted(os.listdir(tmp_path))
    assert "step-00000013" in saved and all(os.path.isdir(tmp_path / s) for s in saved)
    assert {"loop.pt", ".metadata"} <= set(os.listdir(tmp_path / "step-00000013"))
    assert len([n for n in os.listdir(tmp_path / "step-00000013") if n.endswith(".distcp")]) == 2, "one file per rank"
    resumed = copy.deepcopy(base)
    h2 = fit(resumed, "fsdp", epochs=2, optimizer=torch.optim.AdamW, checkpoint_dir=tmp_path, resume=True)
    assert h2.steps[0]["step"] > 13
    assert max_diff(resumed, straight) == 0.0


def test_a_sharded_checkpoint_exports_to_one_plain_file(workers, tmp_path):
    model = Stack()
    fit(model, "fsdp", epochs=1, checkpoint_dir=tmp_path / "ckpt")
    last = sorted((tmp_path / "ckpt").iterdir())[-1]
    out = nbddp.export_checkpoint(last, tmp_path / "plain.pt")
    state = torch.load(out, weights_only=True)
    plain = Stack()
    plain.load_state_dict(state["model"])
    assert max_diff(plain, model) == 0.0 and state["step"] == 8
    with pytest.raises(ValueError, match=r"export_checkpoint\(.*\): not a sharded nbddp checkpoint directory"):
        nbddp.export_checkpoint(tmp_path, tmp_path / "x.pt")


@pytest.mark.heavy
def test_resuming_across_strategies_says_which_one_wrote_the_checkpoint(workers, tmp_path):
    """Heavy: a DDP and an FSDP fit, each checkpointed, then both resumed the wrong way round."""
    fit(Stack(), "ddp", epochs=1, checkpoint_dir=tmp_path / "ddp")
    fit(Stack(), "fsdp", epochs=1, checkpoint_dir=tmp_path / "fsdp")
    ddp_file = sorted((tmp_path / "ddp").iterdir())[-1]
    fsdp_dir = sorted((tmp_path / "fsdp").iterdir())[-1]
    with pytest.raises(nbddp.WorkerError, match=r"is a checkpoint of a DDP fit \(one file\); resume it with strategy='ddp'"):
        fit(Stack(), "fsdp", epochs=1, resume=str(ddp_file))
    with pytest.raises(nbddp.WorkerError, match=r"is a sharded checkpoint .* resume it with strategy='fsdp'"):
        fit(Stack(), "ddp", epochs=1, resume=str(fsdp_dir))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_activation_checkpointing_gives_the_same_weights(workers, strategy):
    torch.manual_seed(0)
    base = Stack()
    plain, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    fit(plain, strategy, epochs=1)
    h = fit(checkpointed, strategy, epochs=1, activation_checkpointing=True)
    assert h.status == "completed" and max_diff(plain, checkpointed) < 1e-6
    assert "forward" not in vars(checkpointed.blocks[0]), "the kernel's model is not patched"
    h = fit(copy.deepcopy(base), strategy, epochs=1, activation_checkpointing={Block})
    assert h.status == "completed"


def test_bf16_trains_under_fsdp(workers):
    h = fit(Stack(), "fsdp", epochs=3, precision="bf16-mixed", optimizer=torch.optim.AdamW)
    assert h.epochs[-1]["loss"] < h.epochs[0]["loss"]


def test_a_factory_is_built_on_meta_and_comes_back_whole(workers):
    h = fit(Stack, "fsdp", epochs=2)
    assert isinstance(h.model, Stack) and h.epochs[-1]["loss"] < h.epochs[0]["loss"]
    assert not any(p.is_meta for p in h.model.parameters())
    x, y = data(64, seed=5)
    assert F.cross_entropy(h.model(x), y).item() < 1.4  # the weights that came back are the trained ones


def test_keep_binds_the_trained_module_on_every_rank_for_later_cells(workers):
    model = Stack()
    before = copy.deepcopy(model)
    fit(model, "fsdp", epochs=1, keep="net", return_weights=False)
    assert max_diff(model, before) == 0.0, "return_weights=False leaves the notebook's model alone"
    nbddp.run_cell("import torch\nwith torch.no_grad():\n    kept = net(torch.ones(2, 8)).sum().item()\n"
                   "kept_type = type(net).__name__")
    kept = [nbddp.pull("kept", "kept_type", rank=r) for r in (0, 1)]
    assert kept[0] == kept[1] and "Stack" in kept[0]["kept_type"]
    fit(model, "ddp", epochs=1, keep="ddp_net")
    nbddp.run_cell("import torch\nddp_out = ddp_net(torch.ones(1, 8)).detach()")
    assert torch.allclose(nbddp.pull("ddp_out", rank=1)["ddp_out"], model(torch.ones(1, 8)).detach())


def test_sharding_settings_are_checked_before_any_worker_works(workers):
    sent = len(workers.client.history)
    with pytest.raises(ValueError, match=r"strategy=\.\.\.\) must be one of \('ddp', 'fsdp'\) or an nbddp\.FSDP"):
        fit(Stack(), "zero3")
    with pytest.raises(ValueError, match=r"nbddp\.FSDP\(shard_modules=\.\.\.\): no module of the model is a Decoder; "
                                         r"its module classes are: .*Block"):
        fit(Stack(), nbddp.FSDP(shard_modules={"Decoder"}))
    with pytest.raises(ValueError, match=r"activation_checkpointing=\.\.\.\): no module of the model is a Conv9d"):
        fit(Stack, "fsdp", activation_checkpointing={"Conv9d"})
    with pytest.raises(TypeError, match=r"nbddp\.FSDP\(reshard_after_forward=\.\.\.\) must be True, False or None, got str"):
        nbddp.FSDP(reshard_after_forward="yes")
    with pytest.raises(TypeError, match=r"nbddp\.FSDP\(shard_modules=\.\.\.\) takes nn\.Module classes or their names"):
        nbddp.FSDP(shard_modules=[42])
    with pytest.raises(ValueError, match=r"nbddp\.FSDP\(shard_modules=\.\.\.\) is empty"):
        nbddp.FSDP(shard_modules=[])
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) is not supported with strategy='fsdp'"):
        fit(Stack(), "fsdp", sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"FSDP\(cpu_offload=True\) moves shards between CPU and GPU memory, but the "
                                         r"workers run on \['cpu'\]"):
        fit(Stack(), nbddp.FSDP(cpu_offload=True))
    with pytest.raises(TypeError, match=r"activation_checkpointing=\.\.\.\) takes module classes or their names, e\.g\. "
                                        r"\{Block\} \(or True for every unit\)"):
        fit(Stack(), "ddp", activation_checkpointing=3)
    assert len(workers.client.history) == sent


class TwoLayers(nn.Module):
    """Neither repeated blocks nor an nn.Sequential: nothing activation checkpointing could find by itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_activation_checkpointing_without_repeated_blocks_says_how_to_name_them(workers):
    with pytest.raises(nbddp.WorkerError, match=r"activation_checkpointing=True\) found no repeated blocks.*"
                                                r"no nn\.Sequential to checkpoint in segments.*"
                                                r"activation_checkpointing=\{MyBlock\}"):
        fit(TwoLayers(), "ddp", activation_checkpointing=True)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("settings", [dict(), dict(cpu_offload=True), dict(reshard_after_forward=False)])
def test_fsdp_on_gpus(settings):
    gpus = torch.cuda.device_count()
    nbddp.stop()
    nbddp.start(n=gpus)
    try:
        torch.manual_seed(0)
        base = Stack()
        ddp, fsdp = copy.deepcopy(base), copy.deepcopy(base)
        fit(ddp, "ddp")
        h = fit(fsdp, nbddp.FSDP(**settings))
        assert max_diff(ddp, fsdp) < 1e-4 and h.ranks[0]["device"].startswith("cuda")
        assert "cuda_peak" in h.ranks[0]
        assert fit(Stack(), "fsdp", precision="16-mixed").status == "completed"
    finally:
        nbddp.stop()
