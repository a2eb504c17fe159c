"""The one path of ``nbddp.predict`` and ``nbddp.evaluate`` from the public call to the outputs: check, ship,
run on every rank, wait or hand back the handle (``nbddp/api.py`` keeps only the signatures)."""

from __future__ import annotations

from typing import Any

from nbddp.execution.work import interrupts_held, wait_interruptibly
from nbddp.live.choice import LiveChoice
from nbddp.protocol.data_forms import DataLike
from nbddp.session.session import get_session
from nbddp.fit.arguments import ModelLike


def run_inference(what: str, model: ModelLike | str, data: DataLike, batch_size: int | None, precision: str | None,
               live: LiveChoice, block: bool, output: str = "tensor", to: str | None = None,
               **callables: Any) -> Any:
    """The one path of ``predict`` and ``evaluate``: check, ship, run on every rank, wait or hand back."""
    from nbddp.execution.handle import check_block
    from nbddp.inference.checks import prepare
    from nbddp.inference.predict_run import PredictHandle, PredictRun
    from nbddp.live.choice import live_choice, resolved

    check_block(block, what)
    view = resolved(live_choice(live, what, stacklevel=5))  # deprecated, live_choice, _inference, predict, the cell
    s = get_session()
    s.ensure_started()
    kept = None
    if isinstance(model, str):
        from nbddp.inference.checks import check_model, kept_model

        check_model(model, what)
        kept = kept_model(s, model, what)
    with interrupts_held() as held, s.lock:  # an interrupt while it launches stops it once launched
        s.ensure_ready()
        plan = prepare(s, what, model, data, batch_size, precision, output, to, kept, **callables)
        run_ = PredictRun(s, plan, view)
        run_.launch()
    if not block:
        handle: PredictHandle[Any] = PredictHandle(run_)
        if held:
            run_.request_stop()
        return handle
    wait_interruptibly(run_, already=len(held))
    return run_.result()
