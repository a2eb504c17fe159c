"""The GPU kit keeps working: scripts/gpu_wheels.sh, scripts/gpu_check.sh, benchmarks/bench_gpu.py.

The GPU machine runs ``bash scripts/gpu_check.sh`` (with ``.whl/`` carried);
here the benchmark's CPU version runs on the suite's shared workers, and the
scripts are checked for syntax and a sane package list. No speed is asserted:
the machines are noisy. The one ``requires_gpu`` test is what gpu_check.sh's
pytest step adds to ``tests/test_features_gpu.py``: a model that lives on CUDA
in the kernel goes out and comes back to its own device.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


@pytest.fixture
def bench_gpu():
    sys.path.insert(0, ROOT)
    try:
        from benchmarks import bench_gpu

        yield bench_gpu
    finally:
        sys.path.remove(ROOT)


def _finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.bench
@pytest.mark.timeout(400)  # about a minute on a quiet 2-core machine: two torchrun jobs are most of it
def test_bench_gpu_cpu_version_reports_every_competitor(workers, bench_gpu, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("with CUDA bench_gpu runs its GPU version; scripts/gpu_check.sh runs that")
    import nbddp

    res = bench_gpu.main(quick=True)

    assert res["mode"] == "cpu" and res["quick"] is True
    by = {(r["workload"], r["precision"], r["competitor"]): r for r in res["rows"]}
    assert {w for w, _, _ in by} == {"conv", "transformer"}
    assert {p for _, p, _ in by} == {"32", "bf16"}
    for workload in ("conv", "transformer"):
        for precision in ("32", "bf16"):
            for name in ("nbddp", "plain"):
                row = by[(workload, precision, name)]
                assert "error" not in row, row
                assert _finite_positive(row["samples_per_s"]), row
                assert row["timed_steps"] >= 1
            assert by[(workload, precision, "nbddp")]["world_size"] == 2
            assert "skipped" in by[(workload, precision, "dataparallel")]
        torchrun = by[(workload, "32", "torchrun")]
        assert "error" not in torchrun, torchrun
        assert _finite_positive(torchrun["samples_per_s"]) and torchrun["vs_torchrun"] == 1.0
        assert torchrun["world_size"] == 2
        assert _finite_positive(by[(workload, "32", "nbddp")]["vs_torchrun"])
        assert "skipped" in by[(workload, "bf16", "torchrun")]
        nb = by[(workload, "32", "nbddp")]
        assert nb["timings"]["ship_s"] >= 0 and nb["timings"]["return_s"] >= 0

    skipped = {s["part"]: s["reason"] for s in res["skipped"]}
    assert {"dataparallel", "precision 16-mixed", "nccl", "cuda_roundtrip", "peak_cuda_memory"} <= set(skipped)
    assert all(skipped.values())
    assert "cuda_roundtrip" not in res
    pr = res["predict"]  # nbddp.predict in bf16 on the workers, outputs back in order
    assert "error" not in pr, pr
    assert pr["in_order"] and pr["dtype"] == "torch.bfloat16" and pr["samples"] == 2048, pr
    assert _finite_positive(pr["return_gbps"]) and _finite_positive(pr["call_s"])
    prefetch = res["prefetch"]
    if "prefetch" in prefetch:  # this nbddp has no prefetch option yet
        assert prefetch["prefetch"] == "prefetch: not supported by this nbddp"
    else:
        assert _finite_positive(prefetch["prefetch=0"]["samples_per_s"])
        assert _finite_positive(prefetch["prefetch=1"]["samples_per_s"])

    for key in ("date", "hostname", "gpus", "torch", "cuda_runtime", "driver", "command", "settings"):
        assert key in res, key
    assert res["settings"]["warmup"] >= 1 and res["settings"]["steps"] >= 1
    assert nbddp.status()["running"], "the benchmark stopped the suite's shared workers"

    rows = bench_gpu.summary_rows(res)
    assert any(r["metric"] == "samples/s" and r["competitor"] == "nbddp" for r in rows)
    assert any(r["metric"] == "outputs back GB/s" for r in rows)
    assert any(r["metric"] == "skipped" and r["competitor"] == "dataparallel" for r in rows)

    from benchmarks import common

    path = common.write_json({"gpu": res}, path=tmp_path / "gpu.json")
    loaded = json.loads(path.read_text())
    assert loaded["gpu"]["rows"] and loaded["environment"]["hostname"]


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_script_is_valid_bash(script):
    proc = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_list() -> tuple[list[str], list[str], list[str]]:
    """gpu_wheels.sh's pinned specs, its ALREADY_THERE and its NOT_CARRIED names."""
    text = open(os.path.join(SCRIPTS, "gpu_wheels.sh")).read()
    block = text.split("# BEGIN PACKAGES", 1)[1].split("# END PACKAGES", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    specs = [line for line in lines if line and line not in ("EOF", ")") and not line.startswith("PACKAGES=")]
    there = re.search(r'^ALREADY_THERE="([^"]*)"', text, re.M).group(1).split()
    skipped = re.search(r'^NOT_CARRIED="([^"]*)"', text, re.M).group(1).split()
    return specs, there, skipped


def test_wheel_list_is_pinned_and_unique():
    specs, there, skipped = _wheel_list()
    assert len(specs) > 10
    bad = [s for s in specs if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][0-9A-Za-z.+!-]*", s)]
    assert not bad, f"every line must be name==version: {bad}"
    names = [_norm(s.split("==")[0]) for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"one version of each package: {dupes} appear twice"
    for needed in ("ipyparallel", "ipykernel", "ipywidgets", "pyzmq", "jupyter-client", "pytest", "pytest-timeout",
                   "pandas", "holistictraceanalysis", "plotly", "pydot"):  # History.time_split(), profile["hta"]
        assert needed in names
    assert not {_norm(n) for n in there} & set(names), "a package is both downloaded and expected on the GPU machine"
    assert not {_norm(n) for n in skipped} & (set(names) | {_norm(n) for n in there})
    assert "torch" in there


def test_each_carried_package_installed_here_has_its_requirements_carried_or_there():
    """The closure gpu_wheels.sh checks from the wheels it downloads, checked here from this venv's metadata
    (no network) for the listed packages installed at their pinned version: a new requirement fails here first."""
    from importlib import metadata

    from packaging.requirements import Requirement

    specs, there, skipped = _wheel_list()
    pins = {_norm(s.split("==")[0]): s.split("==")[1] for s in specs}
    covered = set(pins) | {_norm(n) for n in there} | {_norm(n) for n in skipped}
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    checked, missing = [], []
    for name, version in pins.items():
        try:
            if metadata.version(name) != version:
                continue
        except metadata.PackageNotFoundError:
            continue
        checked.append(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if (req.marker is None or req.marker.evaluate(env)) and _norm(req.name) not in covered:
                missing.append(f"{req} (needed by {name})")
    assert len(checked) > 10 and not missing, f"add to gpu_wheels.sh (or ALREADY_THERE): {missing}"


def test_what_is_not_carried_is_never_imported_by_the_package_that_declares_it():
    """HTA declares jupyterlab but imports it nowhere; gpu_wheels.sh leaves it out (NOT_CARRIED) on that ground."""
    hta = pytest.importorskip("hta")
    _, _, skipped = _wheel_list()
    assert skipped == ["jupyterlab"]
    root = os.path.dirname(hta.__file__)
    importing = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py")
                 and re.search(r"^\s*(import|from)\s+jupyterlab\b", open(os.path.join(d, f)).read(), re.M)]
    assert not importing


@pytest.mark.requires_gpu
def test_model_living_on_cuda_comes_back_to_its_device(gpu_workers):
    import nbddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)).to("cuda:0")
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(256, 3, 16, 16, generator=g), torch.randint(0, 10, (256,), generator=g))
    history = nbddp.dist_fit(model, data, max_steps=4, batch_size=16, loss_fn=F.cross_entropy,
                             optimizer=torch.optim.SGD, lr=0.1, precision="bf16", live=False)
    after = model.state_dict()
    assert {str(v.device) for v in after.values()} == {"cuda:0"}
    assert any(not torch.equal(before[k], after[k].cpu()) for k in before if after[k].is_floating_point())
    assert history.timings["ship_s"] >= 0 and history.timings["return_s"] >= 0
