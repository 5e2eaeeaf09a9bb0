"""Make MLX's CPU backend use an optimized BLAS on Linux, with the right kernel.

The Linux ``mlx[cpu]`` wheel links the reference BLAS (a few GFLOP/s). Loading an
optimized library that exports ``cblas_sgemm`` with ``RTLD_GLOBAL`` *before*
``mlx.core`` is imported makes the dynamic linker bind MLX's matmuls to it, which
is about 5-30x faster here. ``import batchlab`` does this first, so learners do
nothing. On macOS MLX uses Accelerate and Metal, and this module does nothing.

OpenBLAS picks its kernel ("core") once, when it loads. An older OpenBLAS that does
not know a newer CPU falls back to its generic SSE3 core (Prescott) and runs 4x
slower, although the CPU's flags say a far better one would run. So before loading
we ask OpenBLAS, in a short subprocess, which core it picks by itself; if the CPU
supports a better one (``choose_core``), a second subprocess checks that core's
sgemm against a float64 reference, and only a core that passes is set through
``OPENBLAS_CORETYPE`` (children of this process inherit it). The verdict is cached
in ``~/.cache/batchlab/`` so later imports cost nothing. A user's own
``OPENBLAS_CORETYPE`` is never overridden.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

# Debian/Ubuntu paths of OpenBLAS (the pthread build first: it uses every core).
_CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
]
CORE_ENV = "OPENBLAS_CORETYPE"

# OpenBLAS x86-64 cores by the widest vector instructions their kernels use:
# 3 = AVX-512, 2 = AVX2 + FMA, 1 = AVX; any other core (Prescott, Core2, Nehalem,
# Atom, Opteron, ...) is 0, SSE only.
_CORE_TIER = {
    "skylakex": 3,
    "cooperlake": 3,
    "sapphirerapids": 3,
    "haswell": 2,
    "zen": 2,
    "sandybridge": 1,
    "bulldozer": 1,
    "piledriver": 1,
    "steamroller": 1,
    "excavator": 1,
}
# The core to ask for per tier, and the /proc/cpuinfo flags its kernels need (best first).
# On AVX-512 SkylakeX, not Haswell: on an AVX-512 AMD EPYC it ran this course's sgemm shapes
# 1.3-2.5x faster than Haswell, and as fast as OpenBLAS's own pick there (Cooperlake).
_BEST_CORE = [
    (3, "SkylakeX", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})),
    (2, "Haswell", frozenset({"avx2", "fma"})),
    (1, "Sandybridge", frozenset({"avx"})),
]
_TIER_NAME = {3: "AVX-512", 2: "AVX2+FMA", 1: "AVX", 0: "SSE only"}


@dataclass(frozen=True)
class CoreChoice:
    """The ``OPENBLAS_CORETYPE`` to set (None: leave OpenBLAS's own pick) and why."""

    core: str | None
    reason: str


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls use, its kernel, and why."""

    name: str  # "OpenBLAS 0.3.21 ...", "Accelerate" or "reference BLAS"
    path: str | None
    note: str
    core: str | None = None  # the kernel OpenBLAS runs, e.g. "SkylakeX"
    core_reason: str = ""


def choose_core(
    flags: set[str] | frozenset[str], detected: str | None, user_setting: str | None = None
) -> CoreChoice:
    """The kernel to ask OpenBLAS for, from the CPU flags (as /proc/cpuinfo lists them)
    and the core OpenBLAS detects by itself. A user's ``OPENBLAS_CORETYPE`` always wins."""
    best = next(((tier, core) for tier, core, needs in _BEST_CORE if needs <= flags), (0, None))
    if user_setting:
        hint = f" (this CPU could run {best[1]})" if best[0] > _CORE_TIER.get(user_setting.lower(), 0) else ""
        return CoreChoice(None, f"{CORE_ENV}={user_setting} set in the environment: left as is{hint}")
    if detected is None:
        return CoreChoice(None, "OpenBLAS's core could not be read: left as is")
    have = _CORE_TIER.get(detected.lower(), 0)
    if best[0] > have:
        return CoreChoice(
            best[1], f"OpenBLAS picked {detected} ({_TIER_NAME[have]}) on a CPU with {_TIER_NAME[best[0]]}"
        )
    return CoreChoice(None, f"OpenBLAS's own pick, {detected}, suits this CPU")


def sgemm_error(got, want, scale) -> float:
    """Largest error of a float32 product relative to ``scale`` (|A| @ |B| in float64),
    the bound that float32 rounding errors grow with."""
    import numpy as np

    return float(np.max(np.abs(np.asarray(got, np.float64) - want) / np.maximum(scale, 1e-30)))


SGEMM_TOLERANCE = 1e-4  # float32 rounding over K=576 stays below 1e-5; a wrong kernel is O(1)


def _cpu() -> tuple[str, frozenset[str]]:
    """The CPU's model name and flags as Linux reports them."""
    model, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return model, flags


def _probe(path: str) -> None:
    """Subprocess side: load ``path``, check cblas_sgemm against float64, print a JSON verdict."""
    import numpy as np

    lib = ctypes.CDLL(path)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    core = lib.openblas_get_corename().decode()
    rng = np.random.default_rng(0)
    worst = 0.0
    # MLX's shapes (x @ w.T with w stored [out, in]) plus odd ones that hit the kernels' edges
    for m, k, n, trans_b in [(1, 576, 1536, True), (64, 576, 1536, True), (37, 301, 515, False)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
        c = np.zeros((m, n), np.float32)
        ptr = ctypes.c_void_p
        lib.cblas_sgemm(
            101,
            111,
            112 if trans_b else 111,
            m,
            n,
            k,
            ctypes.c_float(1.0),
            ptr(a.ctypes.data),
            k,
            ptr(b.ctypes.data),
            k if trans_b else n,
            ctypes.c_float(0.0),
            ptr(c.ctypes.data),
            n,
        )
        b64 = b.astype(np.float64).T if trans_b else b.astype(np.float64)
        worst = max(worst, sgemm_error(c, a.astype(np.float64) @ b64, np.abs(a) @ np.abs(b64)))
    print(json.dumps({"core": core, "error": worst}))


_PROBE_MAIN = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def probe(path: str, core: str | None, timeout: float = 120) -> dict:
    """Load ``path`` in a fresh process (with ``OPENBLAS_CORETYPE=core`` if given): the core
    OpenBLAS runs and its sgemm error, or ``{"failed": why}`` (a crash, e.g. SIGILL, included)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != CORE_ENV}
    if core:
        env[CORE_ENV] = core
    try:
        # run_path, not `python _blas.py`: that would put batchlab's folder first on sys.path,
        # where trace.py shadows the standard library's module of that name
        run = subprocess.run(
            [sys.executable, "-c", _PROBE_MAIN, __file__, path],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"no answer in {timeout:.0f} s"}
    if run.returncode != 0:
        return {"failed": f"exit {run.returncode}: {run.stderr.strip()[-200:]}"}
    return json.loads(run.stdout.strip().splitlines()[-1])


def verified_choice(path: str, flags: frozenset[str], probe=probe) -> tuple[CoreChoice, str | None]:
    """Choose a core and check it by running it; a core that fails falls back to OpenBLAS's own.
    Returns the choice and the core OpenBLAS picks by itself."""
    own = probe(path, None)
    detected = own.get("core")
    choice = choose_core(flags, detected)
    if choice.core is None:
        return choice, detected
    trial = probe(path, choice.core)
    if "failed" in trial:
        problem = trial["failed"]
    elif trial["core"].lower() != choice.core.lower():
        problem = f"OpenBLAS ran {trial['core']} instead"
    elif not trial["error"] <= SGEMM_TOLERANCE:
        problem = f"sgemm off by {trial['error']:.1e} against float64"
    else:
        return CoreChoice(choice.core, f"{choice.reason}; checked against float64"), detected
    return CoreChoice(
        None, f"{choice.reason}, but {choice.core} failed its check ({problem}): kept {detected}"
    ), detected


def _cache_file() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchlab" / "blas.json"


def _cached_choice(path: str) -> CoreChoice:
    """``verified_choice`` once per library file and CPU; later imports read the cached verdict."""
    model, flags = _cpu()
    stat = os.stat(path)
    key = (
        f"{os.path.realpath(path)} {stat.st_size} {stat.st_mtime_ns} {model} "
        f"flags:{zlib.crc32(' '.join(sorted(flags)).encode()):08x}"
    )
    file = _cache_file()
    try:
        cache = json.loads(file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        entry = cache[key]
        return CoreChoice(entry["core"], f"{entry['reason']} (cached in {file})")
    choice, _ = verified_choice(path, flags)
    cache[key] = {"core": choice.core, "reason": choice.reason}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        scratch = file.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(cache, indent=1))
        os.replace(scratch, file)
    except OSError:
        pass  # a read-only home: check again next time
    return choice


def _find_openblas() -> str | None:
    override = os.environ.get("BATCHLAB_BLAS")
    if override:
        return override if override != "none" else None
    arch = platform.machine()
    for pattern in _CANDIDATES:
        path = pattern.format(arch=arch)
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def _load() -> BlasStatus:
    if sys.platform == "darwin":
        return BlasStatus("Accelerate", None, "macOS: MLX uses Accelerate on CPU and Metal on GPU")
    path = _find_openblas()
    if path is None:
        return BlasStatus(
            "reference BLAS",
            None,
            "no OpenBLAS found: matmuls run ~10x slower; run `bash scripts/setup.sh` "
            "(installs Debian's libopenblas0-pthread) or set BATCHLAB_BLAS=/path/libopenblas.so",
        )
    if "mlx.core" in sys.modules:
        return BlasStatus(
            "reference BLAS",
            path,
            "mlx was imported before batchlab, too late to swap its BLAS: import batchlab first",
        )
    user_setting = os.environ.get(CORE_ENV)
    if user_setting:
        choice = choose_core(_cpu()[1], None, user_setting)
    elif platform.machine() in ("x86_64", "AMD64"):
        choice = _cached_choice(path)
    else:
        choice = CoreChoice(None, "OpenBLAS's own pick (the kernel choice covers x86-64 only)")
    if choice.core:
        os.environ[CORE_ENV] = choice.core
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    name, core = "OpenBLAS", None
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        name = lib.openblas_get_config().decode()
        lib.openblas_get_corename.restype = ctypes.c_char_p
        core = lib.openblas_get_corename().decode()
    except AttributeError:
        pass
    return BlasStatus(name, path, "loaded with RTLD_GLOBAL before mlx", core, choice.reason)


if __name__ == "__main__":
    _probe(sys.argv[-1])
else:
    STATUS = _load()
