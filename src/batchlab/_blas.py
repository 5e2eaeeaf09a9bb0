"""Make MLX's CPU backend use an optimized BLAS on Linux.

The Linux ``mlx[cpu]`` wheel links the reference BLAS (a few GFLOP/s). Loading an
optimized library that exports ``cblas_sgemm`` with ``RTLD_GLOBAL`` *before*
``mlx.core`` is imported makes the dynamic linker bind MLX's matmuls to it, which
is about 5-30x faster here. ``import batchlab`` does this first, so learners do
nothing. On macOS MLX uses Accelerate and Metal, and this module does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass

# Debian/Ubuntu paths of OpenBLAS (the pthread build first: it uses every core).
_CANDIDATES = [
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
]


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU matmuls use, and why."""

    name: str  # "OpenBLAS 0.3.21 ...", "Accelerate" or "reference BLAS"
    path: str | None
    note: str


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
            "reference BLAS", None,
            "no OpenBLAS found: matmuls run ~10x slower; run `bash scripts/setup.sh` "
            "(installs Debian's libopenblas0-pthread) or set BATCHLAB_BLAS=/path/libopenblas.so",
        )
    if "mlx.core" in sys.modules:
        return BlasStatus(
            "reference BLAS", path,
            "mlx was imported before batchlab, too late to swap its BLAS: import batchlab first",
        )
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    name = "OpenBLAS"
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        name = lib.openblas_get_config().decode()
    except AttributeError:
        pass
    return BlasStatus(name, path, "loaded with RTLD_GLOBAL before mlx")


STATUS = _load()
