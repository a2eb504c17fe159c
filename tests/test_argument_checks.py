"""Kernel-side argument checks, each with its message: no workers needed (a fake session)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from nbddp.fit import preflight
from nbddp.session.resident_datasets import ResidentSet
from nbddp.protocol.placement import Placement


def fake_session(device: str = "cpu", world: int = 2):
    placements = [Placement(rank=r, local_rank=r, world_size=world, local_world_size=world, engine_id=r, host="h",
                            pid=r, device=device, address="127.0.0.1", local=True) for r in range(world)]
    return SimpleNamespace(placements=placements, world_size=world, resident=ResidentSet(), generation=1, send_pool=None,
                           file_prefix="nbddp-test")


DATA = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
CASES = [
    ("empty val_data", dict(val_data=(torch.empty(0, 4), torch.empty(0, dtype=torch.long))),
     ValueError, r"dist_fit\(val_data=\.\.\.\) is empty \(len 0\); pass None"),
    ("metrics not a dict", dict(val_data=DATA, metrics=[len]), TypeError, r"metrics=\.\.\.\) must be a dict of name -> fn"),
    ("metrics without val_data", dict(metrics={"acc": len}), ValueError, r"metrics=\.\.\.\) are computed on validation data"),
    ("metrics with step_fn", dict(val_data=DATA, metrics={"acc": len}, step_fn=lambda m, b: 0),
     ValueError, r"metrics=\.\.\.\) cannot see outputs inside a step_fn"),
    ("16-mixed on CPU", dict(precision="16-mixed"), ValueError, r"precision='16-mixed'\) needs CUDA GPUs"),
    ("sync_batchnorm on CPU", dict(sync_batchnorm=True), ValueError, r"sync_batchnorm=True\) needs CUDA GPUs"),
    ("batch larger than the shard", dict(batch_size=33), ValueError, r"batch_size=33\) is larger than each rank's shard: 64 samples over 2"),
    ("checkpoint_every without dir", dict(checkpoint_every=5), ValueError, r"checkpoint_every=\.\.\.\) needs checkpoint_dir"),
    ("resume=True without dir", dict(resume=True), ValueError, r"resume=True\) resumes from checkpoint_dir"),
    ("tuple of non-tensors", dict(data=(torch.ones(2), [1, 2])), TypeError, r"a tuple must hold tensors \(x, y, \.\.\.\), got \(Tensor, list\)"),
    ("lr with an optimizer factory", dict(lr=0.1, optimizer=lambda params: torch.optim.SGD(params, lr=0.01)),
     ValueError, r"dist_fit\(lr=0\.1\) is only used for the default optimizer or an optimizer class; a factory sets its own"),
    ("unknown scheduler interval", dict(scheduler_interval="batch"), ValueError,
     r"scheduler_interval=\.\.\.\) must be 'step' \(after every optimizer step\) or 'epoch'.*got 'batch'"),
    ("scheduler_interval not step or epoch", dict(scheduler_interval="sometimes"), ValueError,
     r"scheduler_interval=\.\.\.\) must be 'step' .* or None to let the scheduler's kind decide; got 'sometimes'"),
    ("scheduler dict without a scheduler", dict(scheduler={"interval": "step"}), ValueError,
     r"scheduler=\{\.\.\.\}\) takes Lightning's keys .* got the keys \['interval'\]"),
    ("scheduler dict frequency 0", dict(scheduler={"scheduler": len, "frequency": 0}), ValueError,
     r"scheduler=\{'frequency': \.\.\.\}\) steps the scheduler every k-th interval: an int >= 1; got 0"),
    ("scheduler dict monitor not a name", dict(scheduler={"scheduler": len, "monitor": 3}), TypeError,
     r"scheduler=\{'monitor': \.\.\.\}\) names a recorded value such as 'val_loss'; got int 3"),
    ("on_nan not a policy", dict(on_nan="ignore"), ValueError,
     r"on_nan=\.\.\.\) says what a NaN or inf loss does: 'raise' .* 'stop' .* or 'skip' .*; got 'ignore'"),
    ("a loader's batch size and batch_size=", dict(data=DataLoader(TensorDataset(*DATA), batch_size=16), batch_size=8),
     ValueError, r"dist_fit\(batch_size=8\) and the DataLoader's batch_size=16 disagree; give one of them"),
    ("a loader's order and shuffle=", dict(data=DataLoader(TensorDataset(*DATA), batch_size=16), shuffle=True),
     ValueError, r"dist_fit\(shuffle=True\) and the DataLoader's shuffle=False disagree; leave shuffle out"),
    ("keep not an identifier", dict(keep="my model"), ValueError, r"keep=\.\.\.\) names the variable .* got 'my model'"),
    ("return_weights not a bool", dict(return_weights="yes"), TypeError, r"return_weights=\.\.\.\) must be True or False"),
]


@pytest.mark.parametrize("kind, kwargs, exc, match", CASES, ids=[c[0] for c in CASES])
def test_prepare_refuses_before_any_worker_is_asked(kind, kwargs, exc, match):
    kwargs = dict(kwargs)
    data = kwargs.pop("data", DATA)
    with pytest.raises(exc, match=match):
        preflight.prepare(fake_session(), nn.Linear(4, 2), data, **kwargs)


def test_live_must_be_a_known_mode():
    from nbddp.live import choose_view

    with pytest.raises(ValueError, match=r"live=\.\.\.\) must be True, False, None \(automatic\), 'widget' or 'text'; got 'fancy'"):
        choose_view("fancy")


def test_block_must_be_a_bool():
    import nbddp

    with pytest.raises(TypeError, match=r"dist_fit\(block=\.\.\.\) must be True or False, got 'yes'"):
        nbddp.dist_fit(nn.Linear(4, 2), DATA, block="yes")


def test_start_takes_a_cluster_or_an_attachment_not_both():
    from nbddp.session.session import Session

    with pytest.raises(ValueError, match=r"start\(\) takes either cluster=\.\.\. or profile=/cluster_id=\.\.\., not both"):
        Session().start(cluster=object(), profile="default")


def test_an_optimizer_factory_must_return_an_optimizer():
    from nbddp.worker.training.setup import make_optimizer

    with pytest.raises(TypeError, match=r"optimizer=\.\.\. must be an Optimizer class or a factory of params"):
        make_optimizer(lambda params: "sgd", nn.Linear(2, 2).parameters(), 0.1)


def test_precision_names_and_their_aliases_are_one_vocabulary():
    from nbddp.fit.option_checks import make_config

    assert [make_config(precision=p).precision for p in ("32", "32-true", "bf16", "bf16-mixed", "16-mixed")] == [
        "32-true", "32-true", "bf16-mixed", "bf16-mixed", "16-mixed"]
    with pytest.raises(ValueError, match=r"must be one of \('32-true', 'bf16-mixed', '16-mixed'\) .* got 'bf16-true' "
                                         r"\(did you mean 'bf16-mixed'\?\)"):
        make_config(precision="bf16-true")


def test_lr_goes_with_an_optimizer_class_and_a_factory_keeps_its_own():
    session = fake_session()
    plan = preflight.prepare(session, nn.Linear(4, 2), DATA, optimizer=torch.optim.SGD, lr=0.5)
    assert plan.cfg.lr == 0.5
    plan.discard()
    plan = preflight.prepare(session, nn.Linear(4, 2), DATA, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.2))
    assert plan.cfg.lr is None
    plan.discard()


def test_dist_fit_keywords_are_the_option_records():
    """The one list of option names is ``fit/arguments.py``'s records: ``dist_fit``'s keywords are their fields, with
    the same defaults and types; the rest are the ``**advanced`` ones its docstring names."""
    import dataclasses
    import inspect

    import nbddp
    from nbddp.fit.arguments import FitArguments

    fields = {f.name: f for group in FitArguments().groups() for f in dataclasses.fields(group)}
    params = {p.name: p for p in inspect.signature(nbddp.dist_fit).parameters.values()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(params) <= set(fields), sorted(set(params) - set(fields))
    for name, p in params.items():
        assert (p.default, p.annotation) == (fields[name].default, fields[name].type), name
    advanced = set(fields) - set(params)
    assert advanced == {"drop_last", "num_workers", "pin_memory", "prefetch", "record_interval_s",
                        "publish_interval_s"}
    assert all(f"``{name}``" in nbddp.dist_fit.__doc__ for name in advanced)


def test_options_are_sorted_into_their_records_once_and_a_typo_is_refused():
    from nbddp.fit.arguments import FitArguments

    args = FitArguments.of({"lr": 0.5, "val_every": 3, "block": False, "num_workers": 2})
    assert (args.step.lr, args.validation.val_every, args.watch.block, args.data.num_workers) == (0.5, 3, False, 2)
    assert args.by_name()["epochs"] == 1 and args.by_name()["lr"] == 0.5
    with pytest.raises(TypeError, match=r"dist_fit\(\) got unknown option\(s\) \['epoch'\]; see help\(nbddp"):
        FitArguments.of({"epoch": 3})
    # a call that watches no fit of its own (sweep, find_batch_size, scaling_report) takes no watch options
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['callbacks', 'live'\]"):
        preflight.prepare(fake_session(), nn.Linear(4, 2), DATA, live=False, callbacks=[])


def test_what_a_sweep_may_vary_is_read_from_the_records_and_is_plain_config():
    import dataclasses

    from nbddp.protocol.fit_options import FitConfig
    from nbddp.sweeps.space import SWEEPABLE

    assert set(SWEEPABLE) == {"lr", "batch_size", "epochs", "max_steps", "seed", "grad_accum", "clip_grad_norm",
                              "precision", "shuffle", "log_every", "val_every", "drop_last"}
    assert set(SWEEPABLE) <= {f.name for f in dataclasses.fields(FitConfig)}


def test_auto_batch_size_tries_the_fits_own_step_without_its_collectives():
    from nbddp.fit.arguments import FitArguments
    from nbddp.measure.batch_size import trial_arguments

    args = FitArguments.of({"precision": "bf16-mixed", "grad_accum": 2, "on_nan": "skip", "strategy": "fsdp",
                            "compile": True, "num_workers": 2, "batch_size": "auto", "epochs": 5, "keep": "m"})
    trial = trial_arguments(args)
    assert (trial.step.precision, trial.step.grad_accum, trial.layout.strategy, trial.data.num_workers) == (
        "bf16-mixed", 2, "fsdp", 2)
    assert (trial.step.on_nan, trial.layout.compile, trial.data.batch_size) == ("raise", False, None)
    assert (trial.loop, trial.result) == (FitArguments().loop, FitArguments().result)
