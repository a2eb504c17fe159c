"""The dashboard's "Profile 10 steps" button: ``handle.profile(steps=10)`` without leaving the dashboard.

The click handler runs in the kernel's message thread, which must stay
free (the Stop button and every other widget need it), so the request is
made and waited for in a thread of its own; the merged trace's path and the
top operators appear under the button when every rank's trace is in.
"""

from __future__ import annotations

import html
import threading
from nbddp.live.state import ViewedFit

STEPS = 10


class ProfileButton:
    """A button and the line under it, for one fit."""

    def __init__(self) -> None:
        import ipywidgets as w

        self.button = w.Button(description=f"Profile {STEPS} steps", icon="clock-o",
                               tooltip=f"torch.profiler on every rank over the next {STEPS} steps, merged into one "
                                       "trace file; the fit goes on (handle.profile(steps=...))")
        self.result = w.HTML(value="")
        self.widget = w.VBox([self.button, self.result])
        self.button.on_click(self._on_click)
        self.run: ViewedFit | None = None
        self.thread: threading.Thread | None = None

    def _on_click(self, _button: object = None) -> None:
        run = self.run
        if run is None or run.finished or (self.thread is not None and self.thread.is_alive()):
            return
        self.button.disabled = True
        self.result.value = f"<div style='font-size:12px'>profiling the next {STEPS} steps...</div>"
        self.thread = threading.Thread(target=self._profile, args=(run,), name="nbddp-profile", daemon=True)
        self.thread.start()

    def _profile(self, run: ViewedFit) -> None:
        try:
            profile = run.requests.wait(run.requests.ask(STEPS), None)
            text = profile["summary"] if profile else "the fit ended before a traced step"
        except Exception as exc:  # noqa: BLE001 - shown where the person clicked, not lost in a thread
            text = f"profile failed: {type(exc).__name__}: {exc}"
        self.result.value = f"<pre style='font-size:11px;margin:0'>{html.escape(text)}</pre>"
        self.button.disabled = bool(run.finished)

    def finish(self) -> None:
        self.button.disabled = True
