"""Requests and their sampling parameters (plain Python; no jax)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 means no top-k cut; top_p 1.0 means no nucleus cut.
    A request with a seed samples the same tokens whatever else is in the batch.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")


class FinishReason(str, enum.Enum):
    STOP = "stop"      # end-of-sequence or a stop token
    LENGTH = "length"  # max_tokens or the model's context


@dataclasses.dataclass
class Request:
    """A sequence being generated: its tokens and how many of them are in the KV cache."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed or one drawn by the engine)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What `LLMEngine.generate` returns for one prompt."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float
    total_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first, over the time after the first token."""
        decode_time = self.total_s - self.ttft_s
        return (len(self.output_ids) - 1) / decode_time if decode_time > 0 else float("nan")
