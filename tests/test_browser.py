"""The dashboard in a real browser: JupyterLab + headless Chromium (Debian's
``chromium-headless-shell``) driven by Playwright.

Runs ``notebooks/live_fit.ipynb``, samples the progress bar while training
runs (it must move at least twice before the end), waits for the plot image
and the final state, and saves screenshots under the test's output folder
(``tests/artifacts/``; with ``NBDDP_UPDATE_DOCS_IMG=1`` also copied to ``docs/img/dashboard.png``).

CI needs: ``apt-get install -y chromium-headless-shell`` and
``pip install -c constraints-dev.txt jupyterlab playwright`` (``playwright
install`` is not needed: the Debian browser is used).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

CHROMIUM = os.environ.get("NBDDP_CHROMIUM", "/usr/lib/chromium/chromium-headless-shell")
HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, os.pardir, "notebooks", "live_fit.ipynb")
ARTIFACTS = os.path.join(HERE, "artifacts")
DOCS_IMG = os.path.join(HERE, os.pardir, "docs", "img", "dashboard.png")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420), pytest.mark.notebook]


def _requirements() -> None:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium not installed at {CHROMIUM}: run `apt-get install -y chromium-headless-shell` "
                    "(Debian/Ubuntu) or set NBDDP_CHROMIUM to a headless Chromium binary")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the browser itself comes from apt)")
    pytest.importorskip("jupyterlab", reason="pip install jupyterlab")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on a loopback port with a token, serving a copy of the notebook."""
    _requirements()
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / "live_fit.ipynb")
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, NBDDP_DEMO_PACE="0.06", JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=", "--ServerApp.open_browser=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start: {(tmp_path / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield url, token
    finally:
        _shutdown(proc, url, token)
        log.close()


def _shutdown(proc: subprocess.Popen, url: str, token: str) -> None:
    """Stop JupyterLab and its kernels (whose reaper ends any workers), by our own pid only."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    try:
        req = urllib.request.Request(f"{url}/api/shutdown?token={token}", method="POST")
        urllib.request.urlopen(req, timeout=10).read()
    except OSError:
        proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    _, alive = psutil.wait_procs(kids, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


PLOT_SHOWN = "() => { const i = document.querySelector('.nbddp-dashboard img'); return !!(i && i.complete && i.naturalWidth > 100); }"


def _plot_shown(page) -> bool:
    return page.evaluate(PLOT_SHOWN)


def _percent(page) -> int | None:
    text = page.evaluate("() => { const e = document.querySelector('.nbddp-percent'); return e ? e.innerText : null; }")
    m = re.match(r"\s*(\d+)%", text or "")
    return int(m.group(1)) if m else None


def test_dashboard_advances_in_jupyterlab(lab, tmp_path):
    from playwright.sync_api import sync_playwright

    url, token = lab
    out_dir = tmp_path / "artifacts"
    out_dir.mkdir()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{url}/lab/tree/live_fit.ipynb?token={token}", timeout=120_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                                   " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                                   timeout=120_000)
            page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.ready")
            # not awaited: the command's promise resolves only when every cell has run
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }")

            # training: sample the bar while it runs
            page.wait_for_selector(".nbddp-dashboard", timeout=180_000)
            samples: list[tuple[float, int]] = []
            midway = None
            deadline = time.monotonic() + 240
            raw = []
            plot_during = False
            while time.monotonic() < deadline:
                pct = _percent(page)
                raw.append((round(time.monotonic(), 2), pct, page.evaluate(
                    "() => { const d = document.querySelector('.nbddp-dashboard'); return d ? d.innerText.slice(0, 200) : null; }")))
                if pct is not None:
                    samples.append((time.monotonic(), pct))
                    if 0 < pct < 100 and _plot_shown(page):
                        plot_during = True
                    if 30 <= pct < 100 and midway is None:
                        midway = out_dir / "dashboard-training.png"
                        page.locator(".nbddp-dashboard").screenshot(path=str(midway))
                    if pct >= 100:
                        break
                time.sleep(0.25)
            during = sorted({p for _, p in samples if 0 < p < 100})
            assert len(during) >= 2, f"the bar did not advance while training; samples: {samples} {raw}"
            assert [p for _, p in samples] == sorted(p for _, p in samples), f"the bar went backwards: {samples}"
            assert plot_during, "the loss plot never appeared while training ran"

            # the end: completed, 100 %, the plot is a real image
            page.wait_for_function("() => { const s = document.querySelector('.nbddp-dashboard .nbddp-status');"
                                   " return s && s.innerText.includes('completed'); }", timeout=120_000)
            page.wait_for_function(PLOT_SHOWN, timeout=60_000)
            assert _percent(page) == 100
            text = page.locator(".nbddp-dashboard").inner_text()
            assert "step 96/96" in text and "val_acc" in text and "peak memory" in text
            final = out_dir / "dashboard.png"
            # the whole output area, so the status line above the dashboard box is in the picture too
            page.locator(".jp-OutputArea-output", has=page.locator(".nbddp-dashboard")).first.screenshot(path=str(final))
            page.screenshot(path=str(out_dir / "jupyterlab.png"), full_page=True)
        finally:
            browser.close()
    assert final.stat().st_size > 10_000
    os.makedirs(ARTIFACTS, exist_ok=True)
    for shot in out_dir.iterdir():
        shutil.copy(shot, os.path.join(ARTIFACTS, shot.name))
    if os.environ.get("NBDDP_UPDATE_DOCS_IMG") == "1":  # refresh the README's picture on purpose only
        os.makedirs(os.path.dirname(DOCS_IMG), exist_ok=True)
        shutil.copy(final, DOCS_IMG)
