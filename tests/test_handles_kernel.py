"""``await handle`` in a real Jupyter kernel: the kernel's event loop goes on while the fit runs.

A cell that awaits a ``FitHandle`` does not hold the kernel's loop, as a
blocking ``handle.result()`` would: a task an earlier cell started keeps
printing while the fit trains (its lines arrive before the fit ends), and
the dashboard's Stop button, a widget message the kernel can only handle
while its loop is free, stops the fit under the awaiting cell, which then
ends with the interrupted ``History``.

ipykernel runs the cells of one shell one at a time (a second
``execute_request`` waits for the first), so what goes on meanwhile is the
loop's other work: tasks, and widget messages.
"""

from __future__ import annotations

import json
import os
import queue
import time

import pytest

from test_debug_kernel import PIDS, _none_left

pytestmark = [pytest.mark.notebook, pytest.mark.fresh_workers, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP = '''
import asyncio, time
import torch, nbddp
from torch import nn

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        time.sleep(0.05)
        return self.lin(x)

nbddp.start(2)
x, y = torch.randn(64, 4), torch.randn(64, 2)
'''

FIT = "h = nbddp.dist_fit(Slow(), (x, y), epochs=200, batch_size=8, live='widget', block=False)"

TICKER = '''
async def ticker():
    while not h.done():
        print("TICK", "done" if h.done() else "training", time.monotonic(), flush=True)
        await asyncio.sleep(0.3)

ticking = asyncio.ensure_future(ticker())
'''

AWAIT = '''
history = await h
print("AWAITED", history.status, h.done(), time.monotonic(), flush=True)
'''


def _take(kc, until_reply_of: str, on_message=None, timeout: float = 180.0) -> list[dict]:
    """Every IOPub message until the execute reply of ``until_reply_of`` came (shell), in order."""
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    replied = idle = False
    while time.monotonic() < deadline:
        if replied and idle:
            return seen
        try:
            msg = kc.iopub_channel.get_msg(timeout=0.2)
            seen.append(msg)
            if on_message is not None:
                on_message(msg)
            idle = idle or (msg["header"]["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                            and msg["parent_header"].get("msg_id") == until_reply_of)
        except queue.Empty:
            pass
        try:
            reply = kc.get_shell_msg(timeout=0.01)
            if reply["parent_header"].get("msg_id") == until_reply_of:
                assert reply["content"]["status"] == "ok", reply["content"]
                replied = True
        except queue.Empty:
            pass
    raise AssertionError(f"no reply to {until_reply_of} within {timeout} s; saw {[m['header']['msg_type'] for m in seen]}")


def _text(messages: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in messages if m["header"]["msg_type"] == "stream")


@pytest.fixture
def kernel():
    from conftest import RUN_MARKER
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    env = {k: v for k, v in os.environ.items() if k != RUN_MARKER}  # this fixture checks its workers itself
    km.start_kernel(env=dict(env, PYTHONPATH=ROOT), cwd=ROOT)
    kc = km.client()
    kc.start_channels()
    prefix, pids = None, []
    try:
        kc.wait_for_ready(timeout=120)
        _take(kc, kc.execute(SETUP))
        prefix, pids = json.loads(_text(_take(kc, kc.execute(PIDS))).split("NBDDP-PIDS", 1)[1])
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        _none_left(pids, prefix)


def test_await_handle_leaves_the_kernels_loop_free_while_the_fit_runs(kernel):
    kc = kernel
    shown = _take(kc, kc.execute(FIT))
    stop = [m["content"]["comm_id"] for m in shown if m["header"]["msg_type"] == "comm_open"
            and m["content"]["data"].get("state", {}).get("description") == "Stop"]
    assert len(stop) == 1, "the dashboard's Stop button"
    _take(kc, kc.execute(TICKER))
    clicked: list[float] = []

    def click_after_ticks(msg: dict) -> None:
        """Once the loop has printed two ticks under the awaiting cell, click Stop (a widget message)."""
        ticks = msg["header"]["msg_type"] == "stream" and msg["content"]["text"].count("TICK training")
        if ticks and not clicked:
            click_after_ticks.ticks = getattr(click_after_ticks, "ticks", 0) + ticks
            if click_after_ticks.ticks >= 2:
                clicked.append(time.monotonic())
                kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": stop[0], "data": {
                    "method": "custom", "content": {"event": "click"}}}))

    awaiting = kc.execute(AWAIT)
    messages = _take(kc, awaiting, on_message=click_after_ticks)
    text = _text(messages)
    assert clicked, f"no tick arrived while the cell awaited the fit:\n{text}"
    awaited = [line for line in text.splitlines() if line.startswith("AWAITED")]
    assert len(awaited) == 1 and awaited[0].split()[1:3] == ["interrupted", "True"], text
    ticks = [float(line.split()[2]) for line in text.splitlines() if line.startswith("TICK training")]
    assert len(ticks) >= 2 and max(ticks) < float(awaited[0].split()[3]), "the loop ran while the fit trained"
    after = _text(_take(kc, kc.execute("print('STEPS', len(h.history.steps), h.result().status)")))
    assert "interrupted" in after, after  # stopped by the click, long before its 200 epochs
