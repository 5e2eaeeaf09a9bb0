"""Repository-wide pytest settings for the lesson notebooks.

This file sits at the root because it is the one conftest pytest always loads, whether
it collects ``tests/``, ``notebooks/`` or a single notebook.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
NBVAL_SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"

# The learner copies (notebooks/learner/) have their solutions removed and their checker
# outputs cleared, so running them under nbval would only report the missing solutions.
# tests/test_exercises.py checks them instead (they are current, and they fail their checkers).
collect_ignore = ["notebooks/learner"]


def pytest_configure(config):
    # nbval opens its sanitize file relative to the working directory; an absolute path
    # lets pytest start anywhere. An explicit --nbval-sanitize-with still wins.
    if getattr(config.option, "nbval_sanitize_with", "unset") is None \
            and not getattr(config.option, "sanitize_with", None):
        config.option.nbval_sanitize_with = str(NBVAL_SANITIZE)
