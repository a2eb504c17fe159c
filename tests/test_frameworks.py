"""The code people already have: torchrun's environment, HF Trainer, accelerate, Fabric, scripts, edited modules.

Each framework runs unchanged on the suite's 2 CPU workers, and each test
asserts distributed behaviour: the world size the framework sees, and
parameters identical on both ranks after training on different shards
(which only holds when gradients were synchronised).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys

import pytest
import torch

import nbddp
from interrupts import interrupt_when
from nbddp.cells import rank_output as output
pytestmark = pytest.mark.timeout(300)


def _digest(module: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().float().flatten() for p in module.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _environment():
    import torch.distributed as dist

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    return {k: os.environ.get(k) for k in keys} | {"dist_rank": dist.get_rank()}


@pytest.mark.faults
def test_every_rank_carries_torchruns_environment_and_it_follows_a_heal(workers):
    envs = nbddp.run(_environment)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["ROLE_RANK"] == str(rank) == str(env["dist_rank"])
        assert env["LOCAL_RANK"] == str(rank) and env["GROUP_RANK"] == "0"
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"].isdigit()
        assert env["TORCHELASTIC_RUN_ID"] == "nbddp"
    killed = workers.supervisor.kill_ranks([1])
    workers.supervisor.recover(killed)
    workers.wait_healed()
    after = nbddp.run(_environment)
    assert [e["RANK"] for e in after] == ["0", "1"] and all(e["WORLD_SIZE"] == "2" for e in after)
    assert after[0]["MASTER_PORT"] != envs[0]["MASTER_PORT"], "each generation gets its own master port"


def _init_and_destroy_like_a_script():
    import torch.distributed as dist

    before = dist.group.WORLD
    dist.init_process_group("gloo")  # what a torchrun script does first: it must meet nbddp's group
    dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method="env://")
    same = dist.group.WORLD is before
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # what it does last: nbddp's group must survive it
    return same, float(t[0]), dist.is_initialized()


def _asks_for_nccl():
    import torch.distributed as dist

    dist.init_process_group("nccl")


def _asks_for_another_world():
    import torch.distributed as dist

    dist.init_process_group("gloo", world_size=8, rank=0)


@pytest.mark.heavy
def test_init_and_destroy_from_user_code_meet_nbddps_group(workers):
    """Heavy: the process group destroyed and formed again by user code on both workers."""
    assert nbddp.run(_init_and_destroy_like_a_script) == [(True, 2.0, True)] * 2
    with pytest.raises(nbddp.WorkerError, match=r"init_process_group\(backend='nccl'\): the workers' process group "
                                                r"uses 'gloo'.*nbddp.start\(backend='nccl'\)"):
        nbddp.run(_asks_for_nccl)
    with pytest.raises(nbddp.WorkerError, match=r"init_process_group\(world_size=8\): this worker is world_size 2"):
        nbddp.run(_asks_for_another_world)
    assert nbddp.run(_init_and_destroy_like_a_script) == [(True, 2.0, True)] * 2


HF_CELL = """
import hashlib, torch, transformers
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 50, (64, 12), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long), "labels": self.labels[i]}

torch.manual_seed(1)
config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16)
model = BertForSequenceClassification(config)
args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                         report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
trainer.train()
hf_world = (args.world_size, str(args.parallel_mode), args.process_index)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
hf_digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
"""


@pytest.mark.heavy
def test_hf_trainer_trains_distributed_in_a_ddp_cell(workers, tmp_path):
    """Heavy: transformers imported into both workers, and its Trainer built and run there."""
    pytest.importorskip("transformers")
    nbddp.push(OUT=str(tmp_path / "hf"))
    nbddp.run_cell(HF_CELL, stream=False)
    worlds = [nbddp.pull("hf_world", rank=r)["hf_world"] for r in (0, 1)]
    assert worlds == [(2, "ParallelMode.DISTRIBUTED", 0), (2, "ParallelMode.DISTRIBUTED", 1)]
    digests = {nbddp.pull("hf_digest", rank=r)["hf_digest"] for r in (0, 1)}
    assert len(digests) == 1, "the ranks' weights differ: gradients were not synchronised"


def _accelerate_job(steps: int = 4):
    import torch.distributed as dist
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(dist.get_rank())  # different initial weights: prepare() must make them one model
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _, (x, y) in zip(range(steps), loader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()
    return accelerator.num_processes, accelerator.process_index, accelerator.distributed_type.value, \
        _digest(accelerator.unwrap_model(model))


def test_accelerate_runs_on_nbddps_group_twice_in_a_row(workers):
    pytest.importorskip("accelerate")
    for _ in range(2):  # a re-run cell: accelerate's state must not keep the first run's
        results = nbddp.run(_accelerate_job)
        assert [r[:3] for r in results] == [(2, 0, "MULTI_CPU"), (2, 1, "MULTI_CPU")]
        assert results[0][3] == results[1][3]


FABRIC_CELL = """
import torch
from lightning.fabric import Fabric

fabric = Fabric(accelerator="cpu", devices=LOCAL_WORLD, num_nodes=1, strategy="ddp")
fabric.launch()
torch.manual_seed(fabric.global_rank)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
for _, (x, y) in zip(range(4), loader):
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
fabric_seen = (fabric.world_size, fabric.global_rank, type(fabric.strategy).__name__)
import hashlib
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
fabric_digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
"""


@pytest.mark.heavy
def test_lightning_fabric_ddp_uses_the_workers_ranks_without_spawning(workers):
    """Heavy: Lightning imported into both workers."""
    pytest.importorskip("lightning")
    import psutil

    children = {p.pid: len(psutil.Process(p.pid).children(recursive=True)) for p in workers.placements}
    nbddp.push(LOCAL_WORLD=2)
    nbddp.run_cell(FABRIC_CELL, stream=False)
    seen = [nbddp.pull("fabric_seen", rank=r)["fabric_seen"] for r in (0, 1)]
    assert seen == [(2, 0, "DDPStrategy"), (2, 1, "DDPStrategy")]
    assert nbddp.pull("fabric_digest", rank=0) == nbddp.pull("fabric_digest", rank=1)
    assert {p.pid: len(psutil.Process(p.pid).children(recursive=True)) for p in workers.placements} == children


SCRIPT = """
import argparse, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="script-out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x = torch.randn(8, 4)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    os.makedirs(args.out, exist_ok=True)
    w = model.module.weight.detach().flatten().tolist()
    with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
        f.write(repr(w))
    print(f"trained {args.steps} steps on rank {rank} of {world} as {__name__}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
    sys.exit(0)
"""


@pytest.fixture
def written(monkeypatch):
    lines: list[tuple[str, str]] = []
    real = output.write

    def record(kind, text):
        lines.append((kind, text.rstrip("\n")))
        real(kind, text)

    monkeypatch.setattr(output, "write", record)
    return lines


def test_an_unchanged_torchrun_script_runs_on_the_warm_workers(workers, tmp_path, monkeypatch, written):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # the notebook's folder: relative paths resolve from here
    results = nbddp.run_script("train.py", "--steps", 3, "--out", "weights")
    assert [(r.rank, r.exit_code) for r in results] == [(0, 0), (1, 0)]
    printed = sorted(text for kind, text in written if kind == "stdout")
    assert printed == ["[rank 0] trained 3 steps on rank 0 of 2 as __main__",
                       "[rank 1] trained 3 steps on rank 1 of 2 as __main__"]
    weights = [(tmp_path / "weights" / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert weights[0] == weights[1], "DDP inside the script synchronised the ranks"
    history = nbddp.dist_fit(torch.nn.Linear(4, 1), (torch.randn(64, 4), torch.randn(64, 1)), batch_size=8,
                             live=False)  # the group survived the script's destroy_process_group()
    assert history.status == "completed"


@pytest.mark.parametrize("body, match", [
    ("raise RuntimeError('bad config')\n", r"RuntimeError: bad config"),
    ("import torch.distributed as dist\ndist.init_process_group('nccl')\n",
     r"init_process_group\(backend='nccl'\): the workers' process group uses 'gloo'"),
    ("import sys\nsys.exit(3)\n", r"ScriptExit: broken\.py exited with status 3"),
])
def test_a_failing_script_names_the_rank_and_the_cause_and_the_workers_stay_usable(workers, tmp_path, body, match):
    script = tmp_path / "broken.py"
    script.write_text(body)
    with pytest.raises(nbddp.WorkerError, match=match):
        nbddp.run_script(script)
    assert nbddp.run(lambda: 1) == [1, 1]


def test_a_missing_script_is_named_before_any_rank_runs(workers, tmp_path):
    sent = len(workers.client.history)
    with pytest.raises(FileNotFoundError, match=r"run_script\('nowhere\.py'\): no such file \(looked for .*nowhere\.py\)"):
        nbddp.run_script("nowhere.py")
    with pytest.raises(TypeError, match=r"run_script\(path=\.\.\.\) takes the script's path, got int"):
        nbddp.run_script(3)
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(SyntaxError):
        nbddp.run_script(tmp_path / "syntax.py")
    assert len(workers.client.history) == sent


def test_interrupt_stops_a_script_on_every_rank(workers, tmp_path, written):
    script = tmp_path / "forever.py"
    script.write_text("import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)\n")

    pids = [p.pid for p in workers.placements]
    with interrupt_when(lambda: sum("looping" in text for _, text in written) >= 2), \
            pytest.raises(KeyboardInterrupt, match="interrupted on every rank"):
        nbddp.run_script(script)
    assert [p.pid for p in workers.placements] == pids, "an interrupt stops the script; nothing is killed"
    assert nbddp.run(lambda: 2) == [2, 2]


MYLIB = '''
import torch

def tag():
    return "{version}"

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x) * {scale}
'''


def _write_module(folder, name, version, scale):
    path = folder / f"{name}.py"
    path.write_text(MYLIB.format(version=version, scale=scale))
    stat = path.stat()  # a new mtime even when the edit lands in the same clock tick
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10_000_000))


def test_edited_module_next_to_the_notebook_reaches_the_workers(workers, tmp_path, monkeypatch):
    name = f"mylib_{os.getpid()}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    _write_module(tmp_path, name, "v1", 1.0)
    mylib = importlib.import_module(name)
    try:
        assert nbddp.run(mylib.tag) == ["v1", "v1"]
        nbddp.run_cell(f"import {name} as mylib\nfirst_tag = mylib.tag()")
        _write_module(tmp_path, name, "v2", 0.0)
        importlib.reload(mylib)
        assert nbddp.run(mylib.tag) == ["v2", "v2"], "the workers ran the old function"
        net = mylib.Net()
        h = nbddp.dist_fit(net, (torch.randn(64, 4), torch.randn(64, 1)), batch_size=8, lr=0.0, live=False)
        # the new forward multiplies by 0: the loss is mean(y^2) whatever the weights; the old one would not be
        x = torch.randn(8, 4)
        assert torch.equal(net(x), torch.zeros(8, 1)) and h.status == "completed"
        nbddp.run_cell(f"import {name} as mylib\nsecond_tag = mylib.tag()")  # a cell's own import: reloaded
        assert nbddp.pull("first_tag", "second_tag", rank=1) == {"first_tag": "v1", "second_tag": "v2"}
    finally:
        sys.modules.pop(name, None)


def test_a_module_the_workers_cannot_import_travels_by_value(workers, tmp_path):
    """The module exists only in the kernel (its file is gone, its folder is off sys.path): by value still works."""
    name = f"ghost_{os.getpid()}"
    folder = tmp_path / "only-in-the-kernel"
    folder.mkdir()
    _write_module(folder, name, "ghost", 2.0)
    sys.path.insert(0, str(folder))
    try:
        ghost = importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
    (folder / f"{name}.py").unlink()
    try:
        assert nbddp.run(ghost.tag) == ["ghost", "ghost"]
        net = ghost.Net()
        assert nbddp.dist_fit(net, (torch.randn(32, 4), torch.randn(32, 1)), batch_size=8, live=False).status == "completed"
    finally:
        sys.modules.pop(name, None)


def test_installed_packages_still_travel_by_reference_and_either_can_be_forced():
    import cloudpickle

    from nbddp.shipping import by_value as modules
    assert not modules.travels_by_value("torch.nn.functional", torch.nn.functional)
    assert not modules.travels_by_value("nbddp.api", sys.modules["nbddp.api"])
    assert modules.travels_by_value("faultkit", sys.modules.setdefault("faultkit", importlib.import_module("faultkit")))
    assert "faultkit" in modules.register_edited_modules()
    modules.ship_by_reference("faultkit")
    try:
        assert not modules.travels_by_value("faultkit", sys.modules["faultkit"])
        assert b"faultkit" in cloudpickle.dumps(sys.modules["faultkit"].regression_data)  # by name
    finally:
        modules.ship_by_value("faultkit")
    with pytest.raises(ValueError, match="nbddp itself must travel by reference"):
        modules.ship_by_value("nbddp.worker")
    with pytest.raises(TypeError, match=r"ship_by_reference\(module\) takes a module or its name"):
        modules.ship_by_reference(3)


def test_ddp_start_takes_every_option_start_takes(monkeypatch, ipython_shell):
    from nbddp import api
    from nbddp.monitor import status as health

    seen = {}
    monkeypatch.setattr(api, "start", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    monkeypatch.setattr(health, "status_table", lambda: "table")
    import nbddp as package

    package.load_ipython_extension(ipython_shell)
    try:
        ipython_shell.run_line_magic("ddp", "start -n 2 --backend gloo --timeout 240 --threads 1 --interface lo "
                                            "--stall-timeout 30 --profile p --cluster-id c")
    finally:
        package.unload_ipython_extension(ipython_shell)
    assert seen == {"args": (2,), "kwargs": {"backend": "gloo", "profile": "p", "cluster_id": "c", "timeout": 240.0,
                                             "threads": 1, "interface": "lo", "stall_timeout": 30.0, "slurm": None,
                                             "detach": False, "keep_alive": "2h"}}


def test_frameworks_open_no_listener_beyond_loopback(workers):
    """accelerate and Fabric find a group and never start a store of their own on MASTER_PORT."""
    pytest.importorskip("accelerate")
    import ipaddress

    from test_security import listening_while

    with listening_while(workers, every=0.2) as seen:
        nbddp.run(_accelerate_job, 8)
    ports = {env["MASTER_PORT"] for env in nbddp.run(_environment)}
    assert seen, "the sampler saw no socket at all: it looks at the wrong processes"
    assert not [s for s in seen if not ipaddress.ip_address(s[1]).is_loopback], sorted(set(seen))
    assert not [s for s in seen if str(s[2]) in ports], "something listened on MASTER_PORT"
