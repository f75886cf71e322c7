"""Speculative rounds: proposals (n-gram or draft model), one verification step over every
proposed token, exact acceptance (engine/speculative.py).

A component of LLMEngine: `step` schedules, proposes, verifies and advances the counters, and
returns each row's new tokens; the engine appends them. Speculative rounds run synchronously:
the proposals need the last token of every request on the host.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax.numpy as jnp
import numpy as np

from engine.draft import DraftProposer
from engine.request import Request
from engine.runner import ModelRunner, fetch_samples
from engine.step_batch import StepBatch, bucket, make_step_batch
from engine.sampling import SamplingArrays
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative import SpecConfig, SpecStats, propose_ngram, verify


@dataclasses.dataclass
class SpecRound:
    """What a speculative round computed: per scheduled row its new tokens (none for a prefill
    chunk short of the prompt's end), and the samples' logprob arrays (chosen, top ids, top
    logprobs; None without logprobs) for engine.request.logprob_entry."""

    requests: list[Request]
    new_tokens: list[list[int]]
    num_computed: int  # tokens computed and kept (the rejected proposals' rolled back)
    logprobs: tuple
    wait_s: float  # the host's wait for the device
    now: float  # when the tokens arrived


class SpeculativeRounds:
    """Runs each engine step as a speculative round (see the module docstring)."""

    def __init__(self, spec_config: SpecConfig, runner: ModelRunner, scheduler: Scheduler,
                 page_size: int, draft: DraftProposer | None = None):
        if spec_config.method == "draft" and draft is None:
            raise ValueError("speculative method 'draft' needs a draft model (--draft_model)")
        self.spec_config, self.runner, self.scheduler = spec_config, runner, scheduler
        self.page_size, self.draft = page_size, draft

    def admit(self, request: Request) -> None:
        """Prepares a new request for speculation: it starts optimistic (k proposals)."""
        request.spec_ema_accepted = float(self.spec_config.num_speculative_tokens)

    def step(self, context_limit: int, stats: SpecStats) -> SpecRound | None:
        """One synchronous round: proposals, one verification step, exact acceptance, the
        computed counters advanced; None when nothing could be scheduled. stats: where the
        drafted and accepted tokens are counted."""
        self.plan(context_limit)
        output = self.scheduler.schedule()
        if not output.entries:
            return None
        requests = output.requests
        for r in requests:  # the scheduler may have cut the lookahead to the token budget, or
            r.spec_tokens = r.spec_tokens[: r.lookahead]  # to 0 (a preempted, readmitted request)
        spec_rows = [i for i, r in enumerate(requests) if r.lookahead > 0]
        draft_probs = self.propose(output, spec_rows) if spec_rows else None
        batch = self._build_batch(output)
        batch.verification = bool(spec_rows)
        arrays = SamplingArrays.from_requests(requests)
        if spec_rows:
            all_logits = self.runner.execute_all_logits(batch)  # [N, V]
            logits = all_logits[jnp.asarray(batch.logits_indices)]
            accepted, spec_tokens = self.accept(all_logits, batch, requests, draft_probs)
            results = self.runner.sample_device(logits, arrays)
        else:
            results = self.runner.execute_and_sample(batch, arrays)
        wait_start = time.perf_counter()
        tokens, chosen, top_ids, top_logprobs = fetch_samples(results, len(requests))
        now = time.perf_counter()
        new_tokens = []
        for i, (r, count) in enumerate(zip(requests, output.counts)):
            complete = r.num_computed_tokens + count >= r.num_tokens + len(r.spec_tokens)
            if not complete:
                new_tokens.append([])  # a prefill chunk short of the prompt's end
            elif r.spec_tokens:
                a = int(accepted[i])
                new_tokens.append(spec_tokens[i, : a + 1].tolist())
                self.after_verification(r, output, i, a, stats)
            else:
                new_tokens.append([int(tokens[i])])
        self.scheduler.update_computed(output)
        return SpecRound(requests, new_tokens, output.num_tokens,
                         (chosen, top_ids, top_logprobs), now - wait_start, now)

    def _build_batch(self, output: SchedulerOutput) -> StepBatch:
        """The step batch of a speculative round: each row's known tokens and its proposals."""
        rows = []
        for r, count in zip(output.requests, output.counts):
            first = r.num_computed_tokens
            tokens = r.tokens_between(first, first + count - len(r.spec_tokens))
            rows.append((tokens + r.spec_tokens, first, r.pages))
        return make_step_batch(rows, self.page_size)

    def plan(self, context_limit: int) -> None:
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
            # Within max_tokens and the context (as the engine's stop check): a lookahead past
            # the whole pool's pages would make the request preempt itself, and the step stall.
            room = r.length_room(context_limit) - 1
            k = min(room, spec.num_speculative_tokens,
                    max(1, math.ceil(r.spec_ema_accepted) + 1))
            if k <= 0:
                continue
            if spec.method == "ngram":
                r.spec_tokens = propose_ngram(r.token_ids, k, spec.ngram_min, spec.ngram_max)
                k = len(r.spec_tokens)
            r.lookahead = k

    def propose(self, output: SchedulerOutput, spec_rows: list[int]):
        """Fills the speculating requests' proposals (draft model); returns q [S, K, V] or None."""
        if self.draft is None:
            return None
        requests = [output.requests[i] for i in spec_rows]
        proposals, q = self.draft.propose(requests, max(r.lookahead for r in requests))
        for r, proposal in zip(requests, proposals):
            r.spec_tokens = proposal
        rows = bucket(len(output.entries))
        k = self.spec_config.num_speculative_tokens
        full = jnp.zeros((rows, k, q.shape[-1]), q.dtype)
        return full.at[jnp.asarray(spec_rows), : q.shape[1]].set(q)

    def accept(self, all_logits, batch: StepBatch, requests: list[Request], draft_probs):
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
                                                    arrays.steps)),
            all_greedy=arrays.mode() == "greedy")
        return np.asarray(accepted), np.asarray(tokens)

    def after_verification(self, r: Request, output: SchedulerOutput, row: int,
                           accepted: int, stats: SpecStats) -> None:
        """Moves the counters past the accepted tokens only (the count of the request's `row`
        in `output`): the rejected ones' K/V is garbage that later tokens overwrite (the
        rollback), and adapts the request's k."""
        counts = output.counts
        counts[row] = counts[row] - len(r.spec_tokens) + accepted
        stats.record(len(r.spec_tokens), accepted)
        r.spec_ema_accepted = 0.7 * r.spec_ema_accepted + 0.3 * accepted
        r.num_draft_computed = min(r.num_draft_computed,
                                   r.num_computed_tokens + counts[row])
        r.spec_tokens, r.lookahead = [], 0
