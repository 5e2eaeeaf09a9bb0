"""What serving over HTTP costs the engine: the median decode-only step time at each batch
size, for the mixed workload run by the engine alone and through ``batchlab serve`` (in
this process, streamed by ``batchlab.loadgen``), alternating, twice.

    .venv/bin/python benchmarks/server_overhead.py

Every request of the server polls the engine every 5 ms; if that took time from the
engine's thread (the GIL, the lock), the served steps would be slower at the same batch.
(The served requests may stop early at EOS, which the engine-alone run ignores, so compare
steps of the same batch size, not totals.)
"""

from __future__ import annotations

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab import make_engine, metrics, workloads
from batchlab.loadgen import run_loadgen
from batchlab.server import serve_in_thread


def main() -> int:
    lm = batchlab.load_model()
    wl = workloads.mixed(lm.tokenizer)

    def alone():
        trace = workloads.run_workload(make_engine("stallfree", lm, max_batch_size=8), wl,
                                       progress=False)
        return metrics.decode_step_by_batch(trace)

    def served():
        with serve_in_thread(lm, "stallfree", max_batch_size=8, trace_limit=None) as srv:
            run_loadgen(srv.base_url, wl, progress=False)
            return metrics.decode_step_by_batch(srv.engine.trace)

    print("median decode-only step (ms) by batch size")
    for name, run in [("alone", alone), ("served", served)] * 2:
        print(f"{name:<7}", {b: round(s * 1000) for b, s in run().items()}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
