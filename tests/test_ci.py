"""`.ci/run` fails when the lint fails: run on a stand-in checkout whose setup does nothing,
whose ruff fails the chosen step, and whose pytest passes; after the suite it runs the fast tier
on the other Pythons."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def stand_in(tmp_path: Path, failing: str) -> Path:
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    (tmp_path / "scripts" / "other_pythons.sh").write_text('echo "other pythons ran" > other-pythons-ran\n')
    bin_ = tmp_path / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "ruff").write_text(f'#!/bin/sh\n[ "$1" = "{failing}" ] && exit 1\nexit 0\n')
    (bin_ / "python").write_text(
        '#!/bin/sh\necho "pytest ran" > "$(dirname "$0")/../../pytest-ran"\nexit 0\n'
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("failing", ["check", "format", "none"])
def test_a_lint_failure_fails_ci(tmp_path, failing):
    checkout = stand_in(tmp_path, failing)
    run = subprocess.run(["bash", str(checkout / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    if failing == "none":
        assert run.returncode == 0, run.stderr
        assert (checkout / "pytest-ran").exists() and (checkout / "other-pythons-ran").exists()
    else:
        assert run.returncode != 0, f"ruff {failing} failed and .ci/run still passed"
        assert not (checkout / "pytest-ran").exists() and not (checkout / "other-pythons-ran").exists()
