"""The LLM engine's public value types: its configuration, its stream deltas and its counters
(plain dataclasses; engine/llm_engine.py re-exports them)."""
from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from engine.request import FinishReason, Request


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes.

    The KV cache has `num_pages` pages if given; else, with `memory_fraction`, as many as fit in
    that fraction of the device's memory (engine/memory.py); else enough for max_num_seqs
    sequences of max_model_len tokens.
    """

    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    # Schedule step n+1 while step n runs (see LLMEngine.step), on one device or a mesh, with
    # single steps or multi-step rounds; speculative decoding and penalties run synchronously.
    # Off by default (docs/PERFORMANCE.md: it hides all but 5% of the host's time for
    # llama3.1-8b at 256 sequences on the H200, about half of it for llama3.2-1b).
    async_scheduling: bool = False
    # Decode steps per program when every running request decodes (multi-step scheduling, as
    # vLLM's --num-scheduler-steps): the host schedules, dispatches and reads tokens once per
    # this many steps, and sequences that stop within them drop their extra tokens. 1: off.
    # With async_scheduling a round is launched before the host reads the one before;
    # penalties, logprobs, speculation and a sharded runner take single steps.
    num_decode_steps: int = 1
    # With rounds: schedule for them under load (engine/multi_step.py, `_rounds_possible`):
    # admissions pause after an admitting step while fewer than 1/8 of the slots are free, and
    # a prompt that does not fit the rest of a step's token budget waits for the next
    # admitting step unless it is that step's first admission. Off by default: on the H200
    # (llama3.2-1b, 256 slots, asynchronous 8-step rounds) it cut the engine's Python per
    # model step by 16% while requests waited, with the same throughput and a 5-11% later
    # first token (docs/PERFORMANCE.md); it helps where the host, not the device, bounds.
    pause_admissions_for_rounds: bool = False
    # With rounds: a step with prefill chunks is followed, in the same program, by
    # num_decode_steps - 1 decode steps of its rows whose prompts it completes or which decode
    # (engine/multi_step.py, `_mixed_round_ready`), when more than half of the sequence slots'
    # bucket is scheduled and, while requests wait, fewer than 1/16 of the slots are free.
    # vLLM's multi-step with chunked prefill did the same. On by default: on the H200
    # (llama3.2-1b, 256 slots, asynchronous 8-step rounds, two pairs on two machines, GPUs
    # swapped) 2.0-2.4% more output tokens/s, TPOT p50 -12%, the same first-token times and
    # about half the engine's Python per model step while requests waited (docs/PERFORMANCE.md).
    mixed_rounds: bool = True
    # A round's steps traced one after another (one straight program, like a single step,
    # num_decode_steps times longer to compile) instead of a device loop.
    unroll_decode_steps: bool = False
    # Dispatch each step's jitted program from a worker thread (with async_scheduling): the
    # call holds its thread while XLA enqueues (or updates and launches the CUDA graphs of) the
    # program's kernels, about 1-2.5 ms for a step on the H200; with the GIL released there,
    # the engine's Python of the next step runs meanwhile.
    dispatch_thread: bool = False

    def __post_init__(self):
        if not isinstance(self.num_decode_steps, int) or self.num_decode_steps < 1:
            raise ValueError(f"num_decode_steps must be an integer >= 1, got "
                             f"{self.num_decode_steps!r}")


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
    # (results, next_inputs) of its dispatch, or a Future of them (dispatched on a worker
    # thread: EngineConfig.dispatch_thread). results: a step's runner.sample_device device
    # arrays (tokens padded to sample_rows), a round's (tokens [steps, bucket(S)],).
    # next_inputs: the device tokens [sample_rows] a step launched after this one reads its
    # in-flight input tokens from (row i: row i's newest token); a round's last step's.
    launch: tuple | concurrent.futures.Future
    steps: int = 1  # model steps (a multi-step round runs several)
    # Rows whose tokens may end them by length or are their first (bool [S]): only these, and
    # those with a stop id among their tokens, are appended token by token.
    may_end: np.ndarray | None = None

    def outcome(self) -> tuple:
        """(results, next_inputs), waiting for the dispatch if a worker thread makes it (and
        raising its error if it failed)."""
        launch = self.launch
        return launch.result() if isinstance(launch, concurrent.futures.Future) else launch

    @property
    def results(self) -> tuple:
        return self.outcome()[0]

    @property
    def next_inputs(self):
        return self.outcome()[1]
