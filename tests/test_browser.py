"""The slot animation in a real browser: JupyterLab on 127.0.0.1, driven by Playwright
with Debian's Chromium (no browser download).

Opens ``NOTEBOOK``, runs all cells from the Run menu, checks the slot grid has
``EXPECTED_SLOTS`` slots, presses play, checks the frame advances, and keeps a
screenshot in a temporary folder (``BATCHLAB_SCREENSHOTS=DIR`` keeps it). JupyterLab serves a temporary copy of the notebook's
folder, so running cells never touches the repository's files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "02_continuous_batching.ipynb"
EXPECTED_SLOTS = 8  # max_batch_size of the run the notebook's first slot view shows
# Screenshots go to a temporary folder (tests write nowhere else); set
# BATCHLAB_SCREENSHOTS=DIR to keep them (e.g. to look at a failure).
SCREENSHOT = (
    Path(os.environ.get("BATCHLAB_SCREENSHOTS") or tempfile.mkdtemp(prefix="batchlab-shots-")) / "widget.png"
)
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
RUN_ALL_TIMEOUT_MS = 600_000  # from "Run All Cells" until the first slot grid is on the page
# (lesson 2 loads the model and runs two engines on the real model first: ~1 min on a quiet
# 2-core CPU, several times that on a busy one)


def _missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "needs the playwright package"
    if not CHROMIUM.exists():
        return f"needs Debian's chromium at {CHROMIUM}"
    return None


# Skipped where the browser or the package is missing (a Mac), but never in CI: there a
# missing install must fail the run, not hide in a skip.
MISSING = _missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MISSING is not None and os.environ.get("CI") != "true", reason=str(MISSING)),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_serving(url: str, server: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(server: subprocess.Popen) -> None:
    """End the server's process group; on SIGTERM the server shuts its kernels down first."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(server.pid, sig)
            server.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def jupyterlab(tmp_path):
    """A token-less JupyterLab on 127.0.0.1 serving a copy of the notebook's folder, with its
    own configuration, settings and workspaces (no user state leaks in); yields the base URL."""
    root = tmp_path / "root"
    shutil.copytree(NOTEBOOK.parent, root)
    settings = {
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        # render every cell, so a widget far down the notebook is in the page too
        "notebook-extension/tracker": {"windowingMode": "none"},
    }
    for name, values in settings.items():
        path = tmp_path / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    env = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "jupyterlab.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ip=127.0.0.1",
                f"--port={port}",
                "--ServerApp.port_retries=0",
                "--IdentityProvider.token=",
                "--allow-root",
                "--ServerApp.terminals_enabled=False",
                "--LabApp.extension_manager=readonly",
                f"--ServerApp.root_dir={root}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        _wait_until_serving(url, server, log)
        yield url
    finally:
        _stop(server)


def test_slot_animation_plays_in_jupyterlab(jupyterlab):
    from playwright.sync_api import sync_playwright

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            # Run All only once the kernel is connected and idle: sooner races its startup.
            with page.expect_websocket(lambda ws: "/api/kernels/" in ws.url, timeout=30_000):
                page.goto(f"{jupyterlab}/lab/tree/{NOTEBOOK.name}")
            page.locator(".jp-StatusBar-Widget").get_by_text(re.compile(r"\| Idle$")).wait_for(timeout=30_000)
            page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current").click()  # more room
            page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
            page.locator(".lm-Menu-item", has_text=re.compile(r"^Run All Cells")).click()

            grid = page.locator(".batchlab-slots").first
            grid.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            assert grid.locator(".bl-lane[data-slot]").count() == EXPECTED_SLOTS
            assert int(grid.get_attribute("data-num-slots")) == EXPECTED_SLOTS
            first_step = int(grid.get_attribute("data-step"))
            assert grid.locator(f'.bl-cell[data-step="{first_step}"]').count() >= EXPECTED_SLOTS

            page.locator(".batchlab-play button").first.click()
            target = min(first_step + 12, int(grid.get_attribute("data-num-steps")) - 1)
            page.wait_for_function(
                "target => +document.querySelector('.batchlab-slots').dataset.step >= target",
                arg=target,
                timeout=20_000,
            )
            assert int(grid.locator(".bl-counter").get_attribute("data-step")) > first_step
            assert grid.locator('.bl-cell[data-kind="decode"]').count() > 0
            page.locator(".batchlab-slotview").first.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOT))
        except Exception:
            page.screenshot(path=str(SCREENSHOT.with_name("widget-failure.png")))
            raise
        finally:
            browser.close()
