"""The LLM engine loop: schedule -> run -> postprocess, over a shared paged KV cache.

`LLMEngine.step()` asks the scheduler which tokens of which requests to compute (decodes, prefill
chunks and prefix-cache hits mixed in one ragged batch), builds the step batch, runs one jitted
model step and one jitted sampler, then appends the sampled tokens, detokenizes incrementally,
applies stop conditions and frees the pages of finished requests.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from engine.detokenizer import IncrementalDetokenizer
from engine.request import (CompletionOutput, FinishReason, Request, RequestOutput,
                            SamplingParams)
from engine.runner import ModelRunner, StepBatch, bucket, make_step_batch
from engine.sampling import SamplingArrays
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.speculative import SpecConfig, SpecStats, propose_ngram, verify


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
                 engine_cfg: EngineConfig = EngineConfig(), spec_config: SpecConfig | None = None,
                 draft=None, mesh=None):
        """draft: (ModelConfig, model) of the draft model when spec_config.method == 'draft'."""
        if engine_cfg.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={engine_cfg.max_model_len} exceeds the model's "
                             f"context of {cfg.max_position_embeddings} tokens")
        self.cfg, self.tokenizer, self.engine_cfg = cfg, tokenizer, engine_cfg
        make_runner = ModelRunner
        if mesh is None:
            num_pages = self._num_pages(cfg, model, engine_cfg)
            self.pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
        else:  # sharded over a (data, model) mesh: engine/sharded_runner.py
            from engine.sharded_runner import sharded_engine_parts
            num_pages, self.pool, make_runner = sharded_engine_parts(
                mesh, cfg, engine_cfg, lambda c: self._num_pages(c, model, engine_cfg))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=engine_cfg.max_num_seqs,
                            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
                            max_model_len=engine_cfg.max_model_len,
                            enable_chunked_prefill=engine_cfg.enable_chunked_prefill), self.pool)
        max_width = self.pool.pages_needed(engine_cfg.max_model_len)
        self.runner = make_runner(cfg, model, num_pages, engine_cfg.page_size,
                                  max_seqs=engine_cfg.max_num_seqs, max_width=max_width)
        self.spec_config, self.spec_stats, self.draft = spec_config, SpecStats(), None
        if spec_config is not None and spec_config.method == "draft":
            if draft is None:
                raise ValueError("speculative method 'draft' needs a draft model (--draft_model)")
            draft_cfg, draft_model = draft
            if draft_cfg.vocab_size != cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) differs "
                                 f"from the target's ({cfg.vocab_size})")
            from engine.draft import DraftProposer
            self.draft = DraftProposer(draft_cfg, draft_model, num_pages, engine_cfg.page_size,
                                       engine_cfg.max_num_seqs, max_width)
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
            if self.spec_config is not None:  # start optimistic: k proposals
                request.spec_ema_accepted = float(self.spec_config.num_speculative_tokens)
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
        rows = []
        for it in output.scheduled:
            r, first = it.request, it.request.num_computed_tokens
            tokens = r.token_ids[first:first + it.num_new_tokens - len(r.spec_tokens)]
            rows.append((tokens + r.spec_tokens, first, r.pages))
        return make_step_batch(rows, self.pool.page_size)

    def step(self) -> list[StreamDelta]:
        """Runs one schedule -> run -> postprocess round; returns the new text of each sample."""
        t0 = time.perf_counter()
        if self.spec_config is not None:
            self._plan_speculation()
        output = self.scheduler.schedule()
        if not output.scheduled:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could schedule nothing although requests wait")
            return []
        requests = [it.request for it in output.scheduled]
        for r in requests:  # the scheduler may have cut the lookahead to the token budget, or
            r.spec_tokens = r.spec_tokens[: r.lookahead]  # to 0 (a preempted, readmitted request)
        spec_rows = [i for i, r in enumerate(requests) if r.lookahead > 0]
        draft_probs = self._propose(output, spec_rows) if spec_rows else None
        batch = self._build_batch(output)
        batch.verification = bool(spec_rows)
        t1 = time.perf_counter()
        if spec_rows:
            all_logits = self.runner.execute_all_logits(batch)  # [N, V]
            logits = all_logits[jnp.asarray(batch.logits_indices)]
            accepted, spec_tokens = self._verify(all_logits, batch, requests, draft_probs)
        else:
            logits = self.runner.execute_padded(batch)
        tokens, chosen, top_ids, top_logprobs = self.runner.sample(
            logits, SamplingArrays.from_requests(requests))  # waits for the device
        t2 = time.perf_counter()
        new_tokens = []
        for i, it in enumerate(output.scheduled):
            r = it.request
            complete = r.num_computed_tokens + it.num_new_tokens >= r.num_tokens + len(r.spec_tokens)
            if not complete:
                new_tokens.append([])  # a prefill chunk short of the prompt's end
            elif r.spec_tokens:
                a = int(accepted[i])
                new_tokens.append(spec_tokens[i, : a + 1].tolist())
                self._after_verification(r, it, a)
            else:
                new_tokens.append([int(tokens[i])])
        self.scheduler.update_computed(output)
        deltas = []
        for i, request in enumerate(requests):
            if not new_tokens[i]:
                continue
            logprob = None
            if chosen is not None and request.params.logprobs is not None:
                k = request.params.logprobs
                logprob = (float(chosen[i]), dict(zip(top_ids[i, :k].tolist(),
                                                      top_logprobs[i, :k].tolist())))
            deltas.append(self._append_tokens(request, new_tokens[i], logprob, t2))
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += output.num_tokens
        self.stats.num_generated_tokens += sum(len(d.token_ids) for d in deltas)
        t3 = time.perf_counter()
        self.stats.step_time_s += t3 - t0
        host = (t1 - t0) + self.runner.last_prepare_s + (t3 - t2)
        self.stats.host_time_s += host
        if self.stats.record_steps:
            self.stats.steps.append((len(requests), host, t3 - t0))
        return deltas

    # ---- speculative decoding ---------------------------------------------------------------

    def _plan_speculation(self) -> None:
        """Sets each running request's lookahead (and n-gram proposals) for this step."""
        spec = self.spec_config
        running = self.scheduler.running
        enabled = len(running) <= spec.max_batch
        for r in running:
            r.lookahead, r.spec_tokens = 0, []
            if (not enabled or r.num_tokens - r.num_computed_tokens != 1
                    or r.params.uses_penalties or r.params.logprobs is not None):
                continue
            if r.spec_ema_accepted < 0.2 and len(r.output_ids) % 4:
                continue  # proposals keep failing: only probe every fourth token
            # Within max_tokens and the context (as _stop_reason): a lookahead past the whole
            # pool's pages would make the request preempt itself, and the step stall.
            limit = min(self.engine_cfg.max_model_len, self.pool.num_pages * self.pool.page_size)
            room = min(r.params.max_tokens - len(r.output_ids) - 1, limit - r.num_tokens - 1)
            k = min(room, spec.num_speculative_tokens,
                    max(1, math.ceil(r.spec_ema_accepted) + 1))
            if k <= 0:
                continue
            if spec.method == "ngram":
                r.spec_tokens = propose_ngram(r.token_ids, k, spec.ngram_min, spec.ngram_max)
                k = len(r.spec_tokens)
            r.lookahead = k

    def _propose(self, output: SchedulerOutput, spec_rows: list[int]):
        """Fills the speculating requests' proposals (draft model); returns q [S, K, V] or None."""
        items = [output.scheduled[i] for i in spec_rows]
        if self.draft is None:
            return None
        requests = [it.request for it in items]
        proposals, q = self.draft.propose(requests, max(r.lookahead for r in requests))
        for r, proposal in zip(requests, proposals):
            r.spec_tokens = proposal
        rows = bucket(len(output.scheduled))
        k = self.spec_config.num_speculative_tokens
        full = jnp.zeros((rows, k, q.shape[-1]), q.dtype)
        return full.at[jnp.asarray(spec_rows), : q.shape[1]].set(q)

    def _verify(self, all_logits, batch: StepBatch, requests: list[Request], draft_probs):
        """Exact acceptance of every speculating row's proposal (engine/speculative.py)."""
        k = self.spec_config.num_speculative_tokens
        rows = bucket(len(requests))
        ends = batch.query_start_loc[1:] - 1  # each row's last token
        num_draft = np.zeros(rows, np.int32)
        draft_tokens = np.zeros((rows, k), np.int32)
        for i, r in enumerate(requests):
            num_draft[i] = len(r.spec_tokens)
            draft_tokens[i, : len(r.spec_tokens)] = r.spec_tokens
        index = np.zeros((rows, k + 1), np.int32)
        index[: len(requests)] = np.minimum(
            (ends - num_draft[: len(requests)])[:, None] + np.arange(k + 1), ends[:, None])
        arrays = SamplingArrays.from_requests(requests).padded(rows)
        accepted, tokens = verify(
            all_logits[jnp.asarray(index)], jnp.asarray(draft_tokens), jnp.asarray(num_draft),
            draft_probs, *(jnp.asarray(a) for a in (arrays.temperature, arrays.top_k,
                                                    arrays.top_p, arrays.min_p, arrays.seeds,
                                                    arrays.steps)))
        return np.asarray(accepted), np.asarray(tokens)

    def _after_verification(self, r: Request, item, accepted: int) -> None:
        """Moves the counters past the accepted tokens only: the rejected ones' K/V is garbage
        that later tokens overwrite (the rollback), and adapts the request's k."""
        item.num_new_tokens = item.num_new_tokens - len(r.spec_tokens) + accepted
        self.spec_stats.record(len(r.spec_tokens), accepted)
        r.spec_ema_accepted = 0.7 * r.spec_ema_accepted + 0.3 * accepted
        r.num_draft_computed = min(r.num_draft_computed,
                                   r.num_computed_tokens + item.num_new_tokens)
        r.spec_tokens, r.lookahead = [], 0

    def _append_tokens(self, request: Request, new_tokens: list[int], logprob,
                       now: float) -> StreamDelta:
        """Appends a step's tokens to a request (stopping early at a stop condition)."""
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        reason, text, appended = None, "", []
        detokenizer = self._detokenizers.get(request.request_id)
        for token in new_tokens:
            request.output_ids.append(token)
            appended.append(token)
            reason = self._stop_reason(request, token)
            if detokenizer is not None:
                text += detokenizer.add(request.output_ids, reason is not None)
                if reason is None and detokenizer.stopped_at is not None:
                    reason = FinishReason.STOP
            if reason is not None:
                break
        group_id = self._group_of[request.request_id]
        if reason is not None:
            self.scheduler.finish(request, reason)
            request.finish_time = now
            if all(r.finished for r in self._groups[group_id]):
                self._finished_groups.append(group_id)
        index = self._groups[group_id].index(request)
        return StreamDelta(group_id, index, text, appended, reason,
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
                      prompt_lens: list[int] | None = None) -> list[tuple[list[int], int, bool]]:
        """The steps (tokens of each sequence, block-table width, verification?) whose programs
        a run can reach.

        Decode steps: every batch bucket up to num_seqs times every page-width bucket up to
        max_total_len; with speculation, the same with k + 1 tokens per sequence. Prefill steps:
        every token bucket up to the step's token budget times every bucket of the number of
        prefilling sequences; or, given the `prompt_lens` of a run whose prompts all start at
        once, that first step only.
        """
        from engine.runner import MIN_PAGE_BUCKET, MIN_TOKEN_BUCKET, bucket
        cfg = self.engine_cfg
        num_seqs = min(num_seqs or cfg.max_num_seqs, cfg.max_num_seqs)
        max_total_len = min(max_total_len or cfg.max_model_len, cfg.max_model_len)
        seq_buckets = sorted({bucket(n) for n in range(1, num_seqs + 1)})
        widths = sorted({bucket(self.pool.pages_needed(n), MIN_PAGE_BUCKET)
                         for n in range(1, max_total_len + 1, self.pool.page_size)})
        if self.runner.fixed_width:
            widths = widths[-1:]
        shapes = [([1] * s, w, False) for s in seq_buckets for w in widths]
        if self.spec_config is not None:
            k1 = self.spec_config.num_speculative_tokens + 1
            shapes += [([k1] * s, w, True) for s in seq_buckets
                       if s <= bucket(self.spec_config.max_batch) for w in widths]
        if prompt_lens is not None:
            budget = cfg.max_num_batched_tokens
            return shapes + [([min(n, budget) for n in prompt_lens], 1, False)]
        token_buckets = sorted({bucket(n, MIN_TOKEN_BUCKET)
                                for n in range(2, cfg.max_num_batched_tokens + 1)})
        for n in token_buckets:
            for p in seq_buckets:
                if 2 * p <= n:
                    q_lens = [2] * p
                    q_lens[0] = n - 2 * (p - 1)
                    shapes.append((q_lens, 1, False))
        return shapes

    def warmup(self, num_seqs: int | None = None, max_total_len: int | None = None,
               prompt_lens: list[int] | None = None, progress=None) -> int:
        """Compiles the programs of `warmup_shapes`; returns how many were new."""
        shapes = self.warmup_shapes(num_seqs, max_total_len, prompt_lens)
        before = len(self.runner.compiled_shapes)
        for i, (q_lens, width, verification) in enumerate(shapes):
            self.runner.warmup(q_lens, width, all_logits=verification, verification=verification)
            if progress is not None:
                progress(i + 1, len(shapes))
        return len(self.runner.compiled_shapes) - before
