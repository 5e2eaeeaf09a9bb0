"""Record the traces the viz tests and the widget demo notebook replay: one small real run
per batching kind, on the same six questions.

Run from the repository root: ``.venv/bin/python tests/data/make_trace.py``. Recorded
traces keep those tests fast (no model load) while still being real engine output.
"""

from pathlib import Path

import batchlab

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours.",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Who wrote Hamlet?",
    "Why is the sky blue?",
]
MAX_NEW_TOKENS = [6, 12, 4, 16, 8, 10]
ENGINES = {
    "static": {"max_batch_size": 3},
    "continuous": {"max_batch_size": 3, "prefill_step": 16},
    "stallfree": {"max_batch_size": 3, "token_budget": 24},
}

if __name__ == "__main__":
    lm = batchlab.load_model()
    for kind, options in ENGINES.items():
        engine = batchlab.make_engine(kind, lm, **options)
        for question, max_new in zip(QUESTIONS, MAX_NEW_TOKENS):
            engine.submit(
                lm.tokenizer.encode_chat([{"role": "user", "content": question}]), max_new_tokens=max_new
            )
        engine.run_until_idle()
        Path(__file__).with_name(f"{kind}_trace.json").write_text(engine.trace.to_json() + "\n")
