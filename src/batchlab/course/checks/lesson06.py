"""Checkers for lesson 6 (the poll interface): submit, poll and cancel under threads and a spy lock, and streamed text."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable

from ...core.engine import Engine, EngineBase, make_engine
from ...core.policies import Admission, QueueFull
from ...core.fake import FakeModel, FakeRunner, reference_output
from ...serving.server import EngineLoop
from ._core import Case, Verdict, answer_compare, run_cases, show
from ._lineage import lineage_case
from ._pieces import piece_case

__all__ = ["engine_front", "stream_text"]


class _SpyLock:
    """A lock counting acquisitions, running ``after_release`` after each release; re-entry raises."""

    def __init__(self):
        self._lock, self._owner, self._in_hook = threading.Lock(), None, False
        self.acquisitions, self.after_release = 0, None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if blocking and self._owner == threading.get_ident():
            raise RuntimeError("self._lock is taken twice by the same thread: a nested `with` waits forever")
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

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


_PROMPTS = {"a": [3, 1, 4, 1, 5], "b": [2, 7, 1, 8]}
_BLOCKS = 16
_POOL = dict(token_budget=8, num_kv_blocks=_BLOCKS, kv_block_size=4)


def _right(rid, new):
    return reference_output(_PROMPTS[rid], new, FakeModel().vocab_size, frozenset())


def _started(f, *requests, steps=0, slots=1, **options):
    """``f``'s engine (options: lock, runner), ``requests`` (id, new tokens) in, ``steps`` run (None: all)."""
    options = {"lock": _SpyLock(), "runner": FakeRunner, **_POOL, **options}
    engine = make_engine("stallfree", FakeModel(), engine_class=f, max_batch_size=slots, **options)
    for rid, new in requests:
        engine.submit(_PROMPTS[rid], max_new_tokens=new, ignore_eos=True, request_id=rid)
    for _ in range(steps or 0):
        engine.step()
    if steps is None:
        engine.run_until_idle()
    return engine


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


def poll_case(label, requests, steps=0, hint="", rid="a", again=False, slots=1):
    """``requests``, ``steps`` (None: until idle), a poll of ``rid`` (``again``: two); Engine answers."""

    def call(f):
        new = 6 if steps is not None else 4  # None: until idle
        engine = _started(f, *[(r, new) for r in requests], steps=steps, slots=slots)
        if again:
            engine.poll(rid)
        return engine.poll(rid)

    return Case(label, call, call(Engine), answer_compare(_poll_triple, _diagnose_poll), hint)


def once_locked(f):
    spy = _SpyLock()
    engine = _started(f, ("a", 6), steps=2, lock=spy)
    spy.acquisitions = 0
    engine.poll("a")
    if spy.acquisitions == 0:
        return "your poll never takes self._lock: the engine thread can change the request while you read it"
    if spy.acquisitions > 1:
        return f"your poll takes self._lock {spy.acquisitions} times: the engine can step between them"
    return None


def interleaved(f):
    """The engine steps whenever the client lets go of the lock; 1 to 6 tokens, polled until 'done'."""
    for n in range(1, 7):
        spy = _SpyLock()
        engine = _started(f, ("a", n), lock=spy)
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
            return f"with {n} token(s), the client got {got}: the request finished between drain and status"
        if got != _right("a", n):
            return f"with {n} token(s), the client received {got}: tokens twice or out of order"
    return None


def threaded(f):
    errors, wrong = [], []

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

    with EngineLoop(_started(f, slots=4)) as loop, ThreadPoolExecutor(6) as clients:
        list(clients.map(client, range(6)))  # a thread each; an exception in one comes out here
    if loop.error is not None:
        return f"the engine thread died: {type(loop.error).__name__}: {loop.error}"
    if errors or not wrong:
        return errors[0] if errors else None
    return f"{len(wrong)} of 30 requests came out wrong, e.g. {wrong[0][0]}: {wrong[0][1]} of 8 tokens"


def cancel_running(f):
    engine = _started(f, ("a", 50), ("b", 3), steps=3)
    made = list(engine.trace.requests["a"].output_ids)
    first, second, polled = engine.cancel("a"), engine.cancel("a"), engine.poll("a")
    if not isinstance(first, bool) or not isinstance(second, bool):
        return f"cancel returns True or False, not {show(first)} / {show(second)}"
    if first is not True:
        return "cancel of a decoding request must return True: this call stopped it"
    if second is not False:
        return "the second cancel returned True: only the call that stopped the request returns True"
    if tuple(polled) != (made, "done", "cancelled"):
        return f"after cancel, poll should give {show((made, 'done', 'cancelled'))}, got {show(polled)}"
    engine.step()
    if list(engine.trace.steps[-1].slots) != ["b"]:
        return "after the next step b should hold the slot: put the request on self._cancelled"
    engine.run_until_idle()
    if tuple(engine.poll("b")) != (_right("b", 3), "done", "length"):
        return f"b, served after the cancel, should finish with {show((_right('b', 3), 'done', 'length'))}"
    return _blocks_back(engine)


def _blocks_back(engine):
    lost = _BLOCKS - engine.stats()["free_kv_blocks"]
    return f"{lost} KV block(s) never came back after the cancel" if lost else None


def cancel_queued(f):
    engine = _started(f, ("a", 4), ("b", 4), steps=1)
    said, polled = engine.cancel("b"), engine.poll("b")
    engine.run_until_idle()
    if said is not True:
        return "cancel of a queued request must return True: it was waiting to run"
    if tuple(polled) != ([], "done", "cancelled"):
        return f"poll after cancelling a queued request should give {show(([], 'done', 'cancelled'))}"
    if any("b" in s.decoded or any(p[0] == "b" for p in s.prefill) for s in engine.trace.steps):
        return "b ran after it was cancelled: a cancelled request must never be scheduled"
    if tuple(engine.poll("a")) != (_right("a", 4), "done", "length"):
        return "a, the other request, should still finish normally"
    return None


def cancel_done(f):
    engine = _started(f, ("a", 3), steps=None)
    got = [engine.cancel("a")]  # finished, "done" not yet polled
    engine.poll("a")
    got += [engine.cancel("a"), engine.cancel("zzz")]
    for said, what in zip(got, ["a finished request", "a request reported done", "an unknown id"]):
        if said is not False:
            return f"cancel of {what} must return False (nothing was running), got {show(said)}"
    return None


def cancel_mid_pass(f):
    """Cancel a while a forward pass computes it: its KV blocks stay held until the pass ends."""
    seen = {}

    class CancellingRunner(FakeRunner):
        def run(self, chunks):
            if seen.get("armed") and any(c.req_id == "a" for c in chunks):
                seen.update(armed=False, said=engine.cancel("a"))
                seen["held"] = bool(engine.scheduler.kv_usage()["block_tables"].get("a"))
            return super().run(chunks)

    engine = _started(f, ("a", 20), ("b", 6), steps=3, slots=2, runner=CancellingRunner)
    seen["armed"] = True
    engine.run_until_idle()
    if seen.get("said") is not True:
        return "cancel of a request in the middle of a pass must return True"
    if not seen["held"]:
        return "your cancel freed the request's slot or KV blocks while a forward pass was computing it"
    if tuple(engine.poll("b")) != (_right("b", 6), "done", "length"):
        return "b should still finish normally"
    return _blocks_back(engine)


def submit_registers(f):
    engine = _started(f)
    rid = engine.submit(_PROMPTS["a"], max_new_tokens=3, ignore_eos=True)
    if not isinstance(rid, str):
        return f"submit returns the request's id (a str), not {show(rid)}"
    polled = engine.poll(rid)
    if isinstance(polled, (tuple, list)) and len(polled) == 3 and polled[1] == "unknown":
        return "poll right after submit said 'unknown': enqueue the request before submit returns"
    other = engine.submit(_PROMPTS["b"], max_new_tokens=2, ignore_eos=True)
    if other == rid:
        return f"two submits without a request_id both got the id {rid!r}: take a new one each time (self.new_id())"
    given = engine.submit(_PROMPTS["a"], max_new_tokens=3, ignore_eos=True, request_id="mine")
    if given != "mine":
        return f"submit(..., request_id='mine') returned {show(given)}: a given id is the request's id"
    engine.run_until_idle()
    record = engine.trace.requests[rid]
    if (list(record.output_ids), record.finish_reason) != (_right("a", 3), "length"):
        return f"the submitted request should make {show(_right('a', 3))} and end 'length'"
    return None


def submit_refuses(f):
    engine = _started(f, ("a", 4))
    refused = [  # (in words, the prompt, submit's other arguments)
        ("the id 'a', already in use", _PROMPTS["b"], dict(max_new_tokens=2, request_id="a")),
        ("an empty prompt", [], dict(max_new_tokens=2)),
        ("max_new_tokens=0", _PROMPTS["b"], dict(max_new_tokens=0)),
        ("a string instead of token ids", "hello", dict(max_new_tokens=2)),
    ]
    for label, prompt, params in refused:
        try:
            engine.submit(prompt, **params)
        except ValueError:
            pass
        except Exception as e:
            return f"submit with {label} raised {type(e).__name__}: {e}, not ValueError"
        else:
            return f"submit with {label} was accepted: it must raise ValueError and change nothing"
        if engine.queue_depth() != 1:
            return f"after refusing {label}, {engine.queue_depth()} requests wait, not 1: refuse before enqueueing"
    engine.run_until_idle()
    record = engine.trace.requests["a"]
    if (list(record.output_ids), record.finish_reason) != (_right("a", 4), "length"):
        return "a, submitted first, should finish as if the refused submits never happened"
    return None


class _SlowRoom(Admission):
    """Our admission, with a slow look at the queue: a window for two threads to both see room."""

    def check_room(self, queue_depth):
        depth = queue_depth() if self.max_queue is not None else 0
        time.sleep(0.005)
        if self.max_queue is not None and depth >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} waiting); retry later")


def submit_race(f):
    """8 threads submit at once into a queue with room for 3 (no step runs): exactly 3 get in."""
    engine = _started(f, admission=_SlowRoom(max_queue=3))
    start, outcomes = threading.Barrier(8), []

    def client(c):
        start.wait()
        try:
            outcomes.append(engine.submit([1 + c, 2, 3], max_new_tokens=2, ignore_eos=True))
        except QueueFull:
            outcomes.append(None)

    with ThreadPoolExecutor(8) as clients:
        list(clients.map(client, range(8)))
    taken = [o for o in outcomes if o is not None]
    if len(taken) != 3:
        return (
            f"{len(taken)} of 8 submits at once got into a queue with room for 3: check the room and "
            f"enqueue under ONE hold of self._lock, or several threads see the same last place"
        )
    if len(set(taken)) != 3:
        return f"submits at once got the same id: {taken}"
    return None


def submit_many(f):
    """8 threads submit 25 requests each without ids, then every one is served."""
    engine = _started(f, slots=4)
    ids = []

    def client(c):
        for j in range(25):
            ids.append(engine.submit([1 + (c + j) % 60, 2], max_new_tokens=2, ignore_eos=True))

    with ThreadPoolExecutor(8) as clients:
        list(clients.map(client, range(8)))
    if len(set(ids)) != 200:
        return f"200 submits from 8 threads got {len(set(ids))} different ids: take each id under the lock"
    engine.run_until_idle()
    unserved = [rid for rid in ids if engine.trace.requests[rid].finish_reason != "length"]
    return f"{len(unserved)} of 200 were never served, e.g. {unserved[0]}" if unserved else None


SUBMIT = "check_request first; then under one `with self._lock:` choose the id, refuse one in use, check_room, enqueue"
PENDING = "hand out all of req.pending, as a list"
EMPTY = "after taking the tokens, leave req.pending empty"
FORGET = "delete the request from self._requests when you report 'done'"
ONE = "drain the tokens and read the status under one hold of the lock"
CANCEL = "self._finish(req, 'cancelled') and self._cancelled.append(req), under the lock"


def engine_front(cls: Any) -> Verdict:
    """Check ``MyEngine``'s ``submit``, ``poll(rid) -> (new_tokens, status, finish_reason)`` and ``cancel(rid)``."""

    forgot = "after 'done' was reported, the engine forgets the request: 'unknown'"
    cases = [
        lineage_case(EngineBase, (Engine,)),
        piece_case(
            "submit: poll knows the request at once; new ids, or the one given", submit_registers, SUBMIT
        ),
        piece_case(
            "submit refuses an id in use and bad arguments (ValueError), changing nothing",
            submit_refuses,
            SUBMIT,
        ),
        piece_case(
            "8 threads submit at once into a queue with room for 3: exactly 3 get in", submit_race, SUBMIT
        ),
        piece_case("8 threads submit 200 requests without ids: 200 ids, all served", submit_many, SUBMIT),
        poll_case("a request just submitted, no step yet: ([], 'running', None)", "a"),
        poll_case("after 3 steps, one poll hands out every token made so far", "a", 3, PENDING),
        poll_case("a second poll with no step in between: ([], 'running', None)", "a", 3, EMPTY, again=True),
        poll_case("a finished request: its last tokens AND 'done' with the reason", "a", None),
        poll_case(forgot, "a", None, FORGET, again=True),
        poll_case("an id the engine never had: ([], 'unknown', None)", "a", rid="zzz"),
        poll_case("b's poll sees only b's tokens", "ab", 2, rid="b", slots=2),
        piece_case("one poll takes self._lock exactly once", once_locked),
        piece_case("a forced interleaving: a step each time your poll lets go of the lock", interleaved, ONE),
        piece_case("cancel a decoding request: True, then False; b gets its slot", cancel_running, CANCEL),
        piece_case("cancel a request still in the queue: True, and it never runs", cancel_queued),
        piece_case("cancel of a finished, a reported or an unknown request: False", cancel_done),
        piece_case("cancel while a forward pass computes the request", cancel_mid_pass),
        piece_case("real threads: an EngineLoop serving 6 clients, 5 requests each", threaded),
    ]
    return run_cases("engine_front", cls, cases)


def _scripted(fn, tokenizer, script, rid="req-0"):
    """The learner's generator ``fn`` run on a poll that answers ``script``, one item a poll."""
    calls: list[str] = []

    def poll(r):
        calls.append(r)
        return script[len(calls) - 1] if r == rid and len(calls) <= len(script) else ([], "unknown", None)

    pieces, at = [], []
    for piece in fn(poll, rid, tokenizer.detokenizer()):
        pieces.append(piece)
        at.append(len(calls))
        if len(calls) > len(script) + 50:
            break
    return {"pieces": pieces, "at": at, "polls": len(calls)}


def _one_per_poll(ids):
    return [([t], "running", None) for t in ids[:-1]] + [([ids[-1]], "done", "stop")]


def _stream_problem(tok, script, streaming, got, expected) -> str | None:
    """stream_text's run on a scripted poll: text pieces, the whole text (flushed), polling while
    'running' and no longer, and (if ``streaming``) the first piece before the last poll."""
    pieces = got["pieces"]
    if not all(isinstance(p, str) for p in pieces):
        return "yield pieces of text (str), not token ids"
    text = "".join(pieces)
    if got["polls"] > expected["polls"]:
        return "you polled again after the status stopped being 'running'"
    if got["polls"] < expected["polls"]:
        return "you stopped polling while the status was still 'running'"
    if "\ufffd" not in expected["text"] and any("\ufffd" in p for p in pieces):
        return "a piece contains '\\ufffd' (the replacement character): use detokenizer.add()"
    if text != expected["text"]:
        before = tok.decode([t for tokens, _, _ in script[:-1] for t in tokens])
        if script[-1][0] and text in (before, before.rstrip("\ufffd")):
            return "the tokens that came with the final status are missing"
        if expected["text"].startswith(text):
            return f"the text stops short: {expected['text'][len(text) :]!r} is missing (flush())"
        return ""
    if streaming and got["at"] and got["at"][0] >= expected["polls"]:
        return "the first piece came out only after the last poll: yield each piece at once"
    return None


def _show_stream(value):
    if "pieces" in value:
        return f"pieces {show(value['pieces'])} after {value['polls']} polls"
    return f"text {value['text']!r} after {value['polls']} polls"


def _real_problem(got, expected):  # against what the engine made: no near-tie can flip it
    return None if got[0] == got[1] else f"the engine made {got[1]!r}, your stream showed {got[0]!r}"


def _show_real(value):
    return repr(value[0]) if isinstance(value, tuple) else value


HELD = "a token can end in the middle of a character; the detokenizer holds it back"
BEFORE = "handle the tokens of a poll before you look at its status"
FLUSH = "after the loop, yield detokenizer.flush() if it is not empty"


def stream_text(fn: Callable, lm) -> Verdict:
    """Check ``fn(poll, rid, detokenizer)``: a generator yielding the text pieces of ``rid``'s tokens."""
    tok = lm.tokenizer

    def case(label, script, hint="", streaming=False):
        want = {"text": tok.decode([t for tokens, _, _ in script for t in tokens]), "polls": len(script)}
        compare = partial(_stream_problem, tok, script, streaming)
        return Case(label, lambda f: _scripted(f, tok, script), want, compare, hint, _show_stream)

    def real(f):
        ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        loop = EngineLoop(make_engine("stallfree", lm, max_batch_size=2, token_budget=64, num_kv_blocks=16))
        seen: list[int] = []

        def poll(rid):
            tokens, status, reason = loop.poll(rid)
            seen.extend(tokens)
            return tokens, status, reason

        with loop:
            rid, pieces, deadline = loop.submit(ids, max_new_tokens=16), [], time.monotonic() + 120
            for piece in f(poll, rid, tok.detokenizer()):
                pieces.append(piece)
                if time.monotonic() > deadline:
                    break
        return "".join(pieces), tok.decode(seen)

    answer, emoji = tok.encode(" The capital of France is Paris."), tok.encode("I love 🍕 and ☕.")
    cut = tok.encode("I love 🍕")[:-1]  # the stream ends inside the emoji
    with_done = [(answer[:3], "running", None), (answer[3:], "done", "stop")]
    late = [(answer[:2], "running", None), ([], "running", None), (answer[2:], "done", "length")]
    cases = [
        case("' The capital of France is Paris.' one token per poll", _one_per_poll(answer)),
        case("the same: the first piece comes before the last poll", _one_per_poll(answer), streaming=True),
        case("'I love 🍕 and ☕.': each emoji is 3 tokens, in 3 separate polls", _one_per_poll(emoji), HELD),
        case("the last 4 tokens come in the same poll as 'done': show them too", with_done, BEFORE),
        case("polls that return nothing for a while: keep polling", [([], "running", None)] * 3 + late),
        case("the stream is cut inside an emoji: flush() gives the rest", [(cut, "done", "length")], FLUSH),
        case("an unknown request id: stop after one poll, no text", [([], "unknown", None)]),
        Case("the real model on an EngineLoop", real, "the engine's text", _real_problem, "", _show_real),
    ]
    return run_cases("stream_text", fn, cases)
