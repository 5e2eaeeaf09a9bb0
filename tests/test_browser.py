"""The slot animation in a real browser: JupyterLab on 127.0.0.1, driven by Playwright
with Debian's Chromium (no browser download).

Opens ``NOTEBOOK``, runs all cells from the Run menu, checks the slot grid has
``EXPECTED_SLOTS`` slots, presses play while the kernel still runs the lesson's later cells,
checks the frame advances before the kernel is idle, then interrupts the kernel (the rest of
the lesson is nbval's to run, once a test run) and keeps a screenshot in a temporary folder
(``BATCHLAB_SCREENSHOTS=DIR`` keeps it). JupyterLab serves a temporary copy of the notebook's
folder, so running cells never touches the repository's files.
"""

from __future__ import annotations

import os
import sys
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from batchlab.model.load import LAYERS_ENV
from jupyterlab_driver import (
    BUSY,
    free_port,
    isolated_env,
    launch_chromium,
    menu,
    missing,
    open_notebook,
    run_all_cells,
    stop,
    wait_for_idle_kernel,
    wait_until_serving,
)

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "02_continuous_batching.ipynb"
EXPECTED_SLOTS = 8  # max_batch_size of the run the notebook's first slot view shows
# Screenshots go to a temporary folder (tests write nowhere else); set
# BATCHLAB_SCREENSHOTS=DIR to keep them (e.g. to look at a failure).
SCREENSHOT = (
    Path(os.environ.get("BATCHLAB_SCREENSHOTS") or tempfile.mkdtemp(prefix="batchlab-shots-")) / "widget.png"
)
RUN_ALL_TIMEOUT_MS = 600_000  # from "Run All Cells" until the first slot grid is on the page
# (lesson 2 loads the model and runs two engines on the real model first: ~1 min on a quiet
# 2-core CPU, several times that on a busy one)

# Skipped where the browser or the package is missing (a Mac), but never in CI: there a
# missing install must fail the run, not hide in a skip.
MISSING = missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(MISSING is not None and os.environ.get("CI") != "true", reason=str(MISSING)),
]


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
    # The model's first two layers (BATCHLAB_LAYERS, as the learner copies run): this test checks
    # the animation, not what the model says, and the lesson's runs before the grid take a quarter
    # of the time.
    env = isolated_env(tmp_path, settings) | {LAYERS_ENV: "2"}
    # The suite's one round of each timed comparison (BATCHLAB_REPETITIONS, inherited) is enough:
    # the test presses play while the lesson's arrivals-over-time run (requests arriving at one a
    # second, over about 16 s an engine) keeps the kernel busy.
    port = free_port()
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
        wait_until_serving(url, server, log)
        yield url
    finally:
        stop(server)


def test_slot_animation_plays_in_jupyterlab(jupyterlab):
    from playwright.sync_api import sync_playwright

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        try:
            open_notebook(page, jupyterlab, NOTEBOOK.name)
            run_all_cells(page)

            view = page.locator(".batchlab-slotview").first
            grid = view.locator(".batchlab-slots")
            grid.wait_for(timeout=RUN_ALL_TIMEOUT_MS)
            # The replay plays in the browser alone: press play while the lesson's later cells
            # still run (lesson 2's arrivals-over-time run keeps the kernel busy for half a minute).
            busy = page.locator(".jp-StatusBar-Widget").get_by_text(BUSY)
            assert busy.count() == 1, "the kernel finished the lesson before the test could press play"
            assert grid.locator(".bl-lane[data-slot]").count() == EXPECTED_SLOTS
            assert int(grid.get_attribute("data-num-slots")) == EXPECTED_SLOTS
            first_step = int(view.locator(".bl-counter").get_attribute("data-step"))
            shown = grid.locator(f'.bl-cell[data-step="{first_step}"]:visible')
            assert shown.count() >= EXPECTED_SLOTS

            view.locator(".batchlab-play button").first.click()
            target = min(first_step + 12, int(grid.get_attribute("data-num-steps")) - 1)
            view.locator(".bl-counter").first.wait_for(timeout=5_000)
            page.wait_for_function(
                "target => +document.querySelector('.batchlab-slotview .bl-counter').dataset.step >= target",
                arg=target,
                timeout=20_000,
            )
            assert busy.count() == 1, "the frames advanced, but only once the kernel was idle"
            assert grid.locator('.bl-cell[data-kind="decode"]:visible').count() > 0
            rows = grid.locator('.bl-cell[data-lane="0"]:visible').evaluate_all(
                "cells => new Set(cells.map(c => Math.round(c.getBoundingClientRect().top))).size"
            )
            assert rows == 1, f"slot 0's cells in view lie on {rows} rows, not one"
            # paused, the columns after the step shown are blank, as frame_html draws them
            view.locator(".batchlab-play button").nth(1).click()
            now = int(view.locator(".bl-counter").get_attribute("data-step"))
            later = grid.locator(f'.bl-cell[data-step="{now + 1}"]:visible')
            if later.count():
                assert later.first.evaluate("e => getComputedStyle(e).borderStyle") == "dashed"
            # The rest of the lesson is nbval's to run (tests run it once a run): stop it here.
            menu(page, "Kernel", "Interrupt Kernel")
            wait_for_idle_kernel(page, 60_000)
            page.locator(".batchlab-slotview").first.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOT))
        except Exception:
            page.screenshot(path=str(SCREENSHOT.with_name("widget-failure.png")))
            raise
        finally:
            browser.close()
