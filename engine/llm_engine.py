"""The LLM engine loop: schedule -> run -> postprocess, over a shared paged KV cache.

`LLMEngine.step()` asks the scheduler which tokens of which requests to compute (decodes, prefill
chunks and prefix-cache hits mixed in one ragged batch), builds the step batch, runs one jitted
model step and one jitted sampler, then appends the sampled tokens, detokenizes incrementally,
applies stop conditions and frees the pages of finished requests.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from engine.detokenizer import IncrementalDetokenizer
from engine.request import (CompletionOutput, FinishReason, Request, RequestOutput,
                            SamplingParams)
from engine.runner import ModelRunner, StepBatch
from engine.sampling import SamplingArrays
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


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


@dataclasses.dataclass
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
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    step_time_s: float = 0.0
    host_time_s: float = 0.0  # scheduling, batch building, postprocessing, detokenization
    # Per step (number of sequences, host seconds, step seconds), when record_steps is on.
    record_steps: bool = False
    steps: list = dataclasses.field(default_factory=list)


class LLMEngine:
    """Runs many requests together over one model and one paged KV cache."""

    def __init__(self, cfg: ModelConfig, model, tokenizer=None,
                 engine_cfg: EngineConfig = EngineConfig()):
        if engine_cfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={engine_cfg.max_model_len} exceeds the model's "
                             f"context of {cfg.max_position_embeddings} tokens")
        self.cfg, self.tokenizer, self.engine_cfg = cfg, tokenizer, engine_cfg
        num_pages = self._num_pages(cfg, model, engine_cfg)
        self.pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=engine_cfg.max_num_seqs,
                            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
                            max_model_len=engine_cfg.max_model_len,
                            enable_chunked_prefill=engine_cfg.enable_chunked_prefill), self.pool)
        self.runner = ModelRunner(cfg, model, num_pages, engine_cfg.page_size,
                                  max_seqs=engine_cfg.max_num_seqs,
                                  max_width=self.pool.pages_needed(engine_cfg.max_model_len))
        self.stats = EngineStats()
        self._rng = np.random.default_rng(engine_cfg.seed)
        self._next_request = 0
        self._next_group = 0
        self._groups: dict[int, list[Request]] = {}
        self._group_of: dict[int, int] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._finished_groups: list[int] = []

    def _num_pages(self, cfg: ModelConfig, model, engine_cfg: EngineConfig) -> int:
        page_size, max_len = engine_cfg.page_size, engine_cfg.max_model_len
        self.cache_plan = None
        if engine_cfg.num_pages is not None:
            num_pages = engine_cfg.num_pages
        elif engine_cfg.memory_fraction is not None:
            import jax
            from flax import nnx
            from engine.memory import plan_kv_cache
            kv_dtype = jax.tree.leaves(nnx.state(model))[0].dtype
            self.cache_plan = plan_kv_cache(
                cfg, kv_dtype, page_size, max_len, engine_cfg.max_num_batched_tokens,
                engine_cfg.max_num_seqs, engine_cfg.memory_fraction)
            num_pages = self.cache_plan.num_pages
        else:
            num_pages = engine_cfg.max_num_seqs * -(-max_len // page_size)
        pages_per_seq = -(-max_len // page_size)
        self.kv_summary = (self.cache_plan.summary() if self.cache_plan else
                           f"KV cache: {num_pages} pages x {page_size} tokens; at most "
                           f"{num_pages // pages_per_seq} sequences of {max_len} tokens at once")
        return num_pages

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams,
                    priority: int = 0) -> int:
        """Queues a prompt (token ids, or text when the engine has a tokenizer); returns its id."""
        prompt_ids = self._validated_prompt(prompt)
        group_id = self._next_group
        self._next_group += 1
        now = time.perf_counter()
        samples = []
        for index in range(params.n):
            seed = (params.seed + index) % 2**32 if params.seed is not None \
                else int(self._rng.integers(2**32))
            request = Request(self._next_request, list(prompt_ids), params, seed,
                              priority=priority, arrival_time=now)
            if index > 0 and self.engine_cfg.enable_prefix_caching:
                request.wait_for = samples[0]  # share the first sample's prompt pages
            self._next_request += 1
            samples.append(request)
        for request in samples:
            self.scheduler.add(request)
            self._group_of[request.request_id] = group_id
            if self.tokenizer is not None:
                self._detokenizers[request.request_id] = IncrementalDetokenizer(
                    self.tokenizer, params.stop)
        self._groups[group_id] = samples
        return group_id

    def _validated_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt = self.tokenizer.encode(prompt)
        prompt_ids = [int(t) for t in prompt]
        limit = self.engine_cfg.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens, but the context "
                             f"(max_model_len) is {limit}: it must be at most {limit - 1}")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        return prompt_ids

    def abort(self, request_id: int) -> None:
        """Stops a request (all its samples) and frees its pages at once."""
        for request in self._groups.get(request_id, []):
            if not request.finished:
                self.scheduler.abort(request)
                request.finish_reason = FinishReason.ABORT
                request.finish_time = time.perf_counter()
        if request_id in self._groups and request_id not in self._finished_groups:
            self._finished_groups.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- one step ---------------------------------------------------------------------------

    def _build_batch(self, output: SchedulerOutput) -> StepBatch:
        page_size = self.pool.page_size
        items = output.scheduled
        counts = np.asarray([it.num_new_tokens for it in items], np.int32)
        start = np.zeros(len(items) + 1, np.int32)
        np.cumsum(counts, out=start[1:])
        width = max(len(it.request.pages) for it in items)
        token_ids = np.empty(start[-1], np.int32)
        positions = np.empty(start[-1], np.int32)
        slots = np.empty(start[-1], np.int32)
        tables = np.zeros((len(items), width), np.int32)
        kv_lens = np.empty(len(items), np.int32)
        for i, it in enumerate(items):
            r, first, n = it.request, it.request.num_computed_tokens, it.num_new_tokens
            pages = np.asarray(r.pages, np.int32)
            pos = np.arange(first, first + n, dtype=np.int32)
            sl = slice(start[i], start[i + 1])
            token_ids[sl] = r.token_ids[first:first + n] if n > 1 else [r.token_ids[first]]
            positions[sl] = pos
            slots[sl] = pages[pos // page_size] * page_size + pos % page_size
            tables[i, : len(pages)] = pages
            kv_lens[i] = first + n
        return StepBatch(token_ids, positions, slots, tables, start, kv_lens, start[1:] - 1)

    def step(self) -> list[StreamDelta]:
        """Runs one schedule -> run -> postprocess round; returns the new text of each sample."""
        t0 = time.perf_counter()
        output = self.scheduler.schedule()
        if not output.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could schedule nothing although requests wait")
            return []
        batch = self._build_batch(output)
        t1 = time.perf_counter()
        logits = self.runner.execute(batch)
        requests = [it.request for it in output.scheduled]
        tokens, chosen, top_ids, top_logprobs = self.runner.sample(
            logits, SamplingArrays.from_requests(requests))  # waits for the device
        t2 = time.perf_counter()
        completes = [it.request.num_computed_tokens + it.num_new_tokens >= it.request.num_tokens
                     for it in output.scheduled]
        self.scheduler.update_computed(output)
        deltas = []
        for i, request in enumerate(requests):
            if not completes[i]:
                continue  # a prefill chunk short of the prompt's end: its sample is discarded
            logprob = None
            if chosen is not None and request.params.logprobs is not None:
                k = request.params.logprobs
                logprob = (float(chosen[i]), dict(zip(top_ids[i, :k].tolist(),
                                                      top_logprobs[i, :k].tolist())))
            deltas.append(self._append_token(request, int(tokens[i]), logprob, t2))
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += output.num_tokens
        self.stats.num_generated_tokens += len(deltas)
        t3 = time.perf_counter()
        self.stats.step_time_s += t3 - t0
        host = (t1 - t0) + self.runner.last_prepare_s + (t3 - t2)
        self.stats.host_time_s += host
        if self.stats.record_steps:
            self.stats.steps.append((len(requests), host, t3 - t0))
        return deltas

    def _append_token(self, request: Request, token: int, logprob, now: float) -> StreamDelta:
        request.output_ids.append(token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        reason = self._stop_reason(request, token)
        text = ""
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is not None:
            text = detokenizer.add(request.output_ids, reason is not None)
            if reason is None and detokenizer.stopped_at is not None:
                reason = FinishReason.STOP
        if reason is not None:
            self.scheduler.finish(request, reason)
            request.finish_time = now
            group_id = self._group_of[request.request_id]
            if all(r.finished for r in self._groups[group_id]):
                self._finished_groups.append(group_id)
        group_id = self._group_of[request.request_id]
        index = self._groups[group_id].index(request)
        return StreamDelta(group_id, index, text, [token], reason,
                           None if logprob is None else [logprob])

    def _stop_reason(self, r: Request, token: int) -> FinishReason | None:
        if (token in r.params.stop_token_ids
                or (not r.params.ignore_eos and token in self.cfg.eos_token_ids)):
            return FinishReason.STOP
        # The context ends at max_model_len or where it fills the whole KV cache: a sequence
        # longer than the pool could never be scheduled again (the engine would stall).
        limit = min(self.engine_cfg.max_model_len, self.pool.num_pages * self.pool.page_size)
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= limit:
            return FinishReason.LENGTH
        return None

    # ---- outputs and whole generations ----------------------------------------------------------

    def finished_request_ids(self) -> list[int]:
        """Ids of requests finished (or aborted) since the last call (the list is cleared)."""
        done, self._finished_groups = self._finished_groups, []
        return done

    def output_of(self, request_id: int, release: bool = True) -> RequestOutput:
        """The output of a finished request; with `release`, the engine forgets the request."""
        samples = self._groups[request_id]
        outputs = []
        for index, r in enumerate(samples):
            detokenizer = self._detokenizers.get(r.request_id)
            text = detokenizer.text if detokenizer is not None else ""
            outputs.append(CompletionOutput(index, list(r.output_ids), text, r.finish_reason,
                                            list(r.output_logprobs)))
        first = samples[0]
        first_token = min((r.first_token_time for r in samples if r.first_token_time),
                          default=first.finish_time)
        finish = max(r.finish_time or first_token for r in samples)
        result = RequestOutput(request_id, first.prompt_ids, outputs,
                               first_token - first.arrival_time, finish - first.arrival_time,
                               sum(r.num_prefix_hit_tokens for r in samples))
        if release:
            for r in samples:
                self._detokenizers.pop(r.request_id, None)
                self._group_of.pop(r.request_id, None)
            del self._groups[request_id]
        return result

    def _add_all(self, prompts, params) -> list[int]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]

    def stream(self, prompts: Sequence[Sequence[int] | str],
               params: SamplingParams | Sequence[SamplingParams]) -> Iterator[StreamDelta]:
        """Adds the prompts and yields each sample's new text as its tokens arrive."""
        self._add_all(prompts, params)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Runs the prompts to completion; returns one output per prompt, in order."""
        ids = self._add_all(prompts, params)
        while self.has_unfinished():
            self.step()
        finished = set(self.finished_request_ids())
        return [self.output_of(i, release=i in finished) for i in ids]

    # ---- compilation --------------------------------------------------------------------------

    def warmup_shapes(self, num_seqs: int | None = None, max_total_len: int | None = None,
                      prompt_lens: list[int] | None = None) -> list[tuple[int, int, int, int]]:
        """The (tokens, seqs, pages, prefill seqs) programs a run can reach.

        Decode steps: every batch bucket up to num_seqs times every page-width bucket up to
        max_total_len. Prefill steps: every token bucket up to the step's token budget times every
        bucket of the number of prefilling sequences; or, given the `prompt_lens` of a run whose
        prompts all start at once, the one program of that first step.
        """
        from engine.runner import MIN_PAGE_BUCKET, MIN_TOKEN_BUCKET, bucket
        cfg = self.engine_cfg
        num_seqs = min(num_seqs or cfg.max_num_seqs, cfg.max_num_seqs)
        max_total_len = min(max_total_len or cfg.max_model_len, cfg.max_model_len)
        max_tokens = cfg.max_num_batched_tokens
        seq_buckets = sorted({bucket(n) for n in range(1, num_seqs + 1)})
        widths = sorted({bucket(self.pool.pages_needed(n), MIN_PAGE_BUCKET)
                         for n in range(1, max_total_len + 1, self.pool.page_size)})
        if self.runner.fixed_width:
            widths = widths[-1:]
        shapes = [(s, s, w, 0) for s in seq_buckets for w in widths]
        if prompt_lens is not None:
            tokens = min(sum(prompt_lens), max_tokens)
            return shapes + [(tokens, len(prompt_lens), 1, len(prompt_lens))]
        token_buckets = sorted({bucket(n, MIN_TOKEN_BUCKET) for n in range(2, max_tokens + 1)})
        for n in token_buckets:
            shapes += [(n, p, 1, p) for p in seq_buckets if 2 * p <= n]
        return shapes

    def warmup(self, num_seqs: int | None = None, max_total_len: int | None = None,
               prompt_lens: list[int] | None = None, progress=None) -> int:
        """Compiles the programs of `warmup_shapes`; returns how many were new."""
        shapes = self.warmup_shapes(num_seqs, max_total_len, prompt_lens)
        before = len(self.runner.compiled_shapes)
        for i, shape in enumerate(shapes):
            self.runner.warmup(*shape)
            if progress is not None:
                progress(i + 1, len(shapes))
        return len(self.runner.compiled_shapes) - before
