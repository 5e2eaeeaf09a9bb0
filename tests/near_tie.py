"""The one near-tie rule of the real-model tests: where an engine's greedy answer parts from
an independent reference's, the engine's token must be the reference's runner-up (or tied
with it) and within ``near_tie`` of its best logit; the rest of the answer must then be the
reference's continuation from the engine's own token. A few such partings are allowed, each
printed; anything else is a wrong answer.

The reference is ``batchlab.generate`` on ``ref_lm``: mlx-lm's model and KV cache, one request
alone, checked against Hugging Face and mlx-lm's own generation in ``test_model.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from batchlab import generate

NEAR_TIE_F32 = 2e-3  # float32 on the CPU: reordered sums move logits by ~1e-5, real differences by >0.1
NEAR_TIE_F16 = 0.1  # float16 weights move SmolLM2's logits by ~0.01-0.05 (test_gpu_path.py)


def near_tie_for(lm) -> float:
    return NEAR_TIE_F16 if lm.info.dtype == "float16" else NEAR_TIE_F32


def parting_problem(
    ref_lm, prompt: list[int], ours: list[int], n: int, near_tie: float, ignore_eos=False, max_partings=2
) -> str | None:
    """None if ``ours`` (at most ``n`` greedy tokens after ``prompt``) is the reference's
    answer up to near-ties, else what is wrong, in words."""
    done: list[int] = []
    for _ in range(max_partings + 1):
        ref = generate(ref_lm, prompt + done, n - len(done), ignore_eos=ignore_eos).token_ids
        rest = ours[len(done) :]
        k = next((i for i, (a, b) in enumerate(zip(ref, rest)) if a != b), None)
        if k is None:
            if len(rest) == len(ref):
                return None
            return f"{len(ours)} tokens where the reference continues to {len(done) + len(ref)}"
        at = len(done) + k
        logits = np.array(ref_lm.model(mx.array([prompt + ours[:at]]))[0, -1].astype(mx.float32))
        runner_up = float(np.sort(logits)[-2])
        margin = float(logits[ref[k]] - logits[rest[k]])
        print(f"parts at token {at}: the reference's margin {margin:.2e}")
        if logits[rest[k]] < runner_up:
            return f"token {at} is {rest[k]}, not the reference's runner-up (its best is {ref[k]})"
        if margin >= near_tie:
            return f"token {at} is {rest[k]} where the reference's {ref[k]} led by {margin:.3g}: no near-tie"
        done = ours[: at + 1]
    return f"more than {max_partings} partings from the reference"
