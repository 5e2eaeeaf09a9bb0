"""``environment.yml`` (the conda set-up for a Mac) installs what it lists with pip: check
that this resolves against the package index, on this machine and, as far as pip on
Linux can tell, for macOS arm64. The whole resolution on this machine is uv's (the resolver
``scripts/setup.sh`` installs with), which answers it in seconds where pip took a minute."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli, the same parser
    import tomli as tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow  # pip resolves against the package index

ROOT = Path(__file__).resolve().parents[1]
MAC = {
    "sys_platform": "darwin",
    "platform_machine": "arm64",
    "platform_system": "Darwin",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def pip_section() -> tuple[str, list[str]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = next(
        d.split("=", 1)[1] for d in env["dependencies"] if isinstance(d, str) and d.startswith("python=")
    )
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    return python, pip


def project_copy(folder: Path) -> Path:
    """What ``pip install -e .`` reads (pyproject.toml, README.md, src/), copied to ``folder``:
    building its metadata writes an egg-info beside the sources, which must not be the repository's."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", folder)
    shutil.copy(ROOT / "README.md", folder)
    shutil.copytree(ROOT / "src", folder / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    return folder


def dry_run(args: list[str], report: Path, cwd: Path) -> list[dict]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(report.read_text())["install"]


def uv_would_install(args: list[str], venv: Path, cwd: Path) -> set[str]:
    """The names of what ``uv pip install --dry-run`` would put in the new, empty environment
    ``venv``, resolved against the package index (and a find-links folder set in pip's
    configuration, which uv does not read: ``scripts/setup.sh`` passes it on the same way)."""
    from uv import find_uv_bin

    uv = find_uv_bin()
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    links = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    ).stdout.strip()
    done = subprocess.run(
        [uv, "pip", "install", "--dry-run", "--python", str(venv / "bin" / "python")]
        + (["--find-links", links] if links else [])
        + args,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()  # " + name==version", one a package
    return {line.split()[1].split("==")[0].lower() for line in lines if line.startswith(" + ")}


def test_the_pip_section_resolves_here(tmp_path):
    _, pip = pip_section()
    assert pip == ["-e .[test]"], "this test reads the pip section as an install of this project"
    project = project_copy(tmp_path / "project")
    names = uv_would_install([arg for line in pip for arg in shlex.split(line)], tmp_path / "venv", project)
    assert {"batchlab", "mlx", "mlx-lm", "jupyterlab", "torch", "transformers"} <= names, sorted(names)


def test_every_requirement_has_a_wheel_for_macos_arm64(tmp_path):
    """Each requirement the project and its test extra declare for a Mac (markers
    evaluated for macOS arm64 and environment.yml's Python) has a wheel for it. Their own
    dependencies are not resolved here: pip evaluates those markers for the machine it
    runs on (a Linux one), so it would ask for Linux-only packages (e.g. torch's CUDA)."""
    python, pip = pip_section()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = pip[0].split("[", 1)[1].rstrip("]").split(",")
    env = {**MAC, "python_version": python, "python_full_version": f"{python}.0"}
    wanted = [
        Requirement(r)
        for r in project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    ]
    mac = [r for r in wanted if r.marker is None or r.marker.evaluate(env)]
    assert any(r.name == "mlx" and "cpu" not in r.extras for r in mac), "Metal MLX on a Mac"
    specs = [
        f"{r.name}{''.join(sorted(r.extras)) and '[' + ','.join(sorted(r.extras)) + ']'}{r.specifier}"
        for r in mac
    ]
    installs = dry_run(
        [
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            "macosx_14_0_arm64",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--target",
            str(tmp_path / "target"),
            *specs,
        ],
        tmp_path / "report.json",
        tmp_path,
    )
    got = {i["metadata"]["name"].lower().replace("_", "-"): i["download_info"]["url"] for i in installs}
    assert set(got) == {r.name.lower().replace("_", "-") for r in mac}
    assert "macosx" in got["mlx"] and "arm64" in got["mlx"]
    assert "macosx" in got["torch"]
