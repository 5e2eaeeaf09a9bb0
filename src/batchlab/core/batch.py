"""The scheduler's word for one forward pass (pure Python, no MLX).

``Batch`` says which *requests* run and how many prompt tokens each. The runner's word
for the same pass is ``runner.Chunk`` (which *tokens* run, where their keys and values
live); the scheduler turns a Batch into Chunks (``Scheduler.prepare``), so the runner
never needs to know about requests, queues or the block manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request


@dataclass
class Batch:
    """The work of one forward pass, as the scheduler plans it."""

    decode: list[Request] = field(default_factory=list)  # one token each
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, prompt tokens)
    padding: list[Request] = field(default_factory=list)  # static: finished rows still computed
    padding_tokens: int = 0  # static: prompt padding a padded batch would compute (not run)
    # speculative decoding: request id -> the draft tokens its decode row carries (a verify
    # row of 1 + k tokens); ``postprocess`` fills ``accepted``: id -> drafts that became output
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens this pass pushes through the model: decode rows (with their drafts),
        padding rows and prefill chunks."""
        drafted = sum(len(self.drafts.get(r.id, ())) for r in self.decode)
        return len(self.decode) + drafted + len(self.padding) + sum(n for _, n in self.prefill)

    @property
    def requests(self) -> list[Request]:
        return [*self.decode, *(r for r, _ in self.prefill), *self.padding]
