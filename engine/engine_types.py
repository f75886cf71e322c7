"""The LLM engine's value types: its stream deltas, its counters and a launched step (plain
dataclasses; engine/llm_engine.py re-exports the public ones)."""
from __future__ import annotations

import dataclasses

import numpy as np

from engine.request import FinishReason, Request


@dataclasses.dataclass(slots=True)
class StreamDelta:
    """New text and tokens of one sample of a request since its previous delta."""

    request_id: int  # the id add_request returned
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    # Per new token (logprob, {token id: logprob} of the top N), when params.logprobs is set.
    logprobs: list | None = None


@dataclasses.dataclass
class EngineStats:
    """Counters over the engine's life (for benchmarks and metrics)."""

    num_steps: int = 0
    num_model_steps: int = 0  # decode steps of the model (a multi-step round runs several)
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    # Input tokens a step read from the previous step's samples on the device (asynchronous
    # scheduling: the host had not read them yet).
    num_tokens_from_device: int = 0
    step_time_s: float = 0.0
    host_time_s: float = 0.0  # scheduling, batch building, postprocessing, detokenization
    # Host time during which the device had nothing queued (an upper bound; see LLMEngine.step).
    exposed_host_time_s: float = 0.0
    # Per round (sequences running after its scheduling, host s, round s, exposed host s,
    # model steps, requests waiting after its scheduling), when record_steps is on. Running
    # includes a request whose tokens in flight end it (it holds its slot but computes
    # nothing more).
    record_steps: bool = False
    steps: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class InFlight:
    """A launched step (or multi-step round) whose samples the host has not read yet."""

    requests: list[Request]  # one per row
    completes: list[bool]  # the row's sample is its request's next token (not a partial prefill)
    # A step's runner.sample_device device arrays (tokens padded to sample_rows), or a round's
    # (tokens [steps, bucket(S)],).
    results: tuple
    # The device tokens [sample_rows] a step launched after this one reads its in-flight input
    # tokens from (row i: row i's newest token); a round's last step's.
    next_inputs: object
    steps: int = 1  # model steps (a multi-step round runs several)
    # Rows whose tokens may end them by length or are their first (bool [S]): only these, and
    # those with a stop id among their tokens, are appended token by token.
    may_end: np.ndarray | None = None
