"""The sequential kind: one request at a time, start to finish (the baseline)."""

from __future__ import annotations

from ..kv import BlockManager
from .base import Batch, Option, Scheduler, StopRules


class SequentialScheduler(StopRules, Scheduler):
    """One request at a time: prefill its whole prompt, decode it to the end, next."""

    kind = "sequential"
    description = "one request at a time, start to finish: the baseline every batching engine beats"
    options: dict[str, Option] = {}

    def __init__(self, blocks: BlockManager, clock):
        super().__init__(blocks, clock, 1)

    def batches(self):
        if self.running:
            yield Batch(decode=self.running[:1])
        elif self.queue and self.reserve(self.queue[0]):
            req = self.queue[0]
            self.begin(req)
            self.take_slot(req)
            yield Batch(prefill=[(req, req.prompt_len)])
