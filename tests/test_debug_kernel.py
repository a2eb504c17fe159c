"""The debugger in a real Jupyter kernel: prompts arrive as input requests, answered here.

One kernel (and its 2 workers) for the module, through ``jupyter_client``
with ``allow_stdin=True``: a post-mortem on rank 1 that prints a local, the
Python API with ``commands=``, a breakpoint in ``step_fn`` during a blocking
fit (print a local, continue: the same weights as without it), a breakpoint
in a ``%%ddp`` cell on both ranks (list, cast, continue all), ``block=False``
with ``%ddp debug 1`` in the next cell, Kernel > Interrupt at the prompt, and the same breakpoint with no stdin (as nbclient
runs a notebook): reported, never waited for.

With ``NBDDP_DEBUG_TRANSCRIPTS=<folder>`` each session's transcript is
written there (``docs/debugging.md`` shows them).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from kernel_cells import SESSION, Kernel, Reply, none_left

pytestmark = [pytest.mark.notebook, pytest.mark.fresh_workers, pytest.mark.timeout(300)]

SETUP = '''
%load_ext nbddp
import torch, nbddp
from torch import nn
import torch.nn.functional as F
nbddp.start(2)
torch.manual_seed(0)
x, y = torch.randn(64, 4), torch.randn(64, 3)
'''

MODEL = '''
class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        if torch.distributed.get_rank() == 1:
            h = h @ torch.ones(5, 2)  # the shape bug, on rank 1 only
        return h
'''

STEP = '''
class Step:
    """step_fn: rank 1 stops at breakpoint() on step `at` (never for at=0)."""
    def __init__(self, at):
        self.at, self.n = at, 0

    def __call__(self, model, batch):
        x, y = batch
        loss = F.mse_loss(model(x), y)
        self.n += 1
        if torch.distributed.get_rank() == 1 and self.n == self.at:
            breakpoint()
        return loss

def fit(at, epochs=1):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    history = nbddp.dist_fit(model, (x, y), batch_size=8, epochs=epochs, step_fn=Step(at), live=False)
    return model, history
'''


class Debugged(Kernel):
    """A kernel whose cells' prompts are answered from a list, as a person at the debugger would."""

    def transcript(self, code: str, answers=(), on_prompt=None, stdin: bool = True,
                   timeout: float = 180) -> tuple[str, str]:
        """(everything the cell showed, as one text in order, with prompts and answers; the reply status).

        Each prompt gets the next of ``answers``, then ``c``; ``on_prompt(prompt, reply)`` may take it instead
        (it returns True). ``stdin=False``: no input can be asked, as when nbclient runs a notebook.
        """
        pending = list(answers)

        def answer(prompt: str, reply: Reply) -> str | None:
            if on_prompt is not None and on_prompt(prompt, reply):
                return None
            return pending.pop(0) if pending else "c"

        reply = self.execute(code, timeout, answer=answer if stdin else None)
        return reply.text, reply.status


@pytest.fixture(scope="module")
def kernel():
    """One kernel and its workers for every scenario; at the end, none of its processes may be left.

    The kernel does not carry the suite's run marker (``marked=False``): its workers live across this module's
    tests, which the per-test leak check would take for leaks; this fixture checks them.
    """
    k = Debugged(marked=False)
    prefix, pids = None, []
    try:
        for code in (SETUP, MODEL, STEP):  # three cells, as a notebook would have them
            text, status = k.transcript(code)
            assert status == "ok", text
        prefix, pids = k.run(SESSION)
        yield k  # no nbddp.stop(): the kernel's end takes its workers and files with it (the reaper), checked below
    finally:
        k.close()
        none_left(pids, prefix)


def _keep(name, text):
    folder = os.environ.get("NBDDP_DEBUG_TRANSCRIPTS")
    if folder:
        with open(os.path.join(folder, f"{name}.txt"), "w") as f:
            f.write(text)


def test_post_mortem_on_rank_1_prints_a_local(kernel):
    text, status = kernel.transcript("nbddp.dist_fit(Boom(), (x, y), batch_size=8, live=False)")
    assert status == "error" and "h = h @ torch.ones(5, 2)" in text, text
    assert re.search(r"Cell In\[\d+\], line \d+, in Boom.forward", text), "the remote frame names the cell"
    _keep("traceback", text)
    text, status = kernel.transcript("%ddp debug", answers=["p h.shape", "p x.shape", "ll", "q"])
    _keep("post-mortem", text)
    assert status == "ok", text
    assert "nbddp: rank 1 (pid" in text and "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in text
    assert "[rank 1] (Pdb) p h.shape\ntorch.Size([8, 3])\n" in text, text
    assert re.search(r"\d+  ->\t            h = h @ torch.ones\(5, 2\)", text), text
    text, status = kernel.transcript("print(nbddp.debug(commands=['p h.sum() > -1e9']))")
    assert status == "ok" and "[rank 1] (Pdb) p h.sum() > -1e9\ntensor(True)\n" in text, text


def test_breakpoint_in_step_fn_during_a_blocking_fit_then_the_same_weights(kernel):
    text, status = kernel.transcript("reference, _ = fit(0); print('reference', _.status)")
    assert status == "ok" and "reference completed" in text, text
    t0 = time.monotonic()
    text, status = kernel.transcript("model, history = fit(3); print('fit', history.status)",
                              answers=["p self.n", "p loss", "w", "c"])
    _keep("breakpoint", text)
    assert status == "ok", text
    assert "nbddp: rank 1 (pid" in text and "paused at breakpoint() at Cell In[" in text, text
    assert "-> return loss" in text and "[rank 1] (Pdb) p self.n\n3\n" in text and "tensor(" in text, text
    assert "nbddp: rank 1: continued" in text and "fit completed" in text, text
    assert time.monotonic() - t0 < 60
    text, _ = kernel.transcript("print('same', all(torch.equal(a, b) for a, b in "
                         "zip(model.state_dict().values(), reference.state_dict().values())))")
    assert "same True" in text, text


def test_breakpoint_in_a_ddp_cell_on_both_ranks_lists_them_then_cast_and_continue_all(kernel):
    cell = "%%ddp\nvalue = (rank + 1) * 10\nbreakpoint()\nprint('after', value + 1)"
    text, status = kernel.transcript(cell, answers=["cast ranks(0,1) p value", "continue all"])
    _keep("ddp-cell", text)
    assert status == "ok", text
    assert "ranks in the debugger (attach R to talk to one):\n  rank 0" in text, text
    assert "[rank 0] 10\n[rank 1] 20\n" in text and "[rank 0] after 11" in text and "[rank 1] after 21" in text, text


def test_block_false_says_where_the_rank_paused_and_ddp_debug_attaches_from_another_cell(kernel):
    start = ("handle = nbddp.dist_fit(nn.Linear(4, 3), (x, y), batch_size=8, step_fn=Step(2), live='text', "
             "block=False)\nimport time\nt0 = time.time()\n"
             "while not handle._run.live_state.paused and time.time() - t0 < 60:\n    time.sleep(0.05)\n"
             "time.sleep(1.5)  # a progress line while it is paused\n")
    text, status = kernel.transcript(start)
    assert status == "ok" and re.search(r"rank 1 paused at Cell In\[\d+\], line \d+ \(__call__\), `%ddp debug 1` to "
                                        r"attach", text), text
    text, status = kernel.transcript("%ddp debug 1", answers=["p self.n", "c"])
    _keep("block-false", text)
    assert status == "ok" and "[rank 1] (Pdb) p self.n\n2\n" in text and "rank 1: continued" in text, text
    text, status = kernel.transcript("print('fit', handle.wait().status)")
    assert status == "ok" and "fit completed" in text, text


def test_interrupt_at_the_prompt_stops_the_fit_and_no_stdin_means_no_wait(kernel):
    def interrupt(prompt, reply):
        kernel.interrupt()
        reply.text += f"{prompt}<Kernel > Interrupt>\n"
        return True

    # long enough that the stop lands before the end (4 steps an epoch)
    text, status = kernel.transcript("model, history = fit(2, epochs=100)", on_prompt=interrupt)
    # the clean stop lands the weights, then KeyboardInterrupt stops Run All (issue 37); the History stays reachable
    assert status == "error" and "FitInterrupted" in text, text
    text, status = kernel.transcript("print('fit', nbddp.last_history().status, len(nbddp.last_history().steps))")
    assert status == "ok" and "fit interrupted" in text, text
    text, status = kernel.transcript("model, history = fit(2); print('fit', history.status)", stdin=False)
    _keep("headless", text)
    assert status == "ok" and "fit completed" in text, text
    assert re.search(r"rank 1 stopped at breakpoint\(\) at Cell In\[\d+\], line \d+ in __call__, but no prompt can "
                     r"open here: the notebook's client sends no input", text), text
