"""What serving over HTTP costs the engine: the median decode step time of 8 requests
decoding together, behind the server (streamed over HTTP from this process, with 16 more
streams open and waiting in the queue) ÷ the same 8 requests on the engine alone.
Alternating, three times each, in one process.

    .venv/bin/python benchmarks/server_overhead.py

Every open stream waits for the engine's next step and then polls it; if that took time
from the engine's thread (the GIL, the engine's lock), the served steps would be slower.
Only decode-only steps in which exactly the 8 measured requests ran are compared, so the
waiting streams (admitted once the 8 finish) and early stops at EOS do not count.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import httpx

import batchlab  # first: makes MLX use OpenBLAS on Linux
from batchlab import make_engine
from batchlab.serving.launch import serve_in_thread

ACTIVE, IDLE, MAX_NEW = 8, 16, 64
QUESTIONS = [
    "Write a long story about a dragon.",
    "Explain how a bicycle works, in detail.",
    "Describe a day in the life of a baker.",
    "Write a long poem about the sea.",
    "Tell me everything about the planet Mars.",
    "Write a letter to a friend abroad.",
    "Explain how bread is made, step by step.",
    "Describe your favourite city at night.",
]
MEASURED = {f"req-{i}" for i in range(ACTIVE)}  # the engine's ids of the first 8 requests


def median_step_ms(trace) -> float:
    steps = [
        s.duration_s
        for s in trace.steps
        if not s.prefill and len(s.decoded) == ACTIVE and set(s.decoded) == MEASURED
    ]
    return 1000 * statistics.median(steps)


def alone(lm) -> float:
    engine = make_engine("stallfree", lm, max_batch_size=ACTIVE)
    for q in QUESTIONS:
        engine.submit(
            lm.tokenizer.encode_chat([{"role": "user", "content": q}]),
            max_new_tokens=MAX_NEW,
            ignore_eos=True,
        )
    engine.run_until_idle()
    return median_step_ms(engine.trace)


def served(lm) -> float:
    with serve_in_thread(lm, "stallfree", max_batch_size=ACTIVE, trace_limit=None) as srv:
        measured_done = threading.Event()

        def stream(question: str, priority: int, until: threading.Event | None) -> None:
            body = {
                "messages": [{"role": "user", "content": question}],
                "max_tokens": MAX_NEW,
                "temperature": 0,
                "stream": True,
                "priority": priority,
            }
            with httpx.Client(timeout=300) as http:
                with http.stream("POST", srv.base_url + "/v1/chat/completions", json=body) as r:
                    if until is not None:  # a waiting stream: open until the measured ones end
                        until.wait()
                        return
                    for _ in r.iter_lines():
                        pass

        active = [threading.Thread(target=stream, args=(q, 0, None)) for q in QUESTIONS]
        for t in active:
            t.start()
        while sum(s is not None for s in srv.engine.scheduler.slots) < ACTIVE:
            time.sleep(0.005)
        idle = [threading.Thread(target=stream, args=(QUESTIONS[0], 1, measured_done)) for _ in range(IDLE)]
        for t in idle:
            t.start()
        for t in active:
            t.join()
        measured_done.set()
        for t in idle:
            t.join()
        return median_step_ms(srv.engine.trace)


def main() -> int:
    lm = batchlab.load_model()
    print(f"median decode step (ms) of {ACTIVE} requests; served: {IDLE} more streams waiting")
    ratios = []
    for _ in range(3):
        a, s = alone(lm), served(lm)
        ratios.append(s / a)
        print(f"alone {a:6.1f}   served {s:6.1f}   served/alone {s / a:.3f}", flush=True)
    print(
        f"median served/alone: {statistics.median(ratios):.3f}  "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
