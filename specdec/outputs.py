"""What `LLM.generate` returns (vLLM's shapes), plus speculative-decoding metrics.

Vocabulary (docs/design.md): each step the drafter proposes *draft tokens* (tree
nodes); the target keeps the *accepted tokens* on one path and adds one *bonus
token*. acceptance length = 1 + accepted tokens per step; acceptance rate =
accepted tokens / draft tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

FinishReason = Literal["stop", "length", "error", "abort"]  # abort: `LLM.abort_request`


@dataclasses.dataclass
class SpecDecodeMetrics:
    """Running totals of speculative steps (vLLM's names)."""

    # Counted as proposed: a target that verifies only a prefix of a host tree, or none
    # of it, where that pays better (`workers.WidthChooser`), still counts every node.
    num_drafts: int = 0  # speculative steps whose drafter proposed a non-empty tree
    num_draft_tokens: int = 0  # tree nodes proposed over those steps
    num_accepted_tokens: int = 0  # tree nodes accepted (bonus tokens not counted)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [depth-1]

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for d in range(num_accepted):
            self.accepted_per_position[d] += 1

    def merge(self, other: SpecDecodeMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b, strict=True)]

    @property
    def acceptance_rate(self) -> float:
        """Accepted tokens / draft tokens (all tree nodes)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """1 + accepted tokens per draft step (includes the bonus token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Fraction of steps whose accepted path reached depth d (index d - 1)."""
        if not self.num_drafts:
            return []
        return [n / self.num_drafts for n in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
        }


@dataclasses.dataclass
class RequestMetrics:
    """Timing of one request (seconds, `time.perf_counter` clock) and its speculation."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    spec: SpecDecodeMetrics = dataclasses.field(default_factory=SpecDecodeMetrics)

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "tpot": self.tpot, "num_output_tokens": self.num_output_tokens}


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence.

    With a stop string, `token_ids` end with the token that completed it and
    `text` ends just before it; with a stop token id or EOS, the token ends
    `token_ids` and is left out of `text` when it is special.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id hit; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
