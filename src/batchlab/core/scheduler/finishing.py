"""The finishing rules of the shipped kinds: when a new token ends a request. (A learner's
engine has its own, written in lesson 1.)"""

from __future__ import annotations

from ..request import Request


class StopRules:
    """A request ends with "stop" on one of its stop tokens (EOS unless ``ignore_eos``, and
    its ``stop_token_ids``), else with "length" once it has ``max_new_tokens`` tokens. The
    engine cut ``max_new_tokens`` at submit so that prompt + output fits ``max_seq_len``, and
    the sampler picks no stop token before ``min_new_tokens``. Mixed into a ``Scheduler``."""

    def finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.stop_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None
