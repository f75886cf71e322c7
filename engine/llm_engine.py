"""The LLM engine loop: schedule -> run -> postprocess, over a shared paged KV cache.

`LLMEngine.step()` asks the scheduler which tokens of which requests to compute (decodes, prefill
chunks and prefix-cache hits mixed in one ragged batch), builds the step batch, runs one jitted
program (the model step and its argmax; batches with sampled rows add the sampler as a second
program, engine.sampling.sampling_mode), then hands the sampled tokens to the output processor
(engine/output_processor.py: appends, stop conditions, incremental detokenization, outputs) and
frees the pages of the requests that ended.
With asynchronous scheduling (EngineConfig.async_scheduling) the host does all that for step n
while the device runs step n+1, which reads its input tokens from step n's samples on the
device. Two components run other kinds of round: engine/spec_rounds.py (speculative decoding)
and engine/multi_step.py (several decode steps per program). The step inputs come from the
runner side's persistent input batch (engine/input_batch.py), never from the scheduler's
internals. A None field of EngineConfig takes the device's default (engine/engine_config.py).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Iterator, Sequence

import jax
import numpy as np

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from engine.draft import DraftProposer
from engine.engine_config import EngineConfig, resolve_engine_config
from engine.engine_types import EngineStats, InFlight, StreamDelta
from engine.input_batch import InputBatch, PreparedStep
from engine.memory import memory_pool_hint, plan_kv_cache
from engine.multi_step import MultiStepRounds
from engine.output_processor import OutputProcessor, stop_ids_of
from engine.request import FinishReason, Request, RequestOutput, SamplingParams
from engine.device_arrays import fetch_samples
from engine.runner import ModelRunner, model_dtype
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sharded_runner import sharded_engine_parts
from engine.spec_rounds import SpeculativeRounds
from engine.speculative import SpecConfig, SpecStats
from engine.warmup import (CompileQueue, compile_all, compile_program, compile_threads,
                           in_callers_context, program_label, reachable_steps, step_programs)
from models.longrope import uses_longrope
from ops.kv_quant import kv_cache_dtype

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "StreamDelta"]


class LLMEngine:
    """Runs many requests together over one model and one paged KV cache."""

    def __init__(self, cfg: ModelConfig, model, tokenizer=None,
                 engine_cfg: EngineConfig | None = None, spec_config: SpecConfig | None = None,
                 draft=None, mesh=None, platform: str | None = None):
        """draft: (ModelConfig, model) of the draft model when spec_config.method == 'draft'.
        engine_cfg: None fields (all, when None) take the defaults of `platform` (default: jax's
        backend), engine/engine_config.py; `self.engine_cfg` is the resolved config."""
        self.platform = platform or jax.default_backend()
        requested = engine_cfg or EngineConfig()
        if uses_longrope(cfg.rope_scaling):  # cached keys are rotated again: models/longrope.py
            if spec_config is not None:
                raise ValueError("speculative decoding is not supported for a LongRoPE model")
            requested = dataclasses.replace(requested, enable_prefix_caching=False)
        engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings, self.platform)
        make_runner = ModelRunner
        fit = requested.max_model_len is not None  # else the context follows the cache
        if mesh is None:
            num_pages = self._num_pages(cfg, model, engine_cfg, fit)
            pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
        else:  # sharded over a (data, model) mesh: engine/sharded_runner.py
            num_pages, pool, make_runner = sharded_engine_parts(
                mesh, cfg, engine_cfg, lambda c: self._num_pages(c, model, engine_cfg, fit))
        if not fit:  # the default context: the model's, as far as the cache holds it
            engine_cfg = resolve_engine_config(requested, cfg.max_position_embeddings,
                                               self.platform, num_pages * engine_cfg.page_size)
        self.cfg, self.tokenizer, self.engine_cfg, self.pool = cfg, tokenizer, engine_cfg, pool
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=engine_cfg.max_num_seqs,
                            max_num_batched_tokens=engine_cfg.max_num_batched_tokens,
                            max_model_len=engine_cfg.max_model_len,
                            enable_chunked_prefill=engine_cfg.enable_chunked_prefill), self.pool)
        max_width = self.pool.pages_needed(engine_cfg.max_model_len)
        self.runner = make_runner(cfg, model, num_pages, engine_cfg.page_size,
                                  engine_cfg.kv_cache_dtype, max_seqs=engine_cfg.max_num_seqs,
                                  max_width=max_width)
        # The runner side's persistent rows of the running requests (block tables, sampling
        # rows, length limits), kept up to date from each SchedulerOutput.
        self.input_batch = InputBatch(engine_cfg.max_num_seqs, max_width, engine_cfg.page_size)
        self.spec_config, self.spec_stats, self.draft = spec_config, SpecStats(), None
        self.spec: SpeculativeRounds | None = None
        if spec_config is not None:
            if spec_config.method == "draft" and draft is not None:
                draft_cfg, draft_model = draft
                if draft_cfg.vocab_size != cfg.vocab_size:
                    raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) "
                                     f"differs from the target's ({cfg.vocab_size})")
                self.draft = DraftProposer(draft_cfg, draft_model, num_pages,
                                           engine_cfg.page_size, engine_cfg.max_num_seqs,
                                           max_width, kernels=self.runner.kernels.per_shard(),
                                           kv_dtype=engine_cfg.kv_cache_dtype)
            self.spec = SpeculativeRounds(spec_config, self.runner, self.scheduler,
                                          self.input_batch, self.draft)
        self.rounds: MultiStepRounds | None = None
        if engine_cfg.num_decode_steps > 1 and spec_config is None:
            self.rounds = MultiStepRounds(engine_cfg.num_decode_steps, engine_cfg.mixed_rounds,
                                          engine_cfg.max_num_seqs, self.runner, self.scheduler,
                                          self.input_batch)
        settings = engine_cfg.summary()
        if engine_cfg.num_decode_steps > 1 and self.rounds is None:
            settings += " (taken as single steps: speculation)"
        self.kv_summary = f"{settings}\n{self._cache_summary(num_pages)}"
        self.stats = EngineStats()
        # (program_label, seconds on its compile thread) of every step program `warmup` compiled
        self.compile_seconds: list[tuple[str, float]] = []
        self._rng = np.random.default_rng(engine_cfg.seed)
        self._next_request = 0
        self._next_group = 0
        # The postprocess side: appends, stop conditions, detokenization, request outputs.
        self.output_processor = OutputProcessor(tokenizer, self._on_finish)
        self._in_flight: InFlight | None = None  # the launched step not read yet
        self._with_logprobs: set[int] = set()  # unfinished requests that want logprobs
        self._wait_s = 0.0
        self._round_steps = 1

    def _num_pages(self, cfg: ModelConfig, model, engine_cfg: EngineConfig, fit: bool) -> int:
        """The KV cache's pages (of one data shard) for a resolved config (see EngineConfig).
        With a memory fraction the plan must hold one sequence of max_model_len tokens if `fit`
        (a context asked for), else one page: the default context then follows the cache."""
        page_size, max_len = engine_cfg.page_size, engine_cfg.max_model_len
        self.cache_plan = None
        if engine_cfg.num_pages is not None:
            return engine_cfg.num_pages
        if engine_cfg.memory_fraction is None and engine_cfg.kv_cache_memory is None:
            return engine_cfg.max_num_seqs * -(-max_len // page_size)
        kv_dtype = kv_cache_dtype(engine_cfg.kv_cache_dtype, model_dtype(model))
        self.cache_plan = plan_kv_cache(
            cfg, kv_dtype, page_size, max_len, engine_cfg.max_num_batched_tokens,
            engine_cfg.max_num_seqs, engine_cfg.memory_fraction, fit_max_model_len=fit,
            kv_cache_memory=engine_cfg.kv_cache_memory)
        return self.cache_plan.num_pages

    def _cache_summary(self, num_pages: int) -> str:
        """The KV cache's line of the start-up summary (of the resolved context)."""
        page_size, max_len = self.engine_cfg.page_size, self.engine_cfg.max_model_len
        if self.cache_plan is not None:
            summary = dataclasses.replace(self.cache_plan, max_model_len=max_len).summary()
            hint = (memory_pool_hint(jax.default_backend(), os.environ)
                    if self.cache_plan.fixed_bytes is None else None)
            return summary if hint is None else f"{summary}; {hint}"
        return (f"KV cache ({self.runner.kv_dtype.name}): {num_pages} pages x {page_size} "
                f"tokens = {num_pages * page_size} tokens; at most "
                f"{num_pages // -(-max_len // page_size)} sequences of {max_len} tokens at once")

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int] | str, params: SamplingParams,
                    priority: int = 0) -> int:
        """Queues a prompt (token ids, or text when the engine has a tokenizer); returns its id.
        Raises ValueError for a prompt or stop id the engine cannot take, changing nothing."""
        prompt_ids = self._validated_prompt(prompt)
        stop_ids = stop_ids_of(params, self.cfg.eos_token_ids, self.cfg.vocab_size)
        group_id = self._next_group
        now = time.perf_counter()
        samples = []
        for index in range(params.n):
            seed = (params.seed + index) % 2**32 if params.seed is not None \
                else int(self._rng.integers(2**32))
            request = Request(self._next_request + index, list(prompt_ids), params, seed,
                              priority=priority, arrival_time=now, group_id=group_id,
                              sample_index=index, stop_ids=stop_ids)
            if self.spec is not None:
                self.spec.admit(request)
            if index > 0 and self.engine_cfg.enable_prefix_caching:
                request.wait_for = samples[0]  # share the first sample's prompt pages
            samples.append(request)
        # The first add raises if the prompt can never fit the pool (the samples share it),
        # before any of the engine's sets changes.
        for request in samples:
            self.scheduler.add(request)
        self._next_group += 1
        self._next_request += params.n
        for request in samples:
            if params.logprobs is not None:
                self._with_logprobs.add(request.request_id)
        self.output_processor.add(group_id, samples)
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
        self.output_processor.abort(request_id, time.perf_counter())

    def _on_finish(self, request: Request, reason: FinishReason) -> None:
        """A request ended (an appended token, a stop string, an abort): frees its pages."""
        self.scheduler.finish(request, reason)
        self._with_logprobs.discard(request.request_id)

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
        """Asynchronous scheduling needs every token id on the host only for speculation
        (penalties count the output tokens on the device: engine/penalty_counts.py)."""
        return (self.engine_cfg.async_scheduling and self.spec is None
                and self.runner.supports_async_scheduling)

    def _round(self, overlap: bool) -> tuple[int, list[StreamDelta]]:
        """(sequences running after this round's scheduling, deltas) of one round; see
        `step`."""
        deltas = []
        had_in_flight = self._in_flight is not None
        if had_in_flight and not overlap:
            deltas = self._finish(self._in_flight)
            self._in_flight = None
        if self.spec is not None:
            launched, spec_deltas = self._speculative_round()
            return launched, deltas + spec_deltas
        # A request whose in-flight token ends it by length computes nothing more (synchronous
        # rounds have no token in flight: nothing to hold).
        output = self.scheduler.schedule(self._context_limit() if overlap else None)
        self.input_batch.update(output)
        num_running = len(self.scheduler.running)  # held ones included: they keep their slots
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
        """Runs the scheduled step (as a multi-step round where one can run: self.rounds),
        without waiting for it; returns its InFlight."""
        prev = self._in_flight
        prev_inputs = None if prev is None else prev.next_inputs
        limit = self._context_limit()
        kind = (self.rounds.ready(output, limit, bool(self._with_logprobs))
                if self.rounds is not None else None)
        step = results = None
        if kind is not None:  # (a round whose program is compiling launches nothing)
            step, results, next_inputs = self.rounds.launch(kind, output, prev_inputs)
            steps = self.rounds.num_steps
        if results is None:
            step = step if step is not None else self.input_batch.prepare(output)
            results = self.runner.execute_and_sample(step.batch, step.arrays, prev_inputs,
                                                     step.sample_index)
            next_inputs, steps = results[0], 1
        self.stats.num_tokens_from_device += step.num_from_device
        return self._launched(output, step, results, next_inputs, steps, limit)

    def _launched(self, output: SchedulerOutput, step: PreparedStep, results, next_inputs,
                  steps: int, limit: int) -> InFlight:
        """The bookkeeping of a launched step or round of `steps` model steps: each complete
        row (its step token is its request's next one) computes steps - 1 tokens more than its
        step's and leaves `steps` sampled tokens in flight; counters and cached pages advance.
        It notes which rows its tokens may end by length or bring their first token
        (InFlight.may_end), vectorized: once all the tokens in flight before it are appended,
        a row holds its scheduled total plus `steps`."""
        may_end = self.input_batch.may_end(step.slots, output.columns()[2], steps, limit)
        self.stats.num_computed_tokens += self.scheduler.update_computed(
            output, step.completes, steps)
        self._round_steps = steps
        return InFlight(step.requests, step.completes, results, next_inputs, steps, may_end)

    def _speculative_round(self) -> tuple[int, list[StreamDelta]]:
        """One synchronous speculative round (self.spec); returns (sequences run, deltas)."""
        limit = self._context_limit()
        spec_round = self.spec.step(limit, self.spec_stats)
        if spec_round is None:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could schedule nothing although requests wait")
            return 0, []
        self._wait_s += spec_round.wait_s
        requests = spec_round.requests
        self.stats.num_computed_tokens += spec_round.num_computed
        deltas, num_tokens = self.output_processor.append_each(
            requests, spec_round.new_tokens, spec_round.logprobs, spec_round.now, limit)
        self.stats.num_generated_tokens += num_tokens
        return len(requests), deltas

    def _finish(self, flight: InFlight) -> list[StreamDelta]:
        """Reads a launched step's samples (waiting for the device) and appends them."""
        start = time.perf_counter()
        round_ = flight.steps > 1  # a round's results: (tokens [steps, bucket(S)],)
        samples = fetch_samples(flight.results, flight.steps if round_ else len(flight.requests))
        now = time.perf_counter()
        self._wait_s += now - start
        limit = self._context_limit()
        if round_:
            deltas, num_tokens = self.output_processor.append_round(flight, samples[0], now,
                                                                    limit)
        else:
            deltas, num_tokens = self.output_processor.append_step(flight, samples, now, limit)
        self.stats.num_generated_tokens += num_tokens
        return deltas

    def _context_limit(self) -> int:
        """The context ends at max_model_len or where it fills the whole KV cache: a sequence
        longer than the pool could never be scheduled again (the engine would stall)."""
        return min(self.engine_cfg.max_model_len, self.pool.num_pages * self.pool.page_size)

    # ---- outputs and whole generations ----------------------------------------------------------

    def finished_request_ids(self) -> list[int]:
        """Ids of requests finished (or aborted) since the last call (the list is cleared)."""
        return self.output_processor.finished_request_ids()

    def output_of(self, request_id: int, release: bool = True) -> RequestOutput:
        """The output of a finished request; with `release`, the engine forgets the request."""
        return self.output_processor.output_of(request_id, release)

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

    def warmup_programs(self, num_seqs: int | None = None, max_total_len: int | None = None,
                        prompt_lens: list[int] | None = None,
                        sampled: bool = True, penalized: bool = False) -> list[tuple]:
        """The programs a run can reach (engine/warmup.py): (tokens of each sequence,
        block-table width, verification?, program) of every reachable step; without `sampled`,
        no rounds of rows that sample; with `penalized`, the rounds of penalized rows too."""
        runner = self.runner
        steps = reachable_steps(self.engine_cfg, self.pool, runner.min_width, self.spec_config,
                                num_seqs, max_total_len, prompt_lens,
                                runner.prefill_width if runner.prefill_widens else None,
                                runner.fixed_width, runner.counts_prefill_seqs)
        rounds = self.rounds
        return step_programs(steps, rounds.num_steps if rounds is not None else 1,
                             rounds is not None and rounds.mixed_rounds, sampled, penalized)

    def draft_steps(self, max_total_len: int | None = None,
                    without_prefill: bool = False) -> list[tuple[list[int], int, bool]]:
        """The steps a draft model runs (as `reachable_steps`): decode steps and catch-ups of
        the target's verification length for up to spec max_batch sequences and, unless
        `without_prefill`, the chunks of a long catch-up (DraftProposer.catch_up)."""
        draft = self.draft.runner
        steps = reachable_steps(self.engine_cfg, self.pool, draft.min_width, self.spec_config,
                                self.spec_config.max_batch, max_total_len, None,
                                draft.prefill_width if draft.prefill_widens else None,
                                draft.fixed_width, draft.counts_prefill_seqs)
        return [step for step in steps
                if not without_prefill or step[2] or max(step[0]) == 1]

    def warmup(self, num_seqs: int | None = None, max_total_len: int | None = None,
               prompt_lens: list[int] | None = None, progress=None,
               programs: list | None = None, samplers: bool = True,
               penalties: bool = False) -> int:
        """Compiles the programs of `warmup_programs` (or `programs`, some of them: a server's
        engine.warmup.split_first) and, with `samplers`, the sampler programs of sampled rows
        (a greedy run needs none, nor `warmup_programs`' sampled rounds), with `penalties`
        those of penalized rows and their rounds (a server compiles the samplers in the
        background and a round on demand: `compile_in_background`), and the scatter of tables
        kept on the device; returns how many step programs were new, `warmup_threads` at
        once."""
        if programs is None:
            programs = self.warmup_programs(num_seqs, max_total_len, prompt_lens,
                                            sampled=samplers, penalized=penalties)
        before = len(self.runner.compiled_shapes)
        jobs = [(self._compile_program, program) for program in programs]
        verification_rows = sorted({len(q_lens) for q_lens, _, verification, _ in programs
                                    if verification})
        if self.spec is not None:  # the acceptance of each verification step's rows
            jobs += [(self.spec.warmup, (rows,)) for rows in verification_rows]
        if self.draft is not None and verification_rows:
            jobs += [(self.draft.warmup, step + (self.spec_config.num_speculative_tokens,))
                     for step in self.draft_steps(max_total_len, prompt_lens is not None)]
            if self.draft.runner.tables is not None:
                jobs.append((self.draft.runner.tables.compile, ()))
        if samplers:
            jobs += [(self.runner.warmup_sampler, shape) for shape in self.runner.sampler_shapes()]
        if penalties:
            jobs += [(self.runner.warmup_penalty_sampler, shape)
                     for shape in self.runner.penalty_sampler_shapes()]
        if self.runner.tables is not None:  # the scatter that keeps the device's tables
            jobs.append((self.runner.tables.compile, ()))
        seconds = compile_all(lambda compile_one, shape: compile_one(*shape), jobs,
                              self.warmup_threads, progress)
        self.compile_seconds += [(program_label(program), s)
                                 for program, s in zip(programs, seconds)]
        return len(self.runner.compiled_shapes) - before

    @property
    def warmup_threads(self) -> int:
        """How many programs `warmup` compiles at once: EngineConfig.compile_threads, by default
        engine.warmup.compile_threads(); 1 for a runner that warms up by running steps."""
        if not self.runner.compiles_ahead:
            return 1
        return self.engine_cfg.compile_threads or compile_threads()

    @property
    def background_threads(self) -> int:
        """How many programs `compile_in_background` compiles at once: half of
        `warmup_threads` beside a GPU's steps, which leave the host's cores idle (llama3.2-1b's
        78 background programs: 52 s at 8 at once, 132 s on one thread; docs/PERFORMANCE.md);
        one on the CPU, whose cores run the steps."""
        if self.platform == "cpu":
            return 1
        return max(1, self.warmup_threads // 2)

    def _compile_program(self, q_lens, width: int, verification: bool, program: str) -> None:
        """One of `warmup_programs`' programs (engine.warmup.compile_program)."""
        rounds = self.rounds
        compile_program(self.runner, q_lens, width, verification, program,
                        rounds.num_steps if rounds is not None else 1)

    def compile_in_background(self, programs: list, log=None) -> threading.Thread:
        """Starts a daemon thread that compiles `programs` (of `warmup_programs`), then the
        samplers of penalties (`penalty_sampler_shapes`), ahead of time, `background_threads`
        at once, beside the engine's steps (the runner lowers them from shapes alone, or on a
        mesh runs the samplers on zero logits; never touching the weights' or cache's buffers)
        and returns it; log(line) hears when it starts and ends, or the first failure. From
        then on the rounds of penalized rows compile on demand on another such thread
        (engine/multi_step.py). A step that reaches one of them before the thread does compiles
        it on the spot. ValueError when programs are given to a runner that warms up by running
        steps (scripts/lower.py's). A process must not exit while the thread is inside XLA's
        compiler (it crashes): join it, or leave by os._exit as scripts.serve does."""
        if programs and not self.runner.compiles_ahead:
            raise ValueError("compile_in_background: this runner compiles by running steps, "
                             "which cannot run beside the engine's")
        log = log or (lambda line: None)

        penalties = self.runner.penalty_sampler_shapes() if programs else []
        if self.rounds is not None and self.runner.compiles_ahead:
            self.rounds.compile_later = CompileQueue(
                self._compile_program, log,
                lambda p: f"the {p[3]} round of {len(p[0])} sequences, {sum(p[0])} tokens").ask
        jobs = ([(self._compile_program, program) for program in programs]
                + [(self.runner.warmup_penalty_sampler, shape) for shape in penalties])
        threads = self.background_threads

        def run():
            start = time.perf_counter()
            try:
                compile_all(lambda compile_one, shape: compile_one(*shape), jobs, threads)
            except Exception as e:  # the steps that reach a missing program compile it
                log(f"compiling in the background failed: {type(e).__name__}: {e}")
                return
            if jobs:
                log(f"compiled {len(jobs)} more programs in the background in "
                    f"{time.perf_counter() - start:.1f}s")

        if jobs:
            log(f"compiling {len(jobs)} more programs in the background, {threads} at once "
                "(longer contexts, several prompts per step, rounds of rows that sample, "
                "penalties)")
        thread = threading.Thread(target=in_callers_context(run), name="compile-in-background",
                                  daemon=True)
        thread.start()
        return thread
