"""The classroom set-up: each learner's own copy of the lessons, and the course's JupyterLab."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from batchlab.course import lessons as course_copy


@pytest.fixture
def lessons(tmp_path):
    """A repository-like tree: notebooks/ (solved) and notebooks/learner/ (learner copies)."""
    learner = tmp_path / "notebooks" / "learner"
    learner.mkdir(parents=True)
    for name in ("00_one.ipynb", "01_two.ipynb"):
        (tmp_path / "notebooks" / name).write_text("solved")
        (learner / name).write_text(f"> Learner copy of [`{name}`](../{name}) v1")
    return tmp_path


def test_lessons_are_copied_once_and_a_learners_edits_are_never_overwritten(lessons):
    source, dest = lessons / "notebooks" / "learner", lessons / "my-course"
    assert course_copy.copy_lessons(source, dest) == ["00_one.ipynb", "01_two.ipynb"]
    (dest / "00_one.ipynb").write_text("my work")
    (source / "00_one.ipynb").write_text("v2 of the lesson")
    (source / "02_three.ipynb").write_text("a new lesson")  # e.g. after a git pull
    assert course_copy.copy_lessons(source, dest) == ["02_three.ipynb"]
    assert (dest / "00_one.ipynb").read_text() == "my work"


def test_refresh_sets_the_learners_copy_aside_and_takes_a_fresh_one(lessons):
    source, dest = lessons / "notebooks" / "learner", lessons / "my-course"
    course_copy.copy_lessons(source, dest)
    (dest / "00_one.ipynb").write_text("my work")
    (source / "00_one.ipynb").write_text("v2 of the lesson")
    assert course_copy.copy_lessons(source, dest, refresh=["00_one"]) == ["00_one.ipynb"]
    assert (dest / "00_one.ipynb").read_text() == "v2 of the lesson"
    assert (dest / "00_one.old-1.ipynb").read_text() == "my work"
    assert course_copy.copy_lessons(source, dest, refresh=["all"]) == ["00_one.ipynb", "01_two.ipynb"]
    assert (dest / "00_one.old-2.ipynb").read_text() == "v2 of the lesson"
    with pytest.raises(ValueError, match="no lesson named 07_nope"):
        course_copy.copy_lessons(source, dest, refresh=["07_nope"])


def test_the_link_to_the_solved_lesson_leads_there_inside_the_course_folder(lessons):
    """JupyterLab is rooted at my-course/: the solved lessons are copied into
    my-course/solved/, and each copy's link points there (no 404 outside the root)."""
    dest = lessons / "my-course"
    course_copy.copy_lessons(lessons / "notebooks" / "learner", dest)
    course_copy.copy_solved(lessons / "notebooks", dest)
    text = (dest / "01_two.ipynb").read_text()
    link = text[text.index("](") + 2 : text.index(")", text.index("]("))]
    assert link == "solved/01_two.ipynb"
    assert (dest / link).resolve().read_text() == "solved"
    assert (dest / link).resolve().is_relative_to(dest.resolve())


def test_refreshing_a_lesson_never_touches_my_engine(lessons):
    source, dest = lessons / "notebooks" / "learner", lessons / "my-course"
    course_copy.copy_lessons(source, dest)
    engine = dest / "my_engine"
    engine.mkdir()
    (engine / "static.py").write_text("mine")
    course_copy.copy_lessons(source, dest, refresh=["all"])
    course_copy.copy_solved(lessons / "notebooks", dest)
    assert (engine / "static.py").read_text() == "mine"
    assert sorted(p.name for p in engine.iterdir()) == ["static.py"]


def test_unknown_options_such_as_no_browser_go_to_jupyterlab(monkeypatch, tmp_path):
    ran = {}
    monkeypatch.setattr(course_copy, "copy_lessons", lambda refresh=(): [])
    monkeypatch.setattr(course_copy, "copy_solved", lambda: [])
    monkeypatch.setattr(os, "execv", lambda path, command: ran.setdefault("command", command))
    course_copy.main(["--no-browser", "--port", "8899"])
    assert ran["command"][-3:] == ["--no-browser", "--port", "8899"] or ran["command"][-4:-1] == [
        "--no-browser",
        "--port",
        "8899",
    ]
    assert "lab" in ran["command"]


def test_batchlab_lessons_is_the_course_command(monkeypatch):
    """`batchlab lessons ...` (the README's command) runs the course's main with every option after it."""
    from batchlab import cli

    seen = []
    monkeypatch.setattr(course_copy, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["lessons", "--refresh", "all", "--no-browser"]) == 0
    assert seen == [["--refresh", "all", "--no-browser"]]


def test_the_repositorys_own_learner_lessons_are_found():
    assert course_copy.LEARNER.is_dir() and len(list(course_copy.LEARNER.glob("*.ipynb"))) >= 10
    assert "/my-course/" in (course_copy.ROOT / ".gitignore").read_text().split()


def test_jupyter_is_allowed_to_run_as_root_only_when_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "getuid", lambda: 0)
    assert "--allow-root" in course_copy.jupyter_command(tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    assert "--allow-root" not in course_copy.jupyter_command(tmp_path)


@pytest.mark.slow  # a real JupyterLab process
def test_the_course_jupyterlab_starts_here_and_has_its_pop_ups_off(tmp_path):
    """The course's own JupyterLab command, really started (as root on this machine, which
    plain ``jupyter lab`` refuses): the settings setup.sh installs are in effect."""
    installed = Path(sys.prefix) / "share/jupyter/lab/settings/overrides.d/batchlab.json"
    shipped = course_copy.ROOT / "scripts" / "jupyterlab-settings.json"
    assert installed.is_file(), "run scripts/setup.sh: it installs the course's JupyterLab settings"
    assert json.loads(installed.read_text()) == json.loads(shipped.read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = course_copy.jupyter_command(tmp_path) + [
        "--no-browser",
        f"--port={port}",
        "--ServerApp.token=course-test",
        f"--ServerApp.root_dir={tmp_path}",
    ]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "lab.log").read_text()
            try:
                r = httpx.get(url, headers={"Authorization": "token course-test"})
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "JupyterLab did not start"
            time.sleep(0.5)
        defaults = r.json()["schema"]["properties"]
        assert defaults["fetchNews"]["default"] == "false"
        assert defaults["checkForUpdates"]["default"] is False
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
