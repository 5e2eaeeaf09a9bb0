"""The trace: what happened at every engine step, for metrics and animations.

Visualisations and metrics read only traces, so any run (live, recorded, or from the
simulator) can be replayed and checked without the model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    index: int
    start_s: float
    end_s: float = 0.0
    forward_s: float = 0.0  # time inside the model's forward passes
    mask_s: float = (
        0.0  # structured output: time filling constrained rows' masks (before or during the passes)
    )
    passes: int = 0  # forward passes this step ran (stall-free: always 1)
    slots: list[str | None] = field(default_factory=list)  # slot -> request id (after the step)
    slot_of: dict[str, int] = field(default_factory=dict)  # slot of each request that ran here
    decoded: list[str] = field(default_factory=list)  # requests that ran a decode row
    prefill: list[tuple[str, int, int]] = field(default_factory=list)  # (request, start, length)
    padding: list[str] = field(default_factory=list)  # static: finished rows still computed
    padding_tokens: int = 0  # static: prompt padding a rectangular batch would compute
    emitted: dict[str, list[int]] = field(default_factory=dict)  # new tokens per request
    finished: dict[str, str] = field(default_factory=dict)  # request -> finish reason
    queued: int = 0  # requests waiting in the queue when the step began
    kv_blocks_used: int = 0
    preempted: list[str] = field(default_factory=list)  # requests preempted in this step
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # after the step
    cached_blocks: list[int] = field(default_factory=list)  # free but still cached (evictable)
    # speculative decoding, per verify row: the draft tokens it carried, and how many of them
    # the model agreed with and became output tokens
    drafts: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def num_tokens(self) -> int:
        """Tokens this step pushed through the model (decode rows with their drafts, padding
        rows, prefill)."""
        return (
            len(self.decoded)
            + sum(self.drafts.values())
            + len(self.padding)
            + sum(n for _, _, n in self.prefill)
        )


@dataclass
class RequestRecord:
    id: str
    prompt_len: int
    max_new_tokens: int
    arrival_s: float
    state_times: list[tuple[float, str]] = field(default_factory=list)  # (time, state entered)
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: str | None = None
    output_ids: list[int] = field(default_factory=list)
    priority: int = 0
    preemptions: int = 0  # times it gave back its KV blocks and was recomputed


@dataclass
class Trace:
    kind: str
    max_batch_size: int
    steps: list[StepRecord] = field(default_factory=list)
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    num_kv_blocks: int | None = None  # the size of the KV pool, for pictures of blocks
    prefill_lane: bool = False  # prefilling requests hold no decode slot: pictures draw a lane
    token_budget: int | None = None  # tokens a step may run, where the kind has a budget (stall-free)

    def to_json(self) -> str:
        # steps may be a bounded deque (a server's trace): store it as a list
        return json.dumps({**asdict(self), "steps": [asdict(s) for s in self.steps]})

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        data = json.loads(text)
        steps = [
            StepRecord(**{**s, "prefill": [tuple(p) for p in s["prefill"]], "slot_of": s.get("slot_of", {})})
            for s in data["steps"]
        ]
        requests = {
            k: RequestRecord(**{**r, "state_times": [tuple(t) for t in r["state_times"]]})
            for k, r in data["requests"].items()
        }
        return cls(
            data["kind"],
            data["max_batch_size"],
            steps,
            requests,
            data.get("num_kv_blocks"),
            data.get("prefill_lane", False),
            data.get("token_budget"),
        )
