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

import time

import pytest

from kernel_cells import SESSION, Kernel, Reply, none_left, streamed

pytestmark = [pytest.mark.notebook, pytest.mark.fresh_workers, pytest.mark.timeout(300)]

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
out([history.status, h.done(), time.monotonic()])
'''


@pytest.fixture
def kernel():
    """A kernel with 2 workers and the model; at the end none of its processes or files may be left (it checks
    them itself: ``marked=False``)."""
    k = Kernel(marked=False)
    prefix, pids = None, []
    try:
        k.cell(SETUP)
        prefix, pids = k.run(SESSION)
        yield k
    finally:
        k.close()
        none_left(pids, prefix)


def test_await_handle_leaves_the_kernels_loop_free_while_the_fit_runs(kernel):
    shown = kernel.cell(FIT)
    stop = [m["content"]["comm_id"] for m in shown.messages if m["header"]["msg_type"] == "comm_open"
            and m["content"]["data"].get("state", {}).get("description") == "Stop"]
    assert len(stop) == 1, "the dashboard's Stop button"
    kernel.cell(TICKER)
    clicked: list[float] = []
    ticks = 0

    def click_after_ticks(msg: dict, reply: Reply) -> None:
        """Once the loop has printed two ticks under the awaiting cell, click Stop (a widget message)."""
        nonlocal ticks
        if msg["header"]["msg_type"] == "stream" and not clicked:
            ticks += msg["content"]["text"].count("TICK training")
            if ticks >= 2:
                clicked.append(time.monotonic())
                kernel.kc.shell_channel.send(kernel.kc.session.msg("comm_msg", {"comm_id": stop[0], "data": {
                    "method": "custom", "content": {"event": "click"}}}))

    reply = kernel.finish(kernel.send(AWAIT), timeout=180, on_output=click_after_ticks)
    assert reply.status == "ok", reply.text
    text = streamed(reply.messages)  # the ticks are the earlier cell's task's: its output, not this cell's
    assert clicked, f"no tick arrived while the cell awaited the fit:\n{text}"
    status, done, awaited_at = reply.value
    assert (status, done) == ("interrupted", True), text
    ticks_at = [float(line.split()[2]) for line in text.splitlines() if line.startswith("TICK training")]
    assert len(ticks_at) >= 2 and max(ticks_at) < awaited_at, "the loop ran while the fit trained"
    after = kernel.run("out([len(h.history.steps), h.result().status])")
    assert after[1] == "interrupted", after  # stopped by the click, long before its 200 epochs
