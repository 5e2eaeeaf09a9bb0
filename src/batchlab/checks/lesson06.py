"""Checkers for lesson 6 (the poll interface): ``engine_front`` (the learner's ``MyEngine(Engine)``:
``poll`` drains the new tokens and reads the status in one locked step, ``cancel`` is True once and
freed by the next step) on a fake-model engine and an ``EngineLoop`` with threads; ``stream_text``
(a client loop streaming text through the incremental detokenizer).

The thread cases are deterministic where it matters: the engine is built with a *spy lock*
(``make_engine(..., lock=spy)``) that counts how often it is taken and can run "the engine
thread" at the exact moment the client lets go of it, which is when a split poll loses tokens.
Everything else is read from public behaviour: poll and cancel results, the trace, ``stats()``
and the scheduler's ``kv_usage()``."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..engine import Engine, make_engine
from ..fake import FakeModel, FakeRunner, reference_output
from ._core import Case, Verdict, answer_compare, run_cases, show
from ._pieces import piece_case

__all__ = ["engine_front", "stream_text"]


class _SpyLock:
    """A lock that counts acquisitions and can run a hook right after each release. A
    thread taking it twice (it is not re-entrant) gets an error instead of a hang."""

    def __init__(self):
        self._lock, self._owner, self._in_hook = threading.Lock(), None, False
        self.acquisitions, self.after_release = 0, None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and self._owner == threading.get_ident():
            raise RuntimeError(
                "self._lock is taken twice by the same thread: it is not "
                "re-entrant, so a `with self._lock:` inside another one (or "
                "inside a method that takes it) waits forever"
            )
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self._owner = threading.get_ident()
            self.acquisitions += not self._in_hook
        return ok

    def release(self) -> None:
        self._owner = None
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
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


_PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8], "c": [1, 4, 1, 4, 2, 1], "d": [5, 9, 2]}
_BLOCKS = 16


def _front(cls, slots=1, runner=FakeRunner, lock=None):
    """A fake-model stall-free engine built as ``cls``, with a spy lock."""
    return make_engine(
        "stallfree",
        FakeModel(),
        runner=runner,
        engine_class=cls,
        max_batch_size=slots,
        token_budget=8,
        num_kv_blocks=_BLOCKS,
        kv_block_size=4,
        lock=lock or _SpyLock(),
    )


def _right(rid, new):
    return reference_output(_PROMPTS[rid], new, FakeModel().vocab_size, frozenset())


def _submit(engine, rid, new=6):
    return engine.submit(_PROMPTS[rid], max_new_tokens=new, ignore_eos=True, request_id=rid)


def _steps(engine, n):
    for _ in range(n):
        engine.step()


def _free_blocks(engine) -> int:
    return engine.stats()["free_kv_blocks"]


def _poll_triple(got):
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return None, "poll returns three things: (new_tokens, status, finish_reason)"
    if not isinstance(got[0], list):
        return None, f"the new tokens should be a list, not a {type(got[0]).__name__}"
    return (list(got[0]), got[1], got[2]), None


def _diagnose_poll(got, expected):
    tokens, status, reason = got
    if tokens == expected[0] and status == expected[1]:
        return f"the tokens and status are right but the finish reason is {reason!r}"
    return f"the tokens are right but the status is {status!r}" if tokens == expected[0] else ""


def poll_case(label, actions, hint="", slots=1):
    """``actions(engine)`` (ending with a poll) on the learner's class; the library's Engine answers."""

    def call(f):
        return actions(_front(f, slots))

    return Case(label, call, call(Engine), answer_compare(_poll_triple, _diagnose_poll), hint)


def once_locked(f):
    spy = _SpyLock()
    engine = _front(f, lock=spy)
    _submit(engine, "a")
    _steps(engine, 2)
    spy.acquisitions = 0
    engine.poll("a")
    if spy.acquisitions == 0:
        return "your poll never takes self._lock: the engine thread can change the request while you read it"
    if spy.acquisitions > 1:
        return (
            f"your poll takes self._lock {spy.acquisitions} times: the engine can run a step between two "
            f"of them (next case); drain the tokens and read the status in ONE `with self._lock:` block"
        )
    return None


def interleaved(f):
    """The engine runs a step every time the client lets go of the lock; the client polls until
    'done'. Requests of 1 to 6 tokens, so the last token lands at every point of a poll."""
    for n in range(1, 7):
        spy = _SpyLock()
        engine = _front(f, lock=spy)
        _submit(engine, "a", n)
        spy.after_release = engine.step
        got = []
        for _ in range(60):
            result, problem = _poll_triple(engine.poll("a"))
            if problem:
                return problem
            got += result[0]
            if result[1] != "running":
                break
        if got != _right("a", n) and len(got) < n:
            return (
                f"with {n} token(s) to make, the client received {got}, {n - len(got)} short: a step "
                f"made the last token(s) and finished the request between your drain and your status "
                f"read, so the client saw 'done' without them"
            )
        if got != _right("a", n):
            return f"with {n} token(s), the client received {got}: tokens twice or out of order"
    return None


def threaded(f):
    """An EngineLoop on the fake model; 6 client threads, 5 requests each, polling every millisecond."""
    from ..loop import EngineLoop

    errors, wrong = [], []
    with EngineLoop(_front(f, 4)) as loop:

        def client(c):
            for j in range(5):
                prompt = [1 + (7 * c + j) % 60, 2, 3]
                rid = loop.submit(prompt, max_new_tokens=8, ignore_eos=True, request_id=f"c{c}-{j}")
                got, deadline = [], time.monotonic() + 20
                while time.monotonic() < deadline:
                    try:
                        tokens, status, _ = loop.poll(rid)
                    except Exception as e:  # report, never hang
                        return errors.append(f"{type(e).__name__}: {e}")
                    got += tokens
                    if status != "running":
                        break
                    time.sleep(0.001)
                else:
                    return errors.append(f"client {c} never saw 'done' for {rid}")
                if got != reference_output(prompt, 8, FakeModel().vocab_size, frozenset()):
                    wrong.append((rid, len(got)))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if loop.error is not None:
        return f"the engine thread died: {type(loop.error).__name__}: {loop.error}"
    if errors or not wrong:
        return errors[0] if errors else None
    return (
        f"{len(wrong)} of 30 requests came out wrong, e.g. {wrong[0][0]}: {wrong[0][1]} tokens received "
        f"of 8 (tokens lost or handed out twice between a drain and a status read)"
    )


def cancel_running(f):
    """a decodes in the only slot, b waits; cancel a; one more step."""
    engine = _front(f)
    _submit(engine, "a", 50)
    _submit(engine, "b", 3)
    _steps(engine, 3)
    made = list(engine.trace.requests["a"].output_ids)
    first, second, polled = engine.cancel("a"), engine.cancel("a"), engine.poll("a")
    if not isinstance(first, bool) or not isinstance(second, bool):
        return f"cancel returns True or False, not {show(first)} / {show(second)}"
    if first is not True:
        return "cancel of a decoding request must return True: this call stopped it"
    if second is not False:
        return (
            "the second cancel returned True: only the call that stopped the request "
            "returns True; a request already finished (cancelled) gives False"
        )
    if tuple(polled) != (made, "done", "cancelled"):
        return (
            f"after cancel, poll should hand out the tokens made so far with 'done' and "
            f"'cancelled': expected {show((made, 'done', 'cancelled'))}, got {show(polled)} (finish "
            f"the request with self._finish(req, 'cancelled'))"
        )
    engine.step()
    if list(engine.trace.steps[-1].slots) != ["b"]:
        return (
            "after the next step the cancelled request's slot should hold b: put the "
            "request on self._cancelled, so the next step's sweep frees its slot"
        )
    engine.run_until_idle()
    if tuple(engine.poll("b")) != (_right("b", 3), "done", "length"):
        return f"b, served after the cancel, should finish with {show((_right('b', 3), 'done', 'length'))}"
    return _blocks_back(engine)


def _blocks_back(engine):
    lost = _BLOCKS - engine.stats()["free_kv_blocks"]
    return (
        (
            f"{lost} KV block(s) never came back: a cancelled request's blocks are freed by the next "
            f"step's sweep"
        )
        if lost
        else None
    )


def cancel_queued(f):
    """a decodes, b is still queued: cancel b; it must never run."""
    engine = _front(f)
    _submit(engine, "a", 4)
    _submit(engine, "b", 4)
    engine.step()
    said, polled = engine.cancel("b"), engine.poll("b")
    engine.run_until_idle()
    if said is not True:
        return "cancel of a queued request must return True: it was waiting to run"
    if tuple(polled) != ([], "done", "cancelled"):
        return f"poll after cancelling a queued request: expected {show(([], 'done', 'cancelled'))}"
    if any("b" in s.decoded or any(p[0] == "b" for p in s.prefill) for s in engine.trace.steps):
        return "b ran after it was cancelled: a cancelled request must never be scheduled"
    if tuple(engine.poll("a")) != (_right("a", 4), "done", "length"):
        return "a, the other request, should still finish normally"
    return None


def cancel_done(f):
    engine = _front(f)
    _submit(engine, "a", 3)
    engine.run_until_idle()
    got = [engine.cancel("a")]  # finished, "done" not yet polled
    engine.poll("a")
    got += [engine.cancel("a"), engine.cancel("zzz")]
    for said, what in zip(
        got,
        [
            "a finished request (not polled yet)",
            "a request already reported done",
            "an id the engine never had",
        ],
    ):
        if said is not False:
            return f"cancel of {what} must return False (nothing was running), got {show(said)}"
    return None


def cancel_mid_pass(f):
    """The client cancels a while a forward pass that computes it runs (the engine's lock is
    free then): a's KV blocks must stay held until the pass ends."""
    seen = {}

    class CancellingRunner(FakeRunner):
        def run(self, chunks):
            if seen.get("armed") and any(c.req_id == "a" for c in chunks):
                seen.update(
                    armed=False,
                    said=engine.cancel("a"),
                    held=bool(engine.scheduler.kv_usage()["block_tables"].get("a")),
                )
            return super().run(chunks)

    engine = _front(f, 2, runner=CancellingRunner)
    _submit(engine, "a", 20)
    _submit(engine, "b", 6)
    _steps(engine, 3)
    seen["armed"] = True
    engine.run_until_idle()
    if seen.get("said") is not True:
        return "cancel of a request in the middle of a pass must return True"
    if not seen["held"]:
        return (
            "your cancel freed the request's slot or KV blocks while a forward pass was still computing "
            "it (the runner writes into those blocks; another request could be given them): only mark it "
            "cancelled and put it on self._cancelled; the next step's sweep frees it"
        )
    if tuple(engine.poll("b")) != (_right("b", 6), "done", "length"):
        return f"b should still finish normally: expected {show((_right('b', 6), 'done', 'length'))}"
    return _blocks_back(engine)


def engine_front(cls: Any) -> Verdict:
    """Check ``MyEngine``, an ``Engine`` subclass with its own ``poll(rid) -> (new_tokens, status,
    finish_reason)`` (drain and status in ONE hold of ``self._lock``; forget a request once "done"
    is reported; "unknown" for ids it does not know) and ``cancel(rid)`` (True only if this call
    stopped a running request; its slot and blocks are freed by the next step's sweep, never
    during a pass): single steps, a forced interleaving, cancels mid-pass, and real threads."""

    def then_poll(*script, rid="a"):  # (request, new tokens) submits, n runs n steps, None: until idle
        def actions(e):
            for item in script:
                if isinstance(item, tuple):
                    _submit(e, *item)
                else:
                    _steps(e, item) if item else e.run_until_idle()
            return e.poll(rid)

        return actions

    cases = [
        poll_case("a request just submitted, no step yet: ([], 'running', None)", then_poll(("a",))),
        poll_case(
            "after 3 steps, one poll hands out every token made so far",
            then_poll(("a",), 3),
            "hand out all of req.pending, as a list",
        ),
        poll_case(
            "a second poll with no step in between: ([], 'running', None)",
            lambda e: (then_poll(("a",), 3)(e), e.poll("a"))[1],
            "after taking the tokens, leave req.pending empty",
        ),
        poll_case(
            "a finished request: its last tokens AND 'done' with the finish reason", then_poll(("a", 4), None)
        ),
        poll_case(
            "after 'done' was reported, the engine forgets the request: 'unknown'",
            lambda e: (then_poll(("a", 4), None)(e), e.poll("a"))[1],
            "delete the request from self._requests when you report 'done'",
        ),
        poll_case(
            "an id the engine never had: ([], 'unknown', None)",
            then_poll(("a",), rid="zzz"),
            "self._requests.get(rid) is None for it",
        ),
        poll_case(
            "another request's tokens are not yours: b's poll sees only b's",
            then_poll(("a",), ("b",), 2, rid="b"),
            slots=2,
        ),
        piece_case("one poll takes self._lock exactly once", once_locked),
        piece_case(
            "a forced interleaving: the engine runs a step each time your poll lets go of the "
            "lock; a client polling until 'done' must receive every token (1 to 6 tokens)",
            interleaved,
            "drain the tokens and read the status under one hold of the lock",
        ),
        piece_case(
            "cancel a decoding request (b waits for its slot): True, then False; poll says "
            "'cancelled'; after the next step b has the slot; every block comes back",
            cancel_running,
            "self._finish(req, 'cancelled') and self._cancelled.append(req), under the lock",
        ),
        piece_case(
            "cancel a request still in the queue: True, poll says cancelled, it never runs", cancel_queued
        ),
        piece_case(
            "cancel of a finished request, of one already reported done, of an unknown id: False each time",
            cancel_done,
            "return False when self._requests has no such request or it is finished",
        ),
        piece_case(
            "cancel while a forward pass computes the request: True, and its slot and blocks "
            "stay held until the pass ends; the next step frees them",
            cancel_mid_pass,
        ),
        piece_case(
            "real threads: an EngineLoop serving 6 clients, 5 requests each, polling every "
            "millisecond until 'done': every answer equals the fake model's",
            threaded,
        ),
    ]
    return run_cases("engine_front", cls, cases)


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
    """Check ``fn(poll, rid, detokenizer)``: a generator that polls ``rid`` while "running", feeds
    every new token to ``detokenizer.add``, yields each non-empty piece at once, then ``flush()``'s."""
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
                return (
                    "you polled again after the status stopped being 'running': stop "
                    "polling once it is 'done' (or 'unknown')"
                )
            if got["polls"] < expected["polls"]:
                return "you stopped polling while the status was still 'running'"
            if "\ufffd" not in expected["text"] and any("\ufffd" in p for p in pieces):
                return (
                    "a piece contains '\\ufffd' (the replacement character): feed tokens to "
                    "detokenizer.add() and yield what it returns, not tokenizer.decode([t])"
                )
            if text != expected["text"]:
                last_poll = script[-1][0]
                before = tok.decode([t for tokens, _, _ in script[:-1] for t in tokens])
                if last_poll and text in (before, before.rstrip("\ufffd")):
                    return (
                        "the tokens that came in the same poll as the final status are "
                        "missing: handle a poll's tokens before you look at its status"
                    )
                if expected["text"].startswith(text):
                    return (
                        f"the text stops short: {expected['text'][len(text) :]!r} is missing "
                        f"(call detokenizer.flush() when the stream ends and yield the rest)"
                    )
                return ""
            if streaming and got["at"] and got["at"][0] >= expected["polls"]:
                return (
                    "the first piece came out only after the last poll: yield each piece as "
                    "soon as you have it, so the user sees text while it is made"
                )
            return None

        return compare

    def show_stream(value):
        if "pieces" in value:
            return f"pieces {show(value['pieces'])} after {value['polls']} polls"
        return f"text {value['text']!r} after {value['polls']} polls"

    def case(label, script, hint="", streaming=False):
        return Case(
            label,
            lambda f: _scripted(f, tok, script),
            expect(script),
            compare_for(script, streaming),
            hint,
            show_stream,
        )

    def one_per_poll(ids, done="done", reason="stop"):
        return [([t], "running", None) for t in ids[:-1]] + [([ids[-1]], done, reason)]

    answer = tok.encode(" The capital of France is Paris.")
    emoji = tok.encode("I love 🍕 and ☕.")
    cut = tok.encode("I love 🍕")[:-1]  # the stream ends inside the emoji
    cases = [
        case("' The capital of France is Paris.' one token per poll", one_per_poll(answer)),
        case(
            "the same, checked for streaming: the first piece must come out before the last poll",
            one_per_poll(answer),
            "yield inside the loop, right after each add()",
            streaming=True,
        ),
        case(
            "'I love 🍕 and ☕.': each emoji is 3 tokens, arriving in 3 separate polls",
            one_per_poll(emoji),
            "a token can end in the middle of a character; the detokenizer holds it back",
        ),
        case(
            "the last 4 tokens come in the same poll as 'done': show them too",
            [(answer[:3], "running", None), (answer[3:], "done", "stop")],
            "handle the tokens of a poll before you look at its status",
        ),
        case(
            "polls that return nothing for a while (the engine is busy with others): keep polling",
            [([], "running", None)] * 3
            + [(answer[:2], "running", None), ([], "running", None), (answer[2:], "done", "length")],
        ),
        case(
            "the stream is cut inside an emoji (max_new_tokens reached): flush() hands out what "
            "was held back",
            [(cut, "done", "length")],
            "after the loop, yield detokenizer.flush() if it is not empty",
        ),
        case("an unknown request id: stop after one poll, no text", [([], "unknown", None)]),
    ]

    def real(f):
        from ..loop import EngineLoop

        ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        loop = EngineLoop(make_engine("stallfree", lm, max_batch_size=2, token_budget=64, num_kv_blocks=16))
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

    def real_compare(got, expected):  # against what the engine made: no near-tie can flip it
        return None if got[0] == got[1] else f"the engine made {got[1]!r}, your stream showed {got[0]!r}"

    if lm is not None:
        cases.append(
            Case(
                "the real model on an EngineLoop: the France question streamed to the end",
                real,
                "the text the engine made",
                real_compare,
                show=lambda v: repr(v[0]) if isinstance(v, tuple) else v,
            )
        )
    return run_cases("stream_text", fn, cases)
