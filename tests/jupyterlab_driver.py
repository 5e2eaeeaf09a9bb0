"""Driving JupyterLab in a real browser: a JupyterLab server on 127.0.0.1 with its own
configuration, Debian's Chromium through Playwright (no browser download), and the few
things a learner does there (open a lesson and wait for its kernel, pick a menu item).

Shared by ``test_browser.py`` (the slot animation in JupyterLab) and ``new_user_run.py``
(a new learner's run of the lessons, a recorded script). Not a test module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

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
IDLE = re.compile(r"\| Idle$")  # the kernel's status in JupyterLab's status bar
BUSY = re.compile(r"\| Busy$")


def missing() -> str | None:
    """Why a browser run cannot happen here (None when it can)."""
    if importlib.util.find_spec("playwright") is None:
        return "needs the playwright package"
    if not CHROMIUM.exists():
        return f"needs Debian's chromium at {CHROMIUM}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(folder: Path, settings: dict | None = None, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with JupyterLab's configuration,
    settings, workspaces, data and runtime folders under ``folder``, so no user state leaks
    in and nothing is written outside it; ``settings`` ({"notebook-extension/tracker":
    {...}}, names under ``@jupyterlab/``) become the user's settings there."""
    for name, values in (settings or {}).items():
        path = folder / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    return {
        **(os.environ if base is None else base),
        "JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces"),
        "JUPYTER_CONFIG_DIR": str(folder / "config"),
        "JUPYTER_DATA_DIR": str(folder / "data"),
        "JUPYTER_RUNTIME_DIR": str(folder / "runtime"),
    }


def api(url: str, path: str, token: str = "", method: str = "GET", timeout: float = 10.0):
    """One call to the Jupyter server's REST API; the decoded JSON answer (None if empty)."""
    request = urllib.request.Request(f"{url}{path}", method=method)
    if token:
        request.add_header("Authorization", f"token {token}")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        body = answer.read()
    return json.loads(body) if body else None


def wait_until_serving(
    url: str, server: subprocess.Popen, log: Path, timeout: float = 30.0, token: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            api(url, "/api/status", token, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def shut_down_kernels(url: str, token: str = "") -> int:
    """Delete every session (which shuts its kernel down) and every kernel left; how many."""
    n = 0
    for session in api(url, "/api/sessions", token) or []:
        api(url, f"/api/sessions/{session['id']}", token, method="DELETE", timeout=30)
        n += 1
    for kernel in api(url, "/api/kernels", token) or []:
        api(url, f"/api/kernels/{kernel['id']}", token, method="DELETE", timeout=30)
        n += 1
    return n


def stop(server: subprocess.Popen) -> None:
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


def launch_chromium(playwright, **options):
    """Debian's Chromium, headless, through Playwright."""
    return playwright.chromium.launch(
        executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS, **options
    )


def wait_for_idle_kernel(page, timeout_ms: int = 30_000) -> None:
    page.locator(".jp-StatusBar-Widget").get_by_text(IDLE).wait_for(timeout=timeout_ms)


def open_notebook(page, url: str, path: str, token: str = "", reset: bool = False, timeout_ms: int = 30_000):
    """Open ``path`` (relative to the server's root) in JupyterLab, wait until its kernel is
    connected and idle (running cells sooner races its startup), then fold the left
    sidebar away for room. ``reset`` starts from an empty workspace (no tabs restored)."""
    query = "&".join(q for q in ("reset" if reset else "", f"token={token}" if token else "") if q)
    with page.expect_websocket(lambda ws: "/api/kernels/" in ws.url, timeout=timeout_ms):
        page.goto(f"{url}/lab/tree/{path}" + (f"?{query}" if query else ""))
    wait_for_idle_kernel(page, timeout_ms)
    tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if tab.count():
        tab.first.click()  # more room


def menu(page, name: str, item: str) -> None:
    """Pick ``item`` (the start of its label) from the main menu ``name``."""
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(name)}$")).click()
    page.locator(".lm-Menu-item", has_text=re.compile(rf"^{re.escape(item)}")).click()


def run_all_cells(page) -> None:
    menu(page, "Run", "Run All Cells")
