"""The static kind (lesson 1): up to B requests start together; nobody joins until all finish."""

from __future__ import annotations

from .base import Batch, Scheduler, StopRules


class StaticScheduler(StopRules, Scheduler):
    """Static batching: take up to B queued requests, prefill them together, decode until
    the longest is done. Finished rows stay in the batch as padding (computed, thrown
    away, their KV memory held) because a rectangular batch cannot shrink: the batch is
    ``running``, and it ends when every row has finished."""

    kind = "static"
    description = "up to B requests start together; nobody joins until the longest finishes"
    bench_variants = {"static": {}}
    rectangular = True

    def batches(self):
        if not self.running:  # start a batch: up to B requests from the front of the queue
            while self.queue and len(self.running) < self.max_batch_size and self.reserve(self.queue[0]):
                req = self.queue[0]
                self.begin(req)
                self.take_slot(req)
            if not self.running:
                return
            longest = max(r.prompt_len for r in self.running)
            yield Batch(
                prefill=[(r, r.prompt_len) for r in self.running],
                padding_tokens=sum(longest - r.prompt_len for r in self.running),
            )
        live = [r for r in self.running if not r.finished]
        if live:  # finished rows ride along as padding
            yield Batch(decode=live, padding=[r for r in self.running if r.finished])
        if all(r.finished for r in self.running):  # the batch is over: free its rows
            for r in list(self.running):
                self.release(r)
