"""Lesson 8's checkers reject known-wrong solutions and name the mistake."""

from __future__ import annotations

import pytest

from batchlab.course import checks
from batchlab.core.policies import Policy, PriorityPolicy

from learner_pieces import MyMemoryScheduler, MyVictimPolicy
from batchlab.core.request import State
from batchlab.core.scheduler import OnDemandKV, StallFreeScheduler


def _headroom(scheduler):
    return sum(r.state is State.DECODING for r in scheduler.running)


class RightFits(MyMemoryScheduler):
    def fits(self, req, max_tokens):
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )
        return taken + _headroom(self) <= self.blocks.num_free


class NoHeadroom(MyMemoryScheduler):
    def fits(self, req, max_tokens):
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )
        return taken <= self.blocks.num_free


class WholePrompt(MyMemoryScheduler):
    def fits(self, req, max_tokens):
        return self.blocks.blocks_for(req.prefill_len) + _headroom(self) <= self.blocks.num_free


class IgnoresCache(MyMemoryScheduler):
    def fits(self, req, max_tokens):
        n = min(max_tokens, req.prefill_len)
        return self.blocks.blocks_for(n) + _headroom(self) <= self.blocks.num_free


class PromptOnly(MyMemoryScheduler):
    """Counts the prompt alone: right at every first admission, wrong for a preempted request,
    which prefills its prompt and the tokens it generated."""

    def fits(self, req, max_tokens):
        hits = self.blocks.lookup(req.token_ids(0, req.prompt_len))
        cached = len(hits) * self.blocks.block_size
        n = min(max_tokens, req.prompt_len - cached)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )
        return taken + _headroom(self) <= self.blocks.num_free


class PrefillHeadroom(MyMemoryScheduler):
    """Keeps headroom for prefills still under way too, which the lesson says not to count."""

    def fits(self, req, max_tokens):
        hits, cached, n = self.first_chunk(req, max_tokens)
        taken = (
            self.blocks.blocks_for(cached + n) - len(hits) + sum(self.blocks.ref_counts[b] == 0 for b in hits)
        )
        return taken + len(self.running) <= self.blocks.num_free


class OldestVictim(Policy):
    def victim(self, running):
        return min(running, key=lambda r: (-r.priority, r.arrival_s))


class MostImportantVictim(Policy):
    def victim(self, running):
        return min(reversed(running), key=lambda r: (r.priority, -r.arrival_s))


def test_the_reference_fits_with_the_lessons_victim_passes():
    assert checks.memory_scheduler(RightFits, MyVictimPolicy)


def test_our_victim_policy_passes_every_case_but_the_lineage():
    verdict = checks.memory_scheduler(RightFits, PriorityPolicy)
    assert verdict.passed == verdict.total - 1 and verdict.failed[0].startswith("the victim policy derives")


def test_our_scheduler_passes_every_case_but_the_lineage():
    verdict = checks.memory_scheduler(StallFreeScheduler, MyVictimPolicy)
    assert verdict.passed == verdict.total - 1, verdict.message
    assert verdict.failed[0].startswith("the scheduler mixes OnDemandKV into your own planner")


def test_fits_that_only_calls_super_is_not_written():
    """OnDemandKV is the mechanism: its fits is the kind's to write, so super() reaches nothing."""

    class OnlySuper(MyMemoryScheduler):  # its grow and preempt written, its fits not
        def fits(self, req, max_tokens):
            return OnDemandKV.fits(self, req, max_tokens)

    verdict = checks.memory_scheduler(OnlySuper, MyVictimPolicy)
    assert not verdict and verdict.not_written and "must write fits(req, max_tokens)" in verdict.message


def test_a_planner_without_on_demand_memory_is_rejected():
    """The lesson-5a planner alone reserves whole requests: not this lesson's memory."""
    from learner_pieces import MyStallFreeScheduler

    verdict = checks.memory_scheduler(MyStallFreeScheduler, MyVictimPolicy)
    assert not verdict and "must derive from OnDemandKV" in verdict.message


def test_a_victim_that_only_calls_super_is_not_written():
    class OnlySuper(Policy):
        def victim(self, running):
            return super().victim(running)

    verdict = checks.memory_scheduler(RightFits, OnlySuper)
    assert not verdict and "must write victim(running)" in verdict.message, verdict.message


def test_the_lessons_pieces_pass():
    from learner_pieces import MyMemoryScheduler, MyVictimPolicy

    assert checks.memory_scheduler(MyMemoryScheduler, MyVictimPolicy)


def test_fits_without_headroom_is_rejected():
    verdict = checks.memory_scheduler(NoHeadroom, MyVictimPolicy)
    assert (
        not verdict
        and "a likely cause (it gives your answer here): keep one free block of headroom" in verdict.message
    )
    # its first wrong admission is a preempted request's: the message counts what it prefills again
    assert "a 25-token prefill (18 of prompt, 7 generated before a preemption)" in verdict.message


def test_fits_that_counts_the_whole_prompt_is_rejected():
    verdict = checks.memory_scheduler(WholePrompt, MyVictimPolicy)
    assert not verdict and "count only the first chunk" in verdict.message


def test_fits_that_ignores_the_prefix_cache_is_rejected():
    verdict = checks.memory_scheduler(IgnoresCache, MyVictimPolicy)
    assert not verdict and "cached prefix blocks" in verdict.message
    assert verdict.failed and all("prefix" in label for label in verdict.failed)


def test_a_victim_that_picks_the_oldest_is_rejected():
    verdict = checks.memory_scheduler(RightFits, OldestVictim)
    assert not verdict and "the NEWER one (later arrival) gives way" in verdict.message


def test_a_victim_that_picks_the_most_important_is_rejected():
    verdict = checks.memory_scheduler(RightFits, MostImportantVictim)
    assert not verdict and "lower numbers are MORE important" in verdict.message


def test_a_missing_piece_is_not_written_yet():
    from batchlab.course.pieces import Missing

    verdict = checks.memory_scheduler(RightFits, Missing("MyVictimPolicy", "no such class"))
    assert not verdict and verdict.not_written


def test_kv_slots_that_forget_the_block_size_are_rejected():
    verdict = checks.kv_slots(
        lambda table, start, stop, bs: [table[p // bs] + p % bs for p in range(start, stop)]
    )
    assert not verdict and "block b starts at slot b * block_size" in verdict.message


def test_a_prefix_lookup_that_shares_the_last_block_is_rejected():
    from batchlab.core.kv import BlockManager

    def greedy(token_ids, cached, block_size):
        found, key = [], b""
        for i in range(len(token_ids) // block_size):
            key = BlockManager.block_key(key, token_ids[i * block_size : (i + 1) * block_size])
            if key not in cached:
                break
            found.append(cached[key])
        return found

    verdict = checks.cached_prefix(greedy)
    assert not verdict and "the block holding the last prompt token is always computed" in verdict.message


class GrowsNothing(MyMemoryScheduler):
    """Hands the batch on without taking its blocks: the pass writes where no block is."""

    def grow(self, batch):
        return batch


class KeepsThePreempted(MyMemoryScheduler):
    """Preempts while the pool is short, but returns the whole batch, the preempted rows too."""

    def grow(self, batch):
        MyMemoryScheduler.grow(self, batch)
        return batch


class PreemptsTheNewestAlways(MyMemoryScheduler):
    """Takes blocks in the batch's order, not the most important first, and makes room by
    preempting whoever asks last, ignoring the policy."""

    def grow(self, batch):
        from batchlab.core.scheduler import Batch

        rows = [(r, 1) for r in batch.decode] + list(batch.prefill)
        for req, n in rows:
            while (
                req in self.running
                and self.blocks.blocks_to_grow(req.id, req.num_computed + n) > self.blocks.num_free
            ):
                self.preempt(req)
            if req in self.running:
                self.blocks.ensure(req.id, req.num_computed + n)
        return Batch(
            decode=[r for r in batch.decode if r in self.running],
            prefill=[(r, n) for r, n in batch.prefill if r in self.running],
        )


@pytest.mark.parametrize("wrong", [GrowsNothing, KeepsThePreempted])
def test_a_grow_that_does_not_take_or_give_back_blocks_is_rejected_on_the_small_pools(wrong):
    verdict = checks.memory_scheduler(wrong, MyVictimPolicy)
    assert not verdict and not verdict.not_written, verdict.message
    assert all(label.startswith("a whole run") for label in verdict.failed), verdict.message


def test_a_grow_that_ignores_the_victim_policy_is_rejected():
    verdict = checks.memory_scheduler(PreemptsTheNewestAlways, MyVictimPolicy)
    assert not verdict, verdict.message


def test_a_grow_that_only_calls_super_is_not_written():
    class OnlySuper(MyMemoryScheduler):
        def grow(self, batch):
            from batchlab.core.scheduler import OnDemandKV

            return OnDemandKV.grow(self, batch)

    verdict = checks.memory_scheduler(OnlySuper, MyVictimPolicy)
    assert not verdict and verdict.not_written and "must write grow(batch)" in verdict.message


class Preempts(MyMemoryScheduler):
    """The lesson's preempt with one mistake switched on (``mistake``), the rest right."""

    mistake = None

    def preempt(self, req):
        if self.mistake == "no release":  # leaves the running list, keeps its slot and blocks
            self.running.remove(req)
        else:
            self.release(req)
        if req.finished and self.mistake != "requeues the finished":
            return
        if self.mistake != "keeps the cache":
            req.num_computed = 0
        if self.mistake == "drops its tokens":
            req.output_ids.clear()
        elif self.mistake != "recomputes the prompt only":
            req.prefill_len = req.prompt_len + len(req.output_ids)
        if self.mistake != "no state":
            req.set_state(State.QUEUED, self.clock())
        (self.queue.append if self.mistake == "to the back" else self.queue.appendleft)(req)


PREEMPT_MISTAKES = {  # mistake: what the verdict says
    "no release": "still running or in a slot: self.release(req)",
    "requeues the finished": "one that finished meanwhile stays finished",
    "keeps the cache": "its KV cache is gone (num_computed 0)",
    "recomputes the prompt only": "prefill_len is its prompt plus the tokens it generated",
    "drops its tokens": "it keeps the tokens it generated",
    "no state": "a request that comes back waits QUEUED",
    "to the back": "it goes to the FRONT",
}


def test_the_preempt_switchboard_with_no_mistake_passes():
    assert checks.memory_scheduler(Preempts, MyVictimPolicy)


@pytest.mark.parametrize("mistake", PREEMPT_MISTAKES)
def test_a_wrong_preempt_is_rejected_and_named(mistake):
    wrong = type(f"Preempts_{mistake.replace(' ', '_')}", (Preempts,), {"mistake": mistake})
    verdict = checks.memory_scheduler(wrong, MyVictimPolicy)
    assert not verdict and not verdict.not_written, verdict.message
    assert PREEMPT_MISTAKES[mistake] in verdict.message, verdict.message
    assert any(label.startswith("preempt:") for label in verdict.failed), verdict.message


def test_a_preempt_that_only_calls_super_is_not_written():
    """OnDemandKV is the mechanism: preempt is the kind's to write, so super() reaches nothing."""

    class OnlySuper(MyMemoryScheduler):
        def preempt(self, req):
            return OnDemandKV.preempt(self, req)

    verdict = checks.memory_scheduler(OnlySuper, MyVictimPolicy)
    assert not verdict and verdict.not_written and "must write preempt(req)" in verdict.message


def test_fits_that_counts_the_prompt_alone_is_rejected():
    verdict = checks.memory_scheduler(PromptOnly, MyVictimPolicy)
    assert not verdict and verdict.failed
    # its first wrong admission overdraws the pool: the message says so, where
    assert "the KV pool ran out" in verdict.message and "MemoryError" in verdict.message, verdict.message


def test_fits_that_keeps_headroom_for_prefills_is_rejected_and_told_so():
    verdict = checks.memory_scheduler(PrefillHeadroom, MyVictimPolicy)
    assert not verdict
    assert "count a prefill still under way as needing no headroom" in verdict.message, verdict.message
