"""The LLM engine loop: schedule -> run -> postprocess, over a shared paged KV cache.

`LLMEngine.step()` asks the scheduler which tokens of which requests to compute (decodes, prefill
chunks and prefix-cache hits mixed in one ragged batch), builds the step batch, runs one jitted
program (the model step and its argmax; batches with sampled rows add the sampler as a second
program, engine.sampling.sampling_mode), then appends the sampled tokens,
detokenizes incrementally, applies stop conditions and frees the pages of finished requests.
With asynchronous scheduling (EngineConfig.async_scheduling) the host does all that for step n
while the device runs step n+1, which reads its input tokens from step n's samples on the
device. Speculative rounds live in engine/spec_rounds.py.
"""
from __future__ import annotations

import concurrent.futures
import time
from typing import Iterator, Sequence

import numpy as np

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from engine.detokenizer import IncrementalDetokenizer
from engine.request import (CompletionOutput, FinishReason, Request, RequestOutput,
                            SamplingParams, logprob_entry)
from engine.runner import ModelRunner, StepBatch, fetch_samples, step_batch_from_arrays
from engine.sampling import SamplingArrays, draw_steps
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.engine_types import EngineConfig, EngineStats, InFlight, StreamDelta
from engine.multi_step import MultiStepRounds
from engine.spec_rounds import SpeculativeRounds
from engine.speculative import SpecConfig, SpecStats
from engine.warmup import reachable_steps


class LLMEngine(SpeculativeRounds, MultiStepRounds):
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
        self._dispatcher = (concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pallasite-dispatch")
            if engine_cfg.dispatch_thread and engine_cfg.async_scheduling else None)
        self._rng = np.random.default_rng(engine_cfg.seed)
        self._next_request = 0
        self._next_group = 0
        self._groups: dict[int, list[Request]] = {}
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._finished_groups: list[int] = []
        self._in_flight: InFlight | None = None  # the launched step not read yet
        self._penalized: set[int] = set()  # unfinished requests with penalties (synchronous)
        self._with_logprobs: set[int] = set()  # unfinished requests that want logprobs
        # Every stop id of every request added (only grows): appends look for these in the
        # tokens (_rows_that_may_stop), as a set and as an array.
        self._any_stop_ids: frozenset[int] = frozenset()
        self._any_stop_array = np.zeros(0, np.int64)
        self._admitted_last = False  # the last step admitted waiting requests (multi_step.py)
        self._wait_s = 0.0

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
        stop_ids = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else self.cfg.eos_token_ids)
        if not stop_ids <= self._any_stop_ids:
            self._any_stop_ids |= stop_ids
            self._any_stop_array = np.fromiter(self._any_stop_ids, np.int64)
        samples = []
        for index in range(params.n):
            seed = (params.seed + index) % 2**32 if params.seed is not None \
                else int(self._rng.integers(2**32))
            request = Request(self._next_request, list(prompt_ids), params, seed,
                              priority=priority, arrival_time=now, group_id=group_id,
                              sample_index=index, stop_ids=stop_ids)
            if self.spec_config is not None:  # start optimistic: k proposals
                request.spec_ema_accepted = float(self.spec_config.num_speculative_tokens)
            if params.uses_penalties:
                self._penalized.add(request.request_id)
            if params.logprobs is not None:
                self._with_logprobs.add(request.request_id)
            if index > 0 and self.engine_cfg.enable_prefix_caching:
                request.wait_for = samples[0]  # share the first sample's prompt pages
            self._next_request += 1
            samples.append(request)
        for request in samples:
            self.scheduler.add(request)
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
                self._penalized.discard(request.request_id)
                self._with_logprobs.discard(request.request_id)
        if request_id in self._groups and request_id not in self._finished_groups:
            self._finished_groups.append(request_id)

    def has_unfinished(self) -> bool:
        """Whether requests wait, run, or have tokens in flight."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Runs one schedule -> run -> postprocess round; returns the new text of each sample.

        With asynchronous scheduling (EngineConfig.async_scheduling) a round schedules and
        launches step n+1 before it reads the tokens of step n, which is still running: the
        host's scheduling, batch building and detokenization hide behind the device's work.
        Step n+1 reads the tokens step n sampled on the device; a request that step n ended
        (EOS, a stop string) computes one token too many, which is dropped. The deltas a round
        returns are step n's.
        """
        t0 = time.perf_counter()
        self._wait_s = 0.0
        self._round_steps = 1  # model steps of this round (a multi-step round sets more)
        overlap = self._can_overlap()
        try:
            num_seqs, deltas = self._round(overlap)
        except BaseException:
            self._in_flight = None  # a failed round leaves nothing in flight
            raise
        wall = time.perf_counter() - t0
        host = wall - self._wait_s
        self.stats.num_steps += 1
        self.stats.num_model_steps += self._round_steps
        self.stats.step_time_s += wall
        self.stats.host_time_s += host
        # The device idles during host work unless it was still busy when the host came to
        # wait: host time exposed (an upper bound when overlapping).
        exposed = host if not overlap or self._wait_s < 1e-4 else 0.0
        self.stats.exposed_host_time_s += exposed
        if self.stats.record_steps:
            self.stats.steps.append((num_seqs, host, wall, exposed, self._round_steps,
                                     self.scheduler.num_waiting))
        return deltas

    def _can_overlap(self) -> bool:
        """Asynchronous scheduling needs every token id on the host only for speculation and
        penalties (which count the output tokens)."""
        return (self.engine_cfg.async_scheduling and self.spec_config is None
                and self.runner.supports_async_scheduling and not self._penalized)

    def _round(self, overlap: bool) -> tuple[int, list[StreamDelta]]:
        """(sequences running after this round's scheduling, deltas) of one round; see
        `step`."""
        deltas = []
        had_in_flight = self._in_flight is not None
        if had_in_flight and not overlap:
            deltas = self._finish(self._in_flight)
            self._in_flight = None
        if self.spec_config is not None:
            launched, spec_deltas = self._speculative_step()
            return launched, deltas + spec_deltas
        # A request whose in-flight token ends it by length computes nothing more (synchronous
        # rounds have no token in flight: nothing to hold).
        rounds = self._rounds_possible() and self.engine_cfg.pause_admissions_for_rounds
        output = self.scheduler.schedule(self._context_limit() if overlap else None,
                                         admit=not (rounds and self._defer_admission()),
                                         whole_prompts=rounds)
        self._admitted_last = output.num_admitted > 0
        num_running = len(self.scheduler.running)  # held ones included: they keep their slots
        if self._multi_step_ready(output):
            launched = self._launch_round(output)
        elif self._mixed_round_ready(output):
            launched = self._launch_mixed_round(output)
        else:
            launched = self._launch(output) if output.entries else None
        if self._in_flight is not None:
            deltas += self._finish(self._in_flight)
        self._in_flight = launched
        if launched is not None and not overlap:
            deltas += self._finish(launched)
            self._in_flight = None
        if launched is None and not had_in_flight and self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler could schedule nothing although requests wait")
        return num_running, deltas

    def _launch(self, output: SchedulerOutput) -> InFlight:
        """Builds the step batch, runs the step and the sampler; does not wait for them."""
        prev = self._in_flight
        requests, completes, batch, sample_index, arrays, slots = self._step_inputs(output)

        def dispatch():
            results = self.runner.execute_and_sample(
                batch, arrays, None if prev is None else prev.next_inputs, sample_index)
            return results, results[0]

        return self._launched(output, requests, completes, self._dispatch(dispatch), 1, slots)

    def _launched(self, output: SchedulerOutput, requests: list[Request], completes: list[bool],
                  launch, steps: int, slots: np.ndarray) -> InFlight:
        """The bookkeeping of a launched step or round of `steps` model steps: each complete
        row (its step token is its request's next one) computes steps - 1 tokens more than its
        step's and leaves `steps` sampled tokens in flight; counters and cached pages advance.
        It notes which rows (at `slots` of the persistent rows) its tokens may end by length
        or bring their first token (InFlight.may_end), vectorized: once all the tokens in
        flight before it are appended, a row holds its scheduled total plus `steps`."""
        rows = self.scheduler.rows
        totals = output.columns()[2]  # [S]
        limits = np.minimum(rows.token_limits[slots], self._context_limit())
        may_end = (totals + steps >= limits) | (totals == rows.prompt_lens[slots])
        self.stats.num_computed_tokens += self.scheduler.update_computed(output, completes, steps)
        self._round_steps = steps
        return InFlight(requests, completes, launch, steps=steps, may_end=may_end)

    def _step_inputs(self, output: SchedulerOutput) -> tuple:
        """(requests, completes, StepBatch, sample_index, SamplingArrays, slots) of a scheduled
        step.
        completes[i]: request i's last token this step is its next one (its sample is a new
        token), not a prefill chunk short of the prompt's end."""
        requests = output.requests
        # Per row, as the scheduler recorded them (no Python pass over the rows): tokens
        # computed this step, first position, tokens in all and in flight, pages held.
        counts, firsts, totals, pendings = output.columns()  # [S] each
        knowns = totals - pendings  # [S] tokens the host has
        ends = firsts + counts
        completes = (ends >= totals).tolist()
        # A row whose last token is in flight reads it from prev's samples (a placeholder 0
        # here); the rest of its tokens, and every token of the other rows, the host has:
        # written row by row for the rows with such tokens only (prompts, mostly).
        in_flight = np.flatnonzero(ends > knowns)  # [F]
        starts = np.zeros(len(requests) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        num_tokens = int(starts[-1])
        tokens = np.zeros(num_tokens, np.int32)  # [N]
        upto = np.minimum(ends, knowns)
        for i in np.flatnonzero(upto > firsts).tolist():
            first, last = int(firsts[i]), int(upto[i])
            tokens[starts[i]:starts[i] + last - first] = requests[i].tokens_between(first, last)
        placeholders = starts[1:][in_flight] - 1
        sources = [requests[i].pending_row for i in in_flight.tolist()]
        # [S] rows of the persistent tables
        slots = self.scheduler.rows.slots(requests, output.held())
        batch = self._step_batch(slots, tokens, counts, firsts)
        sample_index = self._sample_index(num_tokens, placeholders, sources)
        return (requests, completes, batch, sample_index,
                self._sampling_arrays(requests, slots), slots)

    def _dispatch(self, dispatch):
        """dispatch()'s (results, next_inputs), or a Future of them made on the worker thread
        (EngineConfig.dispatch_thread), which runs dispatches in launch order: a dispatch that
        reads the step before's next_inputs finds that step dispatched."""
        if self._dispatcher is None:
            return dispatch()
        return self._dispatcher.submit(dispatch)

    def _sample_index(self, num_tokens: int, placeholders, sources: list[int]
                      ) -> np.ndarray | None:
        """int32 [num_tokens]: for the tokens at `placeholders` (indices), whose ids are still
        in flight, their rows `sources` in the in-flight step's samples; -1 for the host's ids.
        None when every id is on the host."""
        if len(placeholders) == 0:
            return None
        sample_index = np.full(num_tokens, -1, np.int32)
        sample_index[placeholders] = sources
        self.stats.num_tokens_from_device += len(placeholders)
        return sample_index

    def _step_batch(self, slots: np.ndarray, tokens, counts, firsts) -> StepBatch:
        """The StepBatch of rows `slots` of the persistent block tables computing `counts`
        tokens each from positions `firsts` (tokens: all rows' token ids, concatenated)."""
        rows = self.scheduler.rows
        num_pages = rows.num_pages[slots]  # [S]
        return step_batch_from_arrays(
            np.asarray(tokens, np.int32), np.asarray(counts, np.int32),
            np.asarray(firsts, np.int32), rows.tables[slots, : max(int(num_pages.max()), 1)],
            num_pages, self.pool.page_size)

    def _sampling_arrays(self, requests: list[Request], slots: np.ndarray) -> SamplingArrays:
        """The step's sampling arrays, gathered from the persistent rows (per request only when
        a request has penalties or logprobs, which need its tokens or more outputs)."""
        rows = self.scheduler.rows
        if self._penalized or rows.logprobs[slots].any():
            return SamplingArrays.from_requests(requests)
        table = rows.sampling[slots]  # [S, 5]
        sampled = (table[:, 0] > 0).any()  # greedy rows need no step index
        return SamplingArrays.from_rows(table, draw_steps(requests) if sampled
                                        else np.zeros(len(requests), np.int32))

    def _finish(self, flight: InFlight) -> list[StreamDelta]:
        """Reads a launched step's samples (waiting for the device) and appends them."""
        start = time.perf_counter()
        round_ = flight.steps > 1  # a round's results: (tokens [steps, bucket(S)],)
        samples = fetch_samples(flight.results, flight.steps if round_ else len(flight.requests))
        now = time.perf_counter()
        self._wait_s += now - start
        if round_:
            return self._append_round(flight, samples[0], now)
        return self._append_samples(flight, samples, now)

    def _append_samples(self, flight: InFlight, samples: tuple,
                        now: float) -> list[StreamDelta]:
        """Appends a launched step's samples (host arrays: tokens, chosen logprobs, top ids,
        top logprobs) to its requests; returns their deltas."""
        tokens, chosen, top_ids, top_logprobs = samples
        deltas = []
        limit = self._context_limit()
        detokenizers = self._detokenizers
        requests = flight.requests
        may_stop_rows = self._rows_that_may_stop(flight, tokens[: len(requests), None])
        for i, (request, complete, token, may_stop) in enumerate(zip(
                requests, flight.completes, tokens.tolist(), may_stop_rows)):
            if not complete:
                continue  # a prefill chunk short of the prompt's end
            request.num_pending -= 1
            if request.finish_reason is not None:
                continue  # ended or aborted while this step ran: the token is dropped
            if (not may_stop and chosen is None and request.first_token_time is not None
                    and request.request_id not in detokenizers):
                # The common case inlined (a decode token that does not stop the request,
                # no logprobs, no text, not the first): append it.
                request.output_ids.append(token)
                deltas.append(StreamDelta(request.group_id, request.sample_index, "",
                                          [token], None, None))
                continue
            logprob = (None if chosen is None else
                       logprob_entry(request, i, chosen, top_ids, top_logprobs))
            deltas.append(self._append_tokens(request, [token], logprob, now, limit))
        self.stats.num_generated_tokens += len(deltas)  # one token each
        return deltas

    def _rows_that_may_stop(self, flight: InFlight, block: np.ndarray) -> list[bool]:
        """Per row of a launched step or round (block: its tokens [S, k]), whether they may
        end its request: a stop id of any request (a superset of the row's own) among them, or
        the length or its first token (InFlight.may_end). The other rows are appended whole,
        with no stop check."""
        return (flight.may_end | np.isin(block, self._any_stop_array).any(axis=1)).tolist()

    def _append_tokens(self, request: Request, new_tokens: list[int], logprob,
                       now: float, limit: int) -> StreamDelta:
        """Appends a step's tokens to a request (stopping early at a stop condition); `limit`:
        the context limit (`_context_limit`, computed once per step by the caller)."""
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.first_token_time is None:
            request.first_token_time = now
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None and len(new_tokens) == 1:  # a decode step without text
            request.output_ids.append(new_tokens[0])
            reason = self._stop_reason(request, new_tokens[0], limit)
            text, appended = "", new_tokens
        elif detokenizer is None:  # several tokens without text: cut at the first that ends it
            # (what _stop_reason decides token by token: a stop id before the length)
            stop_ids = request.stop_ids
            at_stop = next((j for j, token in enumerate(new_tokens) if token in stop_ids), None)
            num_outputs = len(request.output_ids)
            at_length = max(min(request.params.max_tokens - num_outputs,  # length_room - 1
                                limit - len(request.prompt_ids) - num_outputs) - 1, 0)
            if at_stop is not None and at_stop <= at_length:
                end, reason = at_stop, FinishReason.STOP
            elif at_length < len(new_tokens):
                end, reason = at_length, FinishReason.LENGTH
            else:
                end, reason = None, None
            appended = new_tokens if end is None else new_tokens[: end + 1]
            request.output_ids += appended
            text = ""
        else:
            reason, text, appended = None, "", []
            for token in new_tokens:
                request.output_ids.append(token)
                appended.append(token)
                reason = self._stop_reason(request, token, limit)
                if detokenizer is not None:
                    text += detokenizer.add(request.output_ids, reason is not None)
                    if reason is None and detokenizer.stopped_at is not None:
                        reason = FinishReason.STOP
                if reason is not None:
                    break
        group_id = request.group_id
        if reason is not None:
            self.scheduler.finish(request, reason)
            self._penalized.discard(request.request_id)
            self._with_logprobs.discard(request.request_id)
            request.finish_time = now
            if all(r.finished for r in self._groups[group_id]):
                self._finished_groups.append(group_id)
        return StreamDelta(group_id, request.sample_index, text, appended, reason,
                           None if logprob is None else [logprob])

    def _context_limit(self) -> int:
        """The context ends at max_model_len or where it fills the whole KV cache: a sequence
        longer than the pool could never be scheduled again (the engine would stall)."""
        return min(self.engine_cfg.max_model_len, self.pool.num_pages * self.pool.page_size)

    def _stop_reason(self, r: Request, token: int, limit: int) -> FinishReason | None:
        if token in r.stop_ids:
            return FinishReason.STOP
        # Request.length_room(limit) <= 0, inlined: this runs for every token.
        num_outputs = len(r.output_ids)
        if num_outputs >= r.params.max_tokens or len(r.prompt_ids) + num_outputs >= limit:
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
        a run can reach (engine/warmup.py)."""
        return reachable_steps(self.engine_cfg, self.pool, self.runner.fixed_width,
                               self.spec_config, num_seqs, max_total_len, prompt_lens)

    def warmup(self, num_seqs: int | None = None, max_total_len: int | None = None,
               prompt_lens: list[int] | None = None, progress=None) -> int:
        """Compiles the programs of `warmup_shapes`; returns how many were new."""
        shapes = self.warmup_shapes(num_seqs, max_total_len, prompt_lens)
        before = len(self.runner.compiled_shapes)
        multi_steps = (self.engine_cfg.num_decode_steps if self.runner.supports_multi_step
                       and self.spec_config is None else 1)
        for i, (q_lens, width, verification) in enumerate(shapes):
            self.runner.warmup(q_lens, width, all_logits=verification, verification=verification)
            if multi_steps > 1 and max(q_lens) == 1 and not verification:
                self.runner.warmup_multi_step(len(q_lens), width, multi_steps,
                                              self.engine_cfg.unroll_decode_steps)
            if multi_steps > 1 and max(q_lens) > 1 and self.engine_cfg.mixed_rounds:
                self.runner.warmup_mixed_round(q_lens, width, multi_steps,
                                               self.engine_cfg.unroll_decode_steps)
            if progress is not None:
                progress(i + 1, len(shapes))
        self.runner.warmup_samplers()
        return len(self.runner.compiled_shapes) - before
