"""Checkers for lesson 6 (the poll interface).

``atomic_poll``  a ``poll`` method that drains tokens and reads status in one locked step;
``stream_text``  a client loop that streams text through the incremental detokenizer;
``cancel``       ``cancel`` semantics: True once, then False; the request's place is freed.

The thread cases are made deterministic where it matters: a *spy lock* stands in for
the learner's lock, counts how often it is taken, and can run "the engine thread" at the
exact moment the client lets go of it, which is when a split poll loses tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ._core import Case, Verdict, answer_compare, run_cases, show

__all__ = ["atomic_poll", "stream_text", "cancel"]


class _SpyLock:
    """A lock that counts acquisitions and can run a hook right after each release."""

    def __init__(self):
        self._lock = threading.Lock()
        self.acquisitions = 0
        self.after_release: Callable[[], None] | None = None
        self._in_hook = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok and not self._in_hook:
            self.acquisitions += 1
        return ok

    def release(self) -> None:
        self._lock.release()
        if self.after_release is not None and not self._in_hook:
            self._in_hook = True
            try:
                self.after_release()
            finally:
                self._in_hook = False

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self):
        self.acquire()
        return True

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------
# Exercise 1: an atomic poll.

def _poll_result(got: Any):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return None, "poll returns two things: (new_tokens, status)"
    tokens, status = got
    if not isinstance(tokens, list):
        return None, f"the new tokens should be a list, not a {type(tokens).__name__}"
    return (list(tokens), status), None


def atomic_poll(cls: Callable) -> Verdict:
    """Check a ``TinyEngine`` class whose ``poll(rid) -> (new_tokens, status)`` hands out
    each token exactly once and reads the status in the same hold of ``self.lock``."""

    def fresh():
        engine = cls()
        if not hasattr(engine, "lock"):
            raise AttributeError("the engine has no self.lock")
        engine.lock = _SpyLock()
        return engine

    def diagnose(result, expected):
        tokens, status = result
        if tokens == expected[0]:
            return f"the tokens are right but the status is {status!r}"
        return ""

    compare = answer_compare(_poll_result, diagnose)

    def seq(*actions):
        """A case that runs ``actions`` on a fresh engine and returns the last poll."""
        def call(f):
            engine = f()
            out = None
            for act in actions:
                out = act(engine)
            return out
        return call

    start = lambda rid: lambda e: e.start(rid)  # noqa: E731
    make = lambda rid, t, last=False: lambda e: e.produce(rid, t, last)  # noqa: E731
    poll = lambda rid: lambda e: e.poll(rid)  # noqa: E731

    def once_locked(f):
        engine = f()
        engine.start("a")
        engine.produce("a", 1)
        engine.lock.acquisitions = 0
        engine.poll("a")
        return engine.lock.acquisitions

    def lock_compare(got, expected):
        if got == expected:
            return None
        if got == 0:
            return ("your poll never takes self.lock: the engine thread can change `pending` or "
                    "`done` while you read them")
        return (f"your poll takes the lock {got} times: the engine can run between two of them "
                f"(next case); read the tokens and the status in ONE `with self.lock:` block")

    def interleaved(f):
        """The engine makes a token every time the client lets go of the lock; the client
        polls until 'done'. Tried for requests of 1 to 6 tokens, so the last token lands at
        every point of a poll."""
        for n in range(1, 7):
            engine = f()
            engine.start("a")
            tokens = iter(range(1, n + 1))

            def engine_step(engine=engine, tokens=tokens, n=n):
                t = next(tokens, None)
                if t is not None:
                    engine.produce("a", t, t == n)
            engine.lock.after_release = engine_step
            got = []
            for _ in range(100):
                result, problem = _poll_result(engine.poll("a"))
                if problem:
                    return problem
                got += result[0]
                if result[1] != "running":
                    break
            if got != list(range(1, n + 1)):
                return n, got
        return "all right"

    def interleave_compare(got, expected):
        if got == expected:
            return None
        if isinstance(got, str):
            return got
        n, received = got
        lost = [t for t in range(1, n + 1) if t not in received]
        if lost:
            return (f"with {n} token(s), the client received {received}: token(s) {lost} were "
                    f"lost. The engine made them and finished between the moment your poll took "
                    f"the tokens and the moment it read the status, so the client saw 'done' "
                    f"without them")
        return f"with {n} token(s), the client received {received}: tokens twice or out of order"

    def threaded(f):
        """One engine thread, four clients polling at once, 400 tokens each."""
        engine = cls()
        rids = [f"r{i}" for i in range(4)]
        for rid in rids:
            engine.start(rid)
        received = {rid: [] for rid in rids}
        errors = []

        def producer():
            for t in range(400):
                for rid in rids:
                    engine.produce(rid, t, t == 399)
                if t % 50 == 0:
                    time.sleep(0.001)

        def client(rid):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    tokens, status = engine.poll(rid)
                except Exception as e:  # report, do not hang
                    errors.append(f"{type(e).__name__}: {e}")
                    return
                received[rid] += list(tokens)
                if status != "running":
                    return
                time.sleep(0)
            errors.append(f"client {rid} never saw 'done'")

        threads = [threading.Thread(target=client, args=(rid,)) for rid in rids]
        threads.append(threading.Thread(target=producer))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            return errors[0]
        bad = {rid: got for rid, got in received.items() if got != list(range(400))}
        return "all right" if not bad else bad

    def threaded_compare(got, expected):
        if got == expected:
            return None
        if isinstance(got, str):
            return got
        rid, tokens = next(iter(got.items()))
        lost = 400 - len(set(tokens))
        dup = len(tokens) - len(set(tokens))
        return f"client {rid} got {len(tokens)} tokens: {lost} lost, {dup} duplicated"

    cases = [
        Case("a request just started, no token made yet: poll says ([], 'running')",
             seq(start("a"), poll("a")), ([], "running"), compare),
        Case("the engine made tokens 7, 8, 9, then one poll: ([7, 8, 9], 'running')",
             seq(start("a"), make("a", 7), make("a", 8), make("a", 9), poll("a")),
             ([7, 8, 9], "running"), compare,
             "hand out every pending token, as a list"),
        Case("a second poll with nothing new in between: ([], 'running'), each token is handed out once",
             seq(start("a"), make("a", 7), make("a", 8), poll("a"), poll("a")),
             ([], "running"), compare,
             "after taking the tokens, leave an empty list in self.pending[rid]"),
        Case("the last token (made with last=True): the poll returns it AND 'done'",
             seq(start("a"), make("a", 7), poll("a"), make("a", 8, True), poll("a")),
             ([8], "done"), compare),
        Case("another request's tokens are not yours: b's poll sees only b's token",
             seq(start("a"), start("b"), make("a", 1), make("b", 2), poll("b")),
             ([2], "running"), compare),
        Case("an id the engine never started: ([], 'unknown')",
             seq(start("a"), poll("zzz")), ([], "unknown"), compare,
             "check `rid in self.pending` first"),
        Case("one poll takes self.lock exactly once", once_locked, 1, lock_compare),
        Case("a forced interleaving: the engine makes a token each time your poll lets go of "
             "the lock; a client polling until 'done' must receive every token (requests of 1 "
             "to 6 tokens)", interleaved, "all right", interleave_compare,
             "take the tokens and read the status under one hold of the lock"),
        Case("real threads: an engine thread making 400 tokens for each of 4 requests while 4 "
             "client threads poll: every client gets 0..399, none lost, none twice",
             threaded, "all right", threaded_compare),
    ]
    return run_cases("atomic_poll", lambda: fresh(), cases) if callable(cls) \
        else run_cases("atomic_poll", cls, cases)


# ---------------------------------------------------------------------------------------
# Exercise 2: streaming text.

def _scripted(fn, tokenizer, script, rid="req-0"):
    """Run the learner's generator on a scripted poll; note when each piece came out."""
    calls: list[str] = []

    def poll(r):
        calls.append(r)
        i = len(calls) - 1
        if r == rid and i < len(script):
            return script[i]
        return [], "unknown", None

    pieces, at = [], []
    for piece in fn(poll, rid, tokenizer.detokenizer()):
        pieces.append(piece)
        at.append(len(calls))
        if len(calls) > len(script) + 50:
            break
    return {"pieces": pieces, "at": at, "polls": len(calls)}


def stream_text(fn: Callable, lm) -> Verdict:
    """Check ``fn(poll, rid, detokenizer)``: a generator that polls ``rid`` until its status
    is no longer "running", feeds every new token to ``detokenizer.add`` and yields each
    non-empty piece of text at once, and at the end yields what ``detokenizer.flush()``
    returns."""
    tok = lm.tokenizer

    def expect(script):
        ids = [t for tokens, _, _ in script for t in tokens]
        return {"text": tok.decode(ids), "polls": len(script)}

    def compare_for(script, streaming=False):
        def compare(got, expected):
            pieces = got["pieces"]
            if not all(isinstance(p, str) for p in pieces):
                return "yield pieces of text (str), not token ids"
            text = "".join(pieces)
            if got["polls"] > expected["polls"]:
                return ("you polled again after the status stopped being 'running': stop "
                        "polling once it is 'done' (or 'unknown')")
            if got["polls"] < expected["polls"]:
                return "you stopped polling while the status was still 'running'"
            if "\ufffd" not in expected["text"] and any("\ufffd" in p for p in pieces):
                return ("a piece contains '\\ufffd' (the replacement character): feed tokens to "
                        "detokenizer.add() and yield what it returns, not tokenizer.decode([t])")
            if text != expected["text"]:
                last_poll = script[-1][0]
                before = tok.decode([t for tokens, _, _ in script[:-1] for t in tokens])
                if last_poll and text in (before, before.rstrip("\ufffd")):
                    return ("the tokens that came in the same poll as the final status are "
                            "missing: handle a poll's tokens before you look at its status")
                if expected["text"].startswith(text):
                    return (f"the text stops short: {expected['text'][len(text):]!r} is missing "
                            f"(call detokenizer.flush() when the stream ends and yield the rest)")
                return ""
            if streaming and got["at"] and got["at"][0] >= expected["polls"]:
                return ("the first piece came out only after the last poll: yield each piece as "
                        "soon as you have it, so the user sees text while it is made")
            return None
        return compare

    def show_stream(value):
        if "pieces" in value:
            return f"pieces {show(value['pieces'])} after {value['polls']} polls"
        return f"text {value['text']!r} after {value['polls']} polls"

    def case(label, script, hint="", streaming=False):
        return Case(label, lambda f: _scripted(f, tok, script), expect(script),
                    compare_for(script, streaming), hint, show_stream)

    def one_per_poll(ids, done="done", reason="stop"):
        return [([t], "running", None) for t in ids[:-1]] + [([ids[-1]], done, reason)]

    answer = tok.encode(" The capital of France is Paris.")
    emoji = tok.encode("I love 🍕 and ☕.")
    cut = tok.encode("I love 🍕")[:-1]  # the stream ends inside the emoji
    cases = [
        case("' The capital of France is Paris.' one token per poll",
             one_per_poll(answer)),
        case("the same, checked for streaming: the first piece must come out before the last poll",
             one_per_poll(answer), "yield inside the loop, right after each add()", streaming=True),
        case("'I love 🍕 and ☕.': each emoji is 3 tokens, arriving in 3 separate polls",
             one_per_poll(emoji),
             "a token can end in the middle of a character; the detokenizer holds it back"),
        case("the last 4 tokens come in the same poll as 'done': show them too",
             [(answer[:3], "running", None), (answer[3:], "done", "stop")],
             "handle the tokens of a poll before you look at its status"),
        case("polls that return nothing for a while (the engine is busy with others): keep polling",
             [([], "running", None)] * 3 + [(answer[:2], "running", None), ([], "running", None),
                                            (answer[2:], "done", "length")]),
        case("the stream is cut inside an emoji (max_new_tokens reached): flush() hands out what "
             "was held back", [(cut, "done", "length")],
             "after the loop, yield detokenizer.flush() if it is not empty"),
        case("an unknown request id: stop after one poll, no text",
             [([], "unknown", None)]),
    ]

    def real(f):
        from ..engine import make_engine
        from ..loop import EngineLoop

        ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        loop = EngineLoop(make_engine("stallfree", lm, max_batch_size=2, token_budget=64,
                                      num_kv_blocks=16))
        seen: list[int] = []

        def poll(rid):
            tokens, status, reason = loop.poll(rid)
            seen.extend(tokens)
            return tokens, status, reason

        with loop:
            rid = loop.submit(ids, max_new_tokens=16)
            pieces = []
            deadline = time.monotonic() + 120
            for piece in f(poll, rid, tok.detokenizer()):
                pieces.append(piece)
                if time.monotonic() > deadline:
                    break
        return "".join(pieces), tok.decode(seen)

    def real_compare(got, expected):
        text, truth = got
        if text == truth == expected:
            return None
        if text != truth:
            return f"the engine made {truth!r}, your stream showed {text!r}"
        return ""

    if lm is not None:
        cases.append(Case("the real model on an EngineLoop: the France question streamed to the end",
                          real, "The capital of France is Paris.<|im_end|>", real_compare,
                          show=lambda v: repr(v[0]) if isinstance(v, tuple) else repr(v)))
    return run_cases("stream_text", fn, cases)


# ---------------------------------------------------------------------------------------
# Exercise 3: cancel.

def cancel(cls: Callable) -> Verdict:
    """Check a ``SlotTable`` class whose ``cancel(rid)`` stops a queued or decoding request
    and returns True, frees its place (the next queued request takes a freed slot), and
    returns False for a request already finished or cancelled, or unknown."""

    def table(num_slots, *rids):
        t = cls(num_slots)
        t.lock = _SpyLock()
        for rid in rids:
            t.submit(rid)
        return t

    def view(t):
        return {"slots": list(t.slots), "queue": list(t.queue), "state": dict(t.state)}

    def compare(got, expected):
        if got == expected:
            return None
        result, after = got
        if result != expected[0]:
            if not isinstance(result, bool):
                return f"cancel returns True or False, not {show(result)}"
            return ("cancel should return True only when this call stopped a queued or decoding "
                    "request" if expected[0] else
                    "this request was not running any more, so cancel must return False")
        want = expected[1]
        if after["state"] != want["state"]:
            return f"the states after cancel should be {want['state']}"
        if after["queue"] != want["queue"]:
            return "the queue is wrong: a cancelled request leaves the queue"
        if after["slots"] != want["slots"]:
            return ("the slots are wrong: a cancelled request gives back its slot, and the next "
                    "queued request takes it (call self._fill())")
        return ""

    def run(setup, *actions):
        def call(f):
            t = setup(f)
            result = None
            for act in actions:
                result = act(t)
            return result, view(t)
        return call

    def state(slots, queue, **states):
        return {"slots": slots, "queue": queue, "state": states}

    c = lambda rid: lambda t: t.cancel(rid)  # noqa: E731
    fin = lambda rid: lambda t: t.finish(rid)  # noqa: E731

    def locked(f):
        t = table(2, "a")
        t.lock.acquisitions = 0
        t.cancel("a")
        return t.lock.acquisitions

    def race(f):
        t = f(2)
        t.submit("a")
        barrier = threading.Barrier(8)
        results = []

        def worker():
            barrier.wait()
            results.append(t.cancel("a"))
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return sorted(results)

    cases = [
        Case("cancel a decoding request (a holds slot 0): True, a is 'cancelled', slot 0 is empty",
             run(lambda f: table(2, "a", "b"), c("a")),
             (True, state([None, "b"], [], a="cancelled", b="decoding")), compare),
        Case("cancel it again: False (it was already cancelled), nothing changes",
             run(lambda f: table(2, "a", "b"), c("a"), c("a")),
             (False, state([None, "b"], [], a="cancelled", b="decoding")), compare,
             "only a queued or decoding request can be cancelled"),
        Case("cancel a queued request (2 slots, c waits): True, c leaves the queue, slots unchanged",
             run(lambda f: table(2, "a", "b", "c"), c("c")),
             (True, state(["a", "b"], [], a="decoding", b="decoding", c="cancelled")), compare),
        Case("cancel a decoding request while c waits: c takes the freed slot at once",
             run(lambda f: table(2, "a", "b", "c"), c("a")),
             (True, state(["c", "b"], [], a="cancelled", b="decoding", c="decoding")), compare,
             "after freeing the slot, call self._fill()"),
        Case("a finished request: False, it stays 'finished'",
             run(lambda f: table(2, "a"), fin("a"), c("a")),
             (False, state([None, None], [], a="finished")), compare),
        Case("an id nobody submitted: False, nothing changes",
             run(lambda f: table(1, "a"), c("nobody")),
             (False, state(["a"], [], a="decoding")), compare,
             "self.state.get(rid) is None for an unknown id"),
        Case("cancel holds self.lock while it looks and changes things", locked, 1,
             lambda got, exp: None if got >= 1 else
             "cancel never takes self.lock: two threads could both see 'decoding' and both return True"),
        Case("8 threads cancel the same request at the same moment: exactly one gets True",
             race, [False] * 7 + [True],
             lambda got, exp: None if got == exp else
             f"{got.count(True)} threads got True: checking and changing the state must happen "
             f"under one hold of the lock"),
    ]
    return run_cases("cancel", cls, cases)
