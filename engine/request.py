"""Requests and their sampling parameters (plain Python; no jax)."""
from __future__ import annotations

import dataclasses
import enum
from typing import Optional


MAX_LOGPROBS = 20


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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None  # also return the top-N logprobs of each position

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (0 disables it), got "
                             f"{self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class FinishReason(str, enum.Enum):
    STOP = "stop"      # end-of-sequence, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"    # aborted by the caller


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """A sequence being generated: its tokens and how many of them are in the KV cache.

    Compared by identity (eq=False): the scheduler finds and removes requests in its lists, and
    a field-by-field comparison per element made that O(running) in Python.
    """

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed actually used (params.seed or one drawn by the engine)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    priority: int = 0  # lower runs first; equal priorities run first come, first served
    wait_for: Optional["Request"] = None  # parallel sample: admitted once this one's prompt is cached
    prompt_cached: bool = False
    num_cached_pages: int = 0  # leading pages registered in the prefix cache
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    output_logprobs: list = dataclasses.field(default_factory=list)
    # Speculative decoding: proposed tokens to verify this step (at most `lookahead`, which the
    # engine sets before scheduling), the draft model's cached tokens, the adaptive k.
    lookahead: int = 0
    spec_tokens: list[int] = dataclasses.field(default_factory=list)
    num_draft_computed: int = 0
    spec_ema_accepted: float = 0.0
    # Asynchronous scheduling (engine/llm_engine.py): tokens sampled on the device whose ids the
    # host has not read yet (0, 1, or briefly 2), and the row of the newest one in its step.
    num_pending: int = 0
    pending_row: int = -1
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    group_id: int = -1  # the id add_request returned (its samples share it)
    sample_index: int = 0  # which of the group's n samples this is
    # Its row in the runner side's persistent input batch (engine/input_batch.py), -1 when it has
    # none.
    slot: int = -1
    # Token ids that end it: params.stop_token_ids, and the model's EOS ids unless ignore_eos
    # (set by the engine, which knows the EOS ids).
    stop_ids: frozenset = frozenset()
    sampling_row: tuple = dataclasses.field(init=False, repr=False)
    # Tokens in all at which it ends by max_tokens (prompt + max_tokens; the prompt never
    # changes).
    token_limit: int = dataclasses.field(init=False, repr=False)

    def __post_init__(self):
        # The per-row sampler inputs that never change, as one tuple (SamplingArrays reads it
        # once per step instead of five attributes).
        p = self.params
        self.sampling_row = (p.temperature, p.top_k, p.top_p, p.min_p, self.seed)
        self.token_limit = len(self.prompt_ids) + p.max_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole token list."""
        num_prompt = len(self.prompt_ids)
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt:end - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[:end - num_prompt]

    def length_room(self, limit: int) -> int:
        """Output tokens it may still append before it ends by length: max_tokens, or `limit`
        tokens in all (the context). 0 or less: it has ended."""
        num_outputs = len(self.output_ids)
        return min(self.params.max_tokens - num_outputs,
                   limit - len(self.prompt_ids) - num_outputs)

    @property
    def tokens(self) -> "TokenSlices":
        """token_ids for slicing, without building the whole list (a page's tokens: O(page))."""
        return TokenSlices(self)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TokenSlices:
    """A request's token ids (prompt then outputs) that can be sliced ([start:stop]) and
    measured, as the block pool reads them, without concatenating the two lists."""

    __slots__ = ("_request",)

    def __init__(self, request: Request):
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"TokenSlices takes [start:stop] slices, got {index!r}")
        start, stop, _ = index.indices(self._request.num_tokens)
        return self._request.tokens_between(start, max(start, stop))


@dataclasses.dataclass
class CompletionOutput:
    """One generated sample of a request (n > 1 gives several)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    logprobs: list = dataclasses.field(default_factory=list)  # per token: (logprob, {id: logprob})


@dataclasses.dataclass
class RequestOutput:
    """What `LLMEngine.generate` returns for one prompt: its samples and timings."""

    request_id: int
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float
    total_s: float
    num_prefix_hit_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def output_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        return self.outputs[0].finish_reason

    @property
    def decode_tokens_per_s(self) -> float:
        """Output tokens after the first, over the time after the first token."""
        decode_time = self.total_s - self.ttft_s
        generated = sum(len(o.token_ids) for o in self.outputs) - len(self.outputs)
        return generated / decode_time if decode_time > 0 else float("nan")


def logprob_entry(request: Request, row: int, chosen, top_ids, top_logprobs):
    """(logprob of the chosen token, {token id: logprob} of the top N) of a row, or None."""
    if chosen is None or request.params.logprobs is None:
        return None
    k = request.params.logprobs
    return (float(chosen[row]), dict(zip(top_ids[row, :k].tolist(),
                                         top_logprobs[row, :k].tolist())))
