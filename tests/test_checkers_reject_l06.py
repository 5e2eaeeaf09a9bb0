"""Lesson 6's checkers reject known-wrong solutions and name the mistake."""

from __future__ import annotations

import pytest

from batchlab.course import checks
from batchlab.core.engine import Engine, EngineBase

import learner_pieces
from learner_pieces import MyEngine


class DrainThenStatus(MyEngine):
    """Two holds of the lock: the engine can finish the request between them."""

    def poll(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return [], "unknown", None
            tokens, req.pending = req.pending, []
        with self._lock:
            if req.finished:
                self._requests.pop(req_id, None)
                return tokens, "done", req.finish_reason
            return tokens, "running", None


class NeverForgets(MyEngine):
    def poll(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return [], "unknown", None
            tokens, req.pending = req.pending, []
            return tokens, ("done" if req.finished else "running"), req.finish_reason


class UnknownRaises(MyEngine):
    def poll(self, req_id):
        with self._lock:
            self._requests[req_id]  # KeyError for an id it does not know
        return super().poll(req_id)


class FreesAtOnce(MyEngine):
    """Frees the slot and blocks inside cancel, while a pass may be computing the request."""

    def cancel(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None or req.finished:
                return False
            self._finish(req, "cancelled")
            self.scheduler.remove(req)
            return True


class TrueTwice(MyEngine):
    def cancel(self, req_id):
        with self._lock:
            req = self._requests.get(req_id)
            if req is None:
                return False
            if not req.finished:
                self._finish(req, "cancelled")
                self._cancelled.append(req)
            return True


def test_the_lessons_front_passes():
    assert checks.engine_front(learner_pieces.MyEngine)


def test_our_front_passes_every_case_but_the_lineage():
    """Ours is right, but a front derived from it could pass by calling it."""
    verdict = checks.engine_front(Engine)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("derives from EngineBase")

    class Delegates(Engine):
        def poll(self, req_id):
            return super().poll(req_id)

    verdict = checks.engine_front(Delegates)
    assert verdict.passed == verdict.total - 1 and "derive from EngineBase" in verdict.message


def test_a_front_that_hands_poll_to_super_is_not_written():
    class OnlySuper(EngineBase):
        def submit(self, prompt_ids, **params):
            return super().submit(prompt_ids, **params)

        def poll(self, req_id):
            return super().poll(req_id)

        def cancel(self, req_id):
            return super().cancel(req_id)

    verdict = checks.engine_front(OnlySuper)
    assert not verdict and "must write submit()" in verdict.message, verdict.message

    class PollOnlySuper(MyEngine):
        def poll(self, req_id):
            return super().poll(req_id)

    verdict = checks.engine_front(PollOnlySuper)
    assert verdict, "a poll handed to the learner's own earlier poll is the learner's"


class RoomOutsideTheLock(MyEngine):
    """Checks the queue's room, then enqueues in another hold: two threads can take the last place."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        self.admission.check_room(self.queue_depth)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.enqueue(rid, checked, arrival_s)
        return rid


class TakesAnyId(MyEngine):
    """Never refuses an id in use: the second request replaces the first in self._requests."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
        return rid


class IdFromTheCount(MyEngine):
    """Makes an id from how many requests it knows, outside the lock: two threads get the same one."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        import time

        checked = self.check_request(prompt_ids, **params)
        rid = request_id if request_id is not None else f"r{len(self._requests)}"
        time.sleep(0.0005)  # whatever happens between reading the count and taking the lock
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use")
            self.admission.check_room(self._queue_depth)
            self.enqueue(rid, checked, arrival_s)
        return rid


class EnqueuesLater(MyEngine):
    """Returns the id before the request is known: a poll right after says 'unknown'."""

    def submit(self, prompt_ids, request_id=None, arrival_s=None, **params):
        checked = self.check_request(prompt_ids, **params)
        with self._lock:
            rid = request_id if request_id is not None else self.new_id()
        self._later = getattr(self, "_later", []) + [(rid, checked, arrival_s)]
        return rid

    def step(self):
        with self._lock:
            for rid, checked, arrival_s in getattr(self, "_later", []):
                self.enqueue(rid, checked, arrival_s)
            self._later = []
        return super().step()


@pytest.mark.parametrize(
    "wrong, says",
    [
        (RoomOutsideTheLock, "got into a queue with room for 3"),
        (TakesAnyId, "the id 'a', already in use was accepted"),
        (IdFromTheCount, "ids"),
        (EnqueuesLater, "enqueue the request before submit returns"),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_wrong_submit_is_refused_with_its_mistake_named(wrong, says):
    verdict = checks.engine_front(wrong)
    assert not verdict and says in verdict.message, verdict.message


def test_a_poll_that_drains_and_reads_the_status_in_two_holds_is_rejected():
    verdict = checks.engine_front(DrainThenStatus)
    assert not verdict
    assert "takes self._lock 2 times" in verdict.message
    assert any("forced interleaving" in label for label in verdict.failed)


def test_a_poll_that_never_forgets_a_done_request_is_rejected():
    verdict = checks.engine_front(NeverForgets)
    assert not verdict and "forgets the request" in verdict.message
    assert "delete the request from self._requests" in verdict.message


def test_a_poll_that_raises_on_an_unknown_id_is_rejected():
    verdict = checks.engine_front(UnknownRaises)
    assert not verdict and "KeyError" in verdict.message and "never had" in verdict.message


def test_a_cancel_that_frees_during_the_pass_is_rejected():
    verdict = checks.engine_front(FreesAtOnce)
    assert not verdict
    assert "freed the request's slot or KV blocks while a forward pass" in verdict.message


def test_a_cancel_that_returns_true_twice_is_rejected():
    verdict = checks.engine_front(TrueTwice)
    assert not verdict and "the second cancel returned True" in verdict.message


def test_a_missing_piece_is_not_written_yet():
    from batchlab.course.pieces import Missing

    verdict = checks.engine_front(Missing("MyEngine", "my_engine/front.py does not exist yet"))
    assert not verdict and verdict.not_written and "not written yet" in verdict.message


def test_a_poll_that_deadlocks_is_reported_not_hung():
    class Nested(MyEngine):
        def poll(self, req_id):
            with self._lock:
                return super().poll(req_id)

    verdict = checks.engine_front(Nested)  # a hang would meet the suite's timeout instead
    assert not verdict and "taken twice by the same thread" in verdict.message


class NoneWhenEmpty(MyEngine):
    """Hands out None instead of [] when nothing is pending: a client doing `got += tokens` crashes."""

    def poll(self, req_id):
        tokens, status, reason = super().poll(req_id)
        return tokens or None, status, reason


def test_a_client_thread_that_crashes_fails_the_threaded_case():
    verdict = checks.engine_front(NoneWhenEmpty)
    assert not verdict and "new tokens should be a list" in verdict.message
    assert any("real threads" in label for label in verdict.failed), verdict.message


@pytest.mark.slow
def test_a_stream_that_decodes_token_by_token_is_rejected(lm):
    def one_by_one(poll, rid, detokenizer):
        while True:
            tokens, status, _ = poll(rid)
            for t in tokens:
                yield lm.tokenizer.decode([t])
            if status != "running":
                break

    verdict = checks.stream_text(one_by_one, lm)
    assert not verdict and "replacement character" in verdict.message
