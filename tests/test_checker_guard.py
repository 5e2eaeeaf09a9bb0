"""The checker guard's cases (``checker_guard_cases.py``: endless loops, blocked waits, wrong
types, import errors, library changes) in a pytest process of their own.

The guard stops a learner's code by raising in its thread and by SIGUSR1; run in the suite's
own process, a later test that starts coverage (``test_gpu_path``) hung in
``threading.settrace``. Until that is understood, the cases run apart: every one of them must
pass there, and this test fails with their output if one does not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_the_guard_cases_pass_in_a_process_of_their_own():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "checker_guard_cases.py"),
        ],
        capture_output=True,
        text=True,
        cwd=HERE.parent,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
