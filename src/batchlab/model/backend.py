"""Which path the model runs: the one switch every platform branch reads.

MLX runs on one of two kinds of device, and the runner takes a different path on each:
- **the GPU path** (Metal on a Mac; CUDA where MLX has it): MLX's own layers, attention in
  ``mx.fast.scaled_dot_product_attention``, float16 weights, sampling on MLX arrays;
- **the CPU path** (Linux): a numpy Llama around MLX's OpenBLAS matrix multiplies, in
  float32 (``model_runner``).

``gpu_path()`` is that choice, and every branch that differs between the two reads it, and
nothing else. ``BATCHLAB_GPU_PATH=1`` takes the GPU path on MLX's CPU backend: the same
Python and MLX calls a Mac runs (MLX's CPU backend runs ``mx.fast`` too), in float16 unless
``BATCHLAB_DTYPE`` says otherwise. That is how this code is tested where there is no Mac,
and it is slow: MLX's CPU kernels are not built for it.
"""

from __future__ import annotations

import os

import mlx.core as mx

GPU_PATH_ENV = "BATCHLAB_GPU_PATH"


def device() -> str:
    """ "gpu" when MLX's default device is the GPU (Metal, or CUDA), else "cpu"."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def forced() -> bool:
    """True when ``BATCHLAB_GPU_PATH`` asks for the GPU path (on any device)."""
    value = os.environ.get(GPU_PATH_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{GPU_PATH_ENV} must be 1 (take the GPU path) or 0, got {value!r}")
    return value == "1"


def gpu_path() -> bool:
    """True when the runner takes the GPU path: on a GPU, or forced by ``BATCHLAB_GPU_PATH=1``."""
    return device() == "gpu" or forced()


def describe() -> str:
    """One line for ``batchlab info``: which path runs and why."""
    if device() == "gpu":
        return "gpu path: MLX's own layers, mx.fast attention, float16 (the default device is the GPU)"
    if forced():
        return (
            f"gpu path on the CPU ({GPU_PATH_ENV}=1): MLX's own layers, mx.fast attention, "
            "float16 unless BATCHLAB_DTYPE says otherwise: the code a Mac runs, slowly"
        )
    return "cpu path: numpy around MLX's OpenBLAS matrix multiplies, float32"
