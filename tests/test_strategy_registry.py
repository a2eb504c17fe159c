"""Issue 42 (item 3): strategies declare what they support, and one from outside nbddp runs through dist_fit.

``LoudDDP`` below is a strategy nbddp does not know: its settings class
and its worker class are defined in this test module (not installed: both
travel by value, as a notebook's would), and it declares nothing beyond its
worker class. It trains as DDP does, says so in ``History.ranks``, and is
refused, naming itself, where it declares no support. A plain subclass of
``nbddp.DDP`` keeps everything ``nbddp.DDP`` declares, and one defined in a
notebook cell (``__main__``) trains too. Two CPU ranks, a few steps, a
linear model.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch.utils.data import IterableDataset

import nbddp
from nbddp.protocol.parallel_settings import DDP, FSDP, Pipeline, TensorParallel, resolve_strategy, settings_of
from nbddp.protocol.strategy_settings import StrategySettings
from nbddp.worker.strategies import make_strategy, worker_class
from nbddp.worker.strategies.ddp import DDPStrategy

pytestmark = pytest.mark.timeout(300)


class LoudStrategy(DDPStrategy):
    """DDP that says it ran: every rank's entry in ``History.ranks`` carries the settings' ``shout``."""

    def roles(self, world: int) -> list[dict[str, str]]:
        return [{"shout": self.settings.shout} for _ in range(world)]


@dataclass(frozen=True)
class LoudDDP(StrategySettings):
    """A DDP variant from outside nbddp: its own worker class, and no support declared for anything else."""

    shout: str = "loud"
    worker = LoudStrategy

    def torch_kwargs(self) -> dict[str, bool]:
        return DDP().torch_kwargs()


class QuietDDP(nbddp.DDP):
    """A subclass of nbddp.DDP, as a notebook would write it: it keeps all that nbddp.DDP declares."""


class Rows(IterableDataset):
    def __iter__(self):
        x, y = _data()
        return iter(zip(x, y))


def _data(n: int = 32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _fit(model: nn.Module, strategy, **options):
    return nbddp.dist_fit(model, _data(), strategy=strategy, batch_size=4, epochs=1, lr=0.1, shuffle=False,
                          live=False, **options)


# ---- on the workers ------------------------------------------------------------------------------------------------

def test_a_strategy_defined_in_a_test_module_trains_with_its_own_worker_class(workers):
    loud, plain = _model(), _model()
    history = _fit(loud, LoudDDP(shout="here"))
    _fit(plain, "ddp")
    assert history.status == "completed" and [r.get("shout") for r in history.ranks] == ["here", "here"]
    assert not torch.equal(loud.weight, _model().weight)  # it trained
    assert torch.equal(loud.weight, plain.weight) and torch.equal(loud.bias, plain.bias)  # as DDP does


def test_a_strategy_that_declares_no_support_is_refused_naming_itself_before_anything_runs(workers):
    with pytest.raises(ValueError, match=r"dist_fit\(min_workers=\.\.\.\) needs a strategy that can go on with fewer "
                                         r"ranks, and strategy=LoudDDP\(\.\.\.\) does not declare it \(LoudDDP\."
                                         r"fewer_ranks is False\)\. Leave min_workers out .*declare fewer_ranks = True "
                                         r"on LoudDDP"):
        _fit(_model(), LoudDDP(), max_restarts=1, min_workers=1)
    with pytest.raises(ValueError, match=r"dist_fit\(data=\.\.\.\) needs a strategy that can train on a stream \(an "
                                         r"IterableDataset\), and strategy=LoudDDP\(\.\.\.\) does not declare it.*Give "
                                         r"a map-style Dataset; or, if its worker class can, declare streams = True"):
        nbddp.dist_fit(_model(), Rows(), strategy=LoudDDP(), batch_size=4, live=False)
    with pytest.raises(ValueError, match=r"dist_fit\(keep=\.\.\.\) needs a strategy that can be kept for "
                                         r"nbddp\.predict, and strategy=LoudDDP\(\.\.\.\) does not declare it \("
                                         r"LoudDDP\.kept_as is None\)\. Leave keep out; .*declare kept_as = 'module'"):
        _fit(_model(), LoudDDP(), keep="loud")


def test_a_subclass_of_nbddp_ddp_defined_in_a_test_module_trains_and_is_kept_for_predict(workers):
    quiet, plain = _model(), _model()
    _fit(quiet, QuietDDP(find_unused_parameters=True), keep="quiet")
    _fit(plain, "ddp")
    assert torch.equal(quiet.weight, plain.weight)
    x, y = _data(8)
    out = nbddp.predict("quiet", (x, y), batch_size=4, live=False)  # kept as what nbddp.DDP declares: a module
    assert torch.allclose(out, plain(x).detach(), atol=1e-6)
    nbddp.run_cell("del quiet")


# ---- units: no workers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, answers", [
    ("ddp", dict(name="ddp", worker="ddp", sharded=False, mp_dim=None, fewer_ranks=True, streams=True,
                 kept_as="module")),
    ("fsdp", dict(name="fsdp", worker="fsdp", sharded=True, mp_dim=None, fewer_ranks=True, streams=True,
                  kept_as="fsdp")),
    (Pipeline(), dict(name="pipeline", worker="pipeline", sharded=True, mp_dim="pp", fewer_ranks=False,
                      streams=False, kept_as="pipeline")),
    (TensorParallel(), dict(name="tensor", worker="tensor", sharded=True, mp_dim="tp", fewer_ranks=False,
                            streams=True, kept_as="tensor")),
])
def test_nbddps_own_strategies_answer_the_questions(strategy, answers):
    settings = settings_of(resolve_strategy(strategy))
    assert {q: getattr(settings, q) for q in answers} == answers
    assert type(make_strategy(strategy, torch.device("cpu"), mesh={"dp": 1, settings.mp_dim: 2}
                              if settings.mp_dim else None)).__name__ == worker_class(settings).__name__
    assert settings_of(QuietDDP()).kept_as == "module" and settings_of(LoudDDP()).kept_as is None


def test_the_string_forms_stay_as_they_were():
    assert resolve_strategy("ddp") == "ddp" and resolve_strategy("fsdp") == FSDP()
    assert resolve_strategy(DDP(static_graph=True)).static_graph is True
    with pytest.raises(ValueError, match=r"dist_fit\(strategy=\.\.\.\) must be one of \('ddp', 'fsdp'\)"):
        resolve_strategy("zero3")


def test_the_registry_finds_worker_classes_by_short_name_dotted_name_or_the_class():
    assert worker_class(DDP()) is DDPStrategy and worker_class(LoudDDP()) is LoudStrategy
    for name in ("nbddp.worker.strategies.ddp:DDPStrategy", "nbddp.worker.strategies.ddp.DDPStrategy"):
        assert worker_class(type("Named", (StrategySettings,), {"worker": name})()) is DDPStrategy
    strategy = make_strategy(LoudDDP(shout="x"), torch.device("cpu"))
    assert isinstance(strategy, LoudStrategy) and strategy.settings == LoudDDP(shout="x")


def test_a_worker_class_that_cannot_be_found_or_is_no_strategy_is_named():
    missing = type("Missing", (StrategySettings,), {"worker": "no_such_package.module:Cls"})()
    with pytest.raises(ValueError, match=r"Missing\.worker = 'no_such_package\.module:Cls' does not import on this "
                                         r"rank \(ModuleNotFoundError.*as 'package\.module:Class'"):
        worker_class(missing)
    odd = type("Odd", (StrategySettings,), {"worker": dict})()
    with pytest.raises(TypeError, match=r"Odd\.worker = <class 'dict'> is not a subclass of "
                                        r"nbddp\.worker\.strategies\.Strategy"):
        worker_class(odd)
    with pytest.raises(ValueError, match=r"unknown strategy 'pipeline'"):
        make_strategy("pipeline", torch.device("cpu"))


def test_declarations_nbddp_cannot_act_on_are_refused_when_the_strategy_is_given():
    with pytest.raises(TypeError, match=r"dist_fit\(strategy=Bare\(\.\.\.\)\): Bare declares no worker class.*"
                                        r"worker = YourStrategy \(a subclass of nbddp\.worker\.strategies\.Strategy\)"):
        resolve_strategy(type("Bare", (StrategySettings,), {})())
    with pytest.raises(ValueError, match=r"Kept\.kept_as = 'whole' is not one nbddp knows; declare one of "
                                         r"\(None, 'module', 'fsdp', 'pipeline', 'tensor'\)"):
        resolve_strategy(type("Kept", (StrategySettings,), {"worker": LoudStrategy, "kept_as": "whole"})())
    with pytest.raises(ValueError, match=r"strategy=Staged\(\.\.\.\)\) declares mp_dim='pp': .*must subclass "
                                         r"nbddp\.Pipeline or nbddp\.TensorParallel"):
        resolve_strategy(type("Staged", (StrategySettings,), {"worker": LoudStrategy, "mp_dim": "pp"})())


def test_settings_the_workers_cannot_import_travel_by_value_and_nbddps_own_by_name():
    own = pickle.dumps(DDP(static_graph=True))
    assert b"nbddp.protocol.parallel_settings" in own and b"cloudpickle" not in own
    loud = pickle.dumps(LoudDDP(shout="x"))
    assert b"rebuild" in loud and pickle.loads(loud) == LoudDDP(shout="x")


NOTEBOOK_CELL = """
import torch, nbddp

class LoudDDP(nbddp.DDP):
    pass

torch.manual_seed(0)
notebook_model = torch.nn.Linear(4, 1)
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 4, generator=g)
notebook_history = nbddp.dist_fit(notebook_model, (x, x.sum(1, keepdim=True)), strategy=LoudDDP(), batch_size=4,
                                  epochs=1, lr=0.1, shuffle=False, live=False)
"""


def test_a_subclass_of_nbddp_ddp_defined_in_a_notebook_trains(workers, ip):
    """The notebook's ``__main__`` is not the workers': without travelling by value, ``Can't get attribute 'LoudDDP'``."""
    result = ip.run_cell(NOTEBOOK_CELL, store_history=False)
    try:
        result.raise_error()
        assert ip.user_ns["LoudDDP"].__module__ == "__main__"
        plain = _model()
        _fit(plain, "ddp")
        assert ip.user_ns["notebook_history"].status == "completed"
        assert torch.equal(ip.user_ns["notebook_model"].weight, plain.weight)
    finally:
        for name in ("LoudDDP", "notebook_model", "notebook_history", "x", "g"):
            ip.user_ns.pop(name, None)
