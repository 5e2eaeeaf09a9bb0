"""``batchlab demo``: watch continuous batching live in a terminal.

Each line is one engine step. Every request gets a letter; a slot shows the letter of
the request in it (capital: decoding, small: its prompt is being prefilled), or "."
when idle. Requests arrive a few at a time, so you see slots empty and refill.
"""

from __future__ import annotations

import string
import sys

from .engine import make_engine
from .model import load_model

QUESTIONS = [
    ("What is the capital of France?", 24), ("Write a haiku about the sea.", 40),
    ("Name three primary colours.", 20), ("Explain what a CPU does in one sentence.", 48),
    ("Say hello in Spanish.", 8), ("What is 12 times 12?", 16),
    ("Give me a tip for learning to cook.", 56), ("Why is the sky blue? Be brief.", 40),
    ("Suggest a name for a cat.", 12), ("What does a compiler do?", 48),
    ("List two planets.", 16), ("How many legs does a spider have?", 12),
]


def run_demo(kind: str, model: str | None, requests: int = 10, **options) -> int:
    if not 1 <= requests <= len(string.ascii_uppercase):
        raise ValueError(f"--requests must be between 1 and {len(string.ascii_uppercase)}")
    print("loading the model ...", flush=True)
    lm = load_model(model)
    options.setdefault("max_batch_size", 4)
    engine = make_engine(kind, lm, **options)
    work = [QUESTIONS[i % len(QUESTIONS)] for i in range(requests)]
    letters: dict[str, str] = {}
    print(f"{kind} engine, {engine.scheduler.max_batch_size} slots; "
          f"capital = decoding, small = prefilling, . = idle\n")
    step = 0
    while True:
        if work and step % 3 == 0:  # two new requests every third step
            for question, max_new in work[:2]:
                rid = engine.submit(lm.tokenizer.encode_chat([{"role": "user", "content": question}]),
                                    max_new_tokens=max_new)
                letters[rid] = string.ascii_uppercase[len(letters)]
            del work[:2]
        if not engine.step():
            if not work:
                break
            step += 1
            continue
        record = engine.trace.steps[-1]
        cells = []
        for rid in record.slots:
            if rid is None:
                cells.append(".")
            else:
                prefilling = any(p[0] == rid for p in record.prefill) and rid not in record.decoded
                cells.append(letters[rid].lower() if prefilling else letters[rid])
        print(f"step {record.index:3d}  [{' '.join(cells)}]  queue {record.queued:2d}  "
              f"{1000 * record.duration_s:5.0f} ms", flush=True)
        for rid in record.finished:
            tokens, _, reason = engine.poll(rid)
            text = " ".join(lm.tokenizer.decode(engine.trace.requests[rid].output_ids,
                                                skip_special_tokens=True).split())
            print(f"          {letters[rid]} done ({reason}, {len(engine.trace.requests[rid].output_ids)} "
                  f"tokens): {text[:90]}", flush=True)
        step += 1
    stats = engine.stats()
    print(f"\n{stats['output_tokens']} tokens in {stats['elapsed_s']:.1f} s = "
          f"{stats['output_tokens_per_s']:.1f} tokens/s; slots busy "
          f"{100 * stats['slot_occupancy']:.0f}% of decode steps", file=sys.stdout)
    return 0
