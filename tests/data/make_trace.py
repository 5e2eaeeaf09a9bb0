"""Record the trace that the widget demo notebook replays: a real continuous-batching run.

Run from the repository root: ``.venv/bin/python tests/data/make_trace.py``. A recorded
trace keeps the browser test fast (no model load in the notebook's kernel).
"""

from pathlib import Path

import batchlab

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2+2?",
             "Write a haiku about the sea.", "Who wrote Hamlet?", "Why is the sky blue?"]
MAX_NEW_TOKENS = [6, 12, 4, 16, 8, 10]

if __name__ == "__main__":
    lm = batchlab.load_model()
    engine = batchlab.make_engine("continuous", lm, max_batch_size=3, prefill_step=16)
    for question, max_new in zip(QUESTIONS, MAX_NEW_TOKENS):
        engine.submit(lm.tokenizer.encode_chat([{"role": "user", "content": question}]),
                      max_new_tokens=max_new)
    engine.run_until_idle()
    Path(__file__).with_name("continuous_trace.json").write_text(engine.trace.to_json() + "\n")
