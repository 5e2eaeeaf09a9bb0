"""The BLAS kernel choice: the rule on synthetic CPUs, the float64 check, the fallback,
the cache, and the whole path (``import batchlab`` then an MLX matmul) in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import batchlab
from batchlab import _blas
from batchlab._blas import SGEMM_TOLERANCE, CoreChoice, choose_core, sgemm_error, verified_choice

AVX512 = frozenset(
    "sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd".split()
)
AVX2_FMA = frozenset("sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma".split())
SSE_ONLY = frozenset("sse sse2 pni ssse3 sse4_1 sse4_2".split())
linux_openblas = pytest.mark.skipif(
    sys.platform != "linux" or not (_blas.STATUS.core or "").strip(),
    reason="the kernel choice is about Debian's OpenBLAS on Linux",
)


@pytest.mark.parametrize(
    "flags, detected, core",
    [
        (AVX512, "Prescott", "SkylakeX"),  # the unrecognised AVX-512 Xeon of issue 15
        (AVX512, "Nehalem", "SkylakeX"),
        (AVX512, "Haswell", "SkylakeX"),
        (AVX512, "SkylakeX", None),
        (AVX512, "Cooperlake", None),  # what 0.3.21 picks on an AVX-512 AMD EPYC: already AVX-512
        (AVX2_FMA, "Prescott", "Haswell"),
        (AVX2_FMA, "Zen", None),
        (AVX2_FMA, "Haswell", None),
        (AVX2_FMA - {"fma"}, "Prescott", "Sandybridge"),  # AVX2 without FMA is not enough for Haswell
        (AVX512 - {"avx512bw"}, "Prescott", "Haswell"),  # an incomplete AVX-512 set is not enough either
        (SSE_ONLY, "Prescott", None),
        (frozenset(), "Prescott", None),
    ],
)
def test_choose_core(flags, detected, core):
    choice = choose_core(flags, detected)
    assert choice.core == core, choice
    assert detected in choice.reason


def test_a_users_coretype_is_never_overridden():
    choice = choose_core(AVX512, "Prescott", user_setting="Prescott")
    assert choice.core is None
    assert choice.reason.endswith(
        "OPENBLAS_CORETYPE=Prescott set in the environment: left as is (this CPU could run SkylakeX)"
    )
    assert choose_core(AVX2_FMA, None, user_setting="Haswell").reason.endswith("left as is")


def test_unknown_detection_leaves_openblas_alone():
    assert choose_core(AVX512, None).core is None


def test_sgemm_error_rejects_a_wrong_product():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 576)).astype(np.float32)
    b = rng.standard_normal((576, 1536)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    right = a @ b
    assert sgemm_error(right, want, scale) < SGEMM_TOLERANCE
    one_wrong = right.copy()
    one_wrong[17, 1000] += 0.01 * scale[17, 1000]  # one element off by 1% of its scale
    assert sgemm_error(one_wrong, want, scale) > SGEMM_TOLERANCE
    half_k = a[:, :288] @ b[:288]  # a kernel that drops half the sum
    assert sgemm_error(half_k, want, scale) > SGEMM_TOLERANCE


def fake_probe(own: dict, trial: dict):
    calls = []

    def probe(path, core):
        calls.append(core)
        return own if core is None else trial

    return probe, calls


@pytest.mark.parametrize(
    "trial, problem",
    [
        ({"core": "SkylakeX", "error": 0.3}, "sgemm off by 3.0e-01"),
        ({"core": "SkylakeX", "error": float("nan")}, "sgemm off by nan"),
        ({"failed": "exit -4: "}, "exit -4"),  # SIGILL: the CPU lacks an instruction
        ({"core": "Haswell", "error": 0.0}, "OpenBLAS ran Haswell instead"),
    ],
)
def test_a_failing_core_falls_back_to_openblas_own(trial, problem):
    probe, calls = fake_probe({"core": "Prescott", "error": 1e-7}, trial)
    choice, detected = verified_choice("libopenblas.so.0", AVX512, probe=probe)
    assert calls == [None, "SkylakeX"]
    assert (choice.core, detected) == (None, "Prescott")
    assert problem in choice.reason and "kept Prescott" in choice.reason


def test_a_core_that_passes_is_chosen():
    probe, calls = fake_probe({"core": "Prescott", "error": 1e-7}, {"core": "SkylakeX", "error": 2e-7})
    choice, _ = verified_choice("libopenblas.so.0", AVX512, probe=probe)
    assert choice.core == "SkylakeX" and "checked against float64" in choice.reason


def test_no_trial_when_openblas_own_pick_suits():
    probe, calls = fake_probe({"core": "Haswell", "error": 1e-7}, {"failed": "must not run"})
    choice, _ = verified_choice("libopenblas.so.0", AVX2_FMA, probe=probe)
    assert choice.core is None and calls == [None]


@linux_openblas
def test_probe_runs_the_real_library():
    own = _blas.probe(_blas.STATUS.path, None)
    assert own["error"] < SGEMM_TOLERANCE and own["core"]
    # OpenBLAS quietly runs another core when asked for one it lacks: the name check catches it
    assert _blas.probe(_blas.STATUS.path, "NoSuchCore")["core"] != "NoSuchCore"


@linux_openblas
def test_the_verdict_is_cached_per_library_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def choice(path, flags):
        calls.append(path)
        return CoreChoice("SkylakeX", "because"), "Prescott"

    monkeypatch.setattr(_blas, "verified_choice", choice)
    library = tmp_path / "libopenblas.so.0"
    library.write_bytes(b"one")
    assert _blas._cached_choice(str(library)) == CoreChoice("SkylakeX", "because")
    again = _blas._cached_choice(str(library))
    assert again.core == "SkylakeX" and "cached in" in again.reason and len(calls) == 1
    library.write_bytes(b"another build")  # an upgraded library is checked again
    _blas._cached_choice(str(library))
    assert len(calls) == 2
    assert len(json.loads((tmp_path / "batchlab" / "blas.json").read_text())) == 2


END_TO_END = """
import json, os
import batchlab
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(2)
x = rng.standard_normal((16, 576)).astype(np.float32)
w = rng.standard_normal((1536, 576)).astype(np.float32)
y = np.array(mx.array(x) @ mx.array(w).T)
want = x.astype(np.float64) @ w.astype(np.float64).T
scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
s = batchlab._blas.STATUS
print(json.dumps({"error": batchlab._blas.sgemm_error(y, want, scale), "core": s.core,
                  "reason": s.core_reason, "env": os.environ.get("OPENBLAS_CORETYPE")}))
"""


def run_fresh(env_core: str | None, cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env["XDG_CACHE_HOME"] = cache
    if env_core:
        env["OPENBLAS_CORETYPE"] = env_core
    out = subprocess.run(
        [sys.executable, "-c", END_TO_END], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux_openblas
def test_import_batchlab_then_mlx_matmul_is_right(tmp_path):
    """A first import (empty cache) chooses, checks and loads a kernel; MLX's matmul then agrees
    with numpy's float64 to float32 accuracy, and the kernel it reports is the one it chose."""
    result = run_fresh(None, str(tmp_path))
    assert result["error"] < SGEMM_TOLERANCE, result
    if result["env"]:  # a core was set for OpenBLAS (and for child processes)
        assert result["env"].lower() == result["core"].lower()
        assert "checked against float64" in result["reason"]
    assert (tmp_path / "batchlab" / "blas.json").exists()


@linux_openblas
def test_import_batchlab_keeps_the_users_coretype(tmp_path):
    result = run_fresh("Prescott", str(tmp_path))
    assert result["core"] == "Prescott" and result["env"] == "Prescott"
    assert "OPENBLAS_CORETYPE=Prescott set in the environment" in result["reason"]
    assert result["error"] < SGEMM_TOLERANCE
    assert not (tmp_path / "batchlab").exists()  # nothing probed, nothing cached


@linux_openblas
def test_info_shows_the_kernel_and_why(capsys, monkeypatch, lm):
    from batchlab.cli import main

    monkeypatch.setattr(batchlab.model.load, "load_model", lambda path=None, dtype=None: lm)
    assert main(["info"]) == 0
    lines = {
        line.split()[0]: line
        for line in capsys.readouterr().out.splitlines()
        if line and not line[0].isspace()
    }
    assert lines["kernel"].split()[1] == f"{_blas.STATUS.core}:"
    assert _blas.STATUS.core_reason in lines["kernel"]
    assert float(lines["sgemm"].split()[1]) > 0 and f"{_blas.STATUS.core} kernel" in lines["sgemm"]
