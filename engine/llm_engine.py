"""The LLM engine loop: schedule -> run -> postprocess, over a shared paged KV cache.

This minimal engine admits waiting requests in one prefill step (as many as fit in
`max_num_seqs` and in the free pages), then decodes all running requests together, one token
each per step, until each stops. Requests follow the counter model of ../shared/DESIGN.md:
a request has its tokens and `num_computed_tokens`; a step computes the next N tokens of it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from engine.request import FinishReason, Request, RequestOutput, SamplingParams
from engine.runner import ModelRunner, StepBatch


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. num_pages None: enough pages for max_num_seqs sequences of max_model_len."""

    max_model_len: int = 2048
    max_num_seqs: int = 8
    page_size: int = 16
    num_pages: int | None = None
    seed: int = 0

    def resolved_num_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return self.max_num_seqs * -(-self.max_model_len // self.page_size)


@dataclasses.dataclass
class StreamDelta:
    """New text and tokens of one request since its previous delta."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None


class LLMEngine:
    """Runs many requests together over one model and one paged KV cache."""

    def __init__(self, cfg: ModelConfig, model, tokenizer=None,
                 engine_cfg: EngineConfig = EngineConfig()):
        if engine_cfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={engine_cfg.max_model_len} exceeds the model's "
                             f"context of {cfg.max_position_embeddings} tokens")
        self.cfg, self.tokenizer, self.engine_cfg = cfg, tokenizer, engine_cfg
        num_pages = engine_cfg.resolved_num_pages()
        self.pool = BlockPool(num_pages, engine_cfg.page_size)
        self.runner = ModelRunner(cfg, model, num_pages, engine_cfg.page_size)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._next_id = 0
        self._rng = np.random.default_rng(engine_cfg.seed)
        self._texts: dict[int, str] = {}
        self._finished: list[Request] = []

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams) -> Request:
        """Queues a prompt (token ids, or text when the engine has a tokenizer)."""
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
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        request = Request(self._next_id, prompt_ids, params, seed, arrival_time=time.perf_counter())
        self._next_id += 1
        self.waiting.append(request)
        self._texts[request.request_id] = ""
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def warmup(self, num_seqs: int, max_prompt_len: int, max_total_len: int) -> int:
        """Compiles the prefill and decode programs a run of this size reaches; returns how many.

        Decode batches shrink as requests finish and block tables grow with the sequences, so
        every (batch bucket <= num_seqs, page-width bucket up to max_total_len) pair is compiled.
        """
        from engine.runner import bucket
        num_seqs = min(num_seqs, self.engine_cfg.max_num_seqs)
        max_total_len = min(max_total_len, self.engine_cfg.max_model_len)
        before = len(self.runner.compiled_shapes)
        first_width = self.pool.pages_needed(max_prompt_len)
        self.runner.warmup(num_seqs, max_prompt_len, first_width)
        batch_sizes = sorted({min(bucket(n), num_seqs) for n in range(1, num_seqs + 1)})
        width = bucket(first_width, 4)
        while True:
            for batch_size in batch_sizes:
                self.runner.warmup(batch_size, 1, width)
            if width >= self.pool.pages_needed(max_total_len):
                break
            width *= 2
        return len(self.runner.compiled_shapes) - before

    def finished_requests(self) -> list[Request]:
        """Requests finished since the last call, in finishing order (the list is cleared)."""
        done, self._finished = self._finished, []
        return done

    # ---- one step ---------------------------------------------------------------------------

    def _schedule(self) -> list[Request]:
        """Admits waiting requests for a prefill step if any fit; else decodes all running."""
        admitted = []
        free_pages = self.pool.num_free
        while self.waiting and len(self.running) + len(admitted) < self.engine_cfg.max_num_seqs:
            need = self.pool.pages_needed(self.waiting[0].num_tokens)
            if need > free_pages:
                break
            free_pages -= need
            admitted.append(self.waiting.pop(0))
        if admitted:
            self.running.extend(admitted)
            return admitted
        if self.waiting and not self.running:
            raise RuntimeError(f"KV cache too small: a prompt of {self.waiting[0].num_tokens} "
                               f"tokens needs more than the {self.pool.num_free} free pages")
        return list(self.running)

    def _build_batch(self, scheduled: list[Request]) -> StepBatch:
        counts = [r.num_tokens - r.num_computed_tokens for r in scheduled]
        for r in scheduled:
            self.pool.grow(r.pages, r.num_tokens)
        b, t = len(scheduled), max(counts)
        w = max(len(r.pages) for r in scheduled)
        token_ids = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        slots = np.full((b, t), -1, np.int32)
        tables = np.zeros((b, w), np.int32)
        for i, (r, n) in enumerate(zip(scheduled, counts)):
            pos = np.arange(r.num_computed_tokens, r.num_tokens, dtype=np.int32)
            pages = np.asarray(r.pages, np.int32)
            token_ids[i, :n] = r.token_ids[r.num_computed_tokens:]
            positions[i, :n] = pos
            slots[i, :n] = pages[pos // self.pool.page_size] * self.pool.page_size \
                + pos % self.pool.page_size
            tables[i, : len(pages)] = pages
        kv_lens = np.asarray([r.num_tokens for r in scheduled], np.int32)
        return StepBatch(token_ids, positions, slots, tables, kv_lens,
                         np.asarray(counts, np.int32) - 1)

    def step(self) -> list[StreamDelta]:
        """Runs one schedule -> run -> postprocess round; returns the new text of each request."""
        scheduled = self._schedule()
        batch = self._build_batch(scheduled)
        logits = self.runner.execute(batch)
        p = [r.params for r in scheduled]
        next_ids = self.runner.sample(
            logits, temperature=[x.temperature for x in p], top_k=[x.top_k for x in p],
            top_p=[x.top_p for x in p], seeds=[r.seed for r in scheduled],
            steps=[len(r.output_ids) for r in scheduled])
        now = time.perf_counter()
        deltas = []
        for r, token in zip(scheduled, next_ids.tolist()):
            r.num_computed_tokens = r.num_tokens
            r.output_ids.append(token)
            if r.first_token_time is None:
                r.first_token_time = now
            r.finish_reason = self._check_stop(r, token)
            if r.finished:
                r.finish_time = now
                self.pool.free(r.pages)
                r.pages = []
                self.running.remove(r)
                self._finished.append(r)
            deltas.append(self._delta(r, token))
        return deltas

    def _check_stop(self, r: Request, token: int) -> FinishReason | None:
        if (token in r.params.stop_token_ids
                or (not r.params.ignore_eos and token in self.cfg.eos_token_ids)):
            return FinishReason.STOP
        if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= self.engine_cfg.max_model_len:
            return FinishReason.LENGTH
        return None

    def _delta(self, r: Request, token: int) -> StreamDelta:
        """Incremental detokenization: never emits half of a multi-byte character."""
        text = ""
        if self.tokenizer is not None:
            full = self.tokenizer.decode(r.output_ids)
            if r.finished or not full.endswith("\ufffd"):
                previous = self._texts[r.request_id]
                text = full[len(previous):] if full.startswith(previous) else full
                self._texts[r.request_id] = full
        return StreamDelta(r.request_id, text, [token], r.finish_reason)

    # ---- whole generations --------------------------------------------------------------------

    def _add_all(self, prompts, params) -> list[Request]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        return [self.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]

    def stream(self, prompts: Sequence[Sequence[int] | str],
               params: SamplingParams | Sequence[SamplingParams]) -> Iterator[StreamDelta]:
        """Adds the prompts and yields each request's new text as its tokens arrive."""
        self._add_all(prompts, params)
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Runs the prompts to completion; returns one output per prompt, in order."""
        requests = self._add_all(prompts, params)
        while self.has_unfinished():
            self.step()
        self.finished_requests()
        return [self.output_of(r) for r in requests]

    def output_of(self, r: Request) -> RequestOutput:
        """The finished output of a request."""
        text = self._texts.pop(r.request_id, "")
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids)
        return RequestOutput(r.request_id, r.prompt_ids, list(r.output_ids), text,
                             r.finish_reason, r.first_token_time - r.arrival_time,
                             r.finish_time - r.arrival_time)
