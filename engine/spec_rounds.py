"""Speculative rounds: proposals (n-gram or draft model), one verification step over every
proposed token, exact acceptance (engine/speculative.py).

A component of LLMEngine: `step` schedules, proposes, verifies and advances the counters, and
returns each row's new tokens; the engine appends them. Speculative rounds run synchronously:
the proposals need the last token of every request on the host.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from engine.draft import DraftProposer
from engine.input_batch import InputBatch
from engine.request import Request
from engine.device_arrays import fetch_samples
from engine.runner import ModelRunner
from engine.step_batch import StepBatch, bucket, pad_to
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


@functools.partial(jax.jit, static_argnames=("rows",))
def place_rows(q: jax.Array, index: jax.Array, rows: int) -> jax.Array:
    """[rows, ...] zeros with q's rows [n, ...] at `index` [n] (an index of rows or more: that
    row dropped): the speculating rows' draft distributions among a step's rows."""
    return jnp.zeros((rows,) + q.shape[1:], q.dtype).at[index].set(q, mode="drop")


class SpeculativeRounds:
    """Runs each engine step as a speculative round (see the module docstring)."""

    def __init__(self, spec_config: SpecConfig, runner: ModelRunner, scheduler: Scheduler,
                 input_batch: InputBatch, draft: DraftProposer | None = None):
        if spec_config.method == "draft" and draft is None:
            raise ValueError("speculative method 'draft' needs a draft model (--draft_model)")
        self.spec_config, self.runner, self.scheduler = spec_config, runner, scheduler
        # the rows' block tables and sampling parameters (their slots: also their rows of the
        # device's tables and of the penalties' count table)
        self.input_batch, self.draft = input_batch, draft

    def admit(self, request: Request) -> None:
        """Prepares a new request for speculation: it starts optimistic (k proposals)."""
        request.spec_ema_accepted = float(self.spec_config.num_speculative_tokens)

    def step(self, context_limit: int, stats: SpecStats) -> SpecRound | None:
        """One synchronous round: proposals, one verification step, exact acceptance, the
        computed counters advanced; None when nothing could be scheduled. stats: where the
        drafted and accepted tokens are counted."""
        self.plan(context_limit)
        output = self.scheduler.schedule()
        self.input_batch.update(output)
        if not output.entries:
            return None
        requests = output.requests
        for r in requests:  # the scheduler may have cut the lookahead to the token budget, or
            r.spec_tokens = r.spec_tokens[: r.lookahead]  # to 0 (a preempted, readmitted request)
        if max(output.counts) > self.spec_config.num_speculative_tokens + 1:
            self.withdraw_proposals(output)
        spec_rows = [i for i, r in enumerate(requests) if r.lookahead > 0]
        draft_probs = self.propose(output, spec_rows) if spec_rows else None
        spec_rows = [i for i, r in enumerate(requests) if r.lookahead > 0]  # a draft may lag
        slots = self.input_batch.slots(requests, output.held())  # [S]
        batch = self._build_batch(output, slots)
        completes = np.array([r.num_computed_tokens + count >= r.num_tokens + len(r.spec_tokens)
                              for r, count in zip(requests, output.counts)])
        arrays = self.input_batch.sampling_arrays(requests, slots, completes)
        if spec_rows:
            batch.verify_len = self.spec_config.num_speculative_tokens + 1
            num_draft = pad_to(np.array([len(r.spec_tokens) for r in requests]),
                               (bucket(len(requests)),), 0)
            window_logits, logits = self.runner.execute_logits_at(  # [s, k + 1, V], [s, V]
                batch, *self.verification_indices(batch, num_draft))
            accepted, spec_tokens = self.accept(window_logits, num_draft, requests, draft_probs)
            results = self.runner.sample_device(logits, arrays)
        else:
            results = self.runner.execute_and_sample(batch, arrays)
        wait_start = time.perf_counter()
        tokens, chosen, top_ids, top_logprobs = fetch_samples(results, len(requests))
        now = time.perf_counter()
        new_tokens = []
        for i, r in enumerate(requests):
            if not completes[i]:
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

    def _build_batch(self, output: SchedulerOutput, slots: np.ndarray) -> StepBatch:
        """The step batch of a speculative round, from the input batch's rows at `slots`:
        each row's known tokens and its proposals."""
        requests = output.requests
        firsts = np.fromiter((r.num_computed_tokens for r in requests), np.int32, len(requests))
        tokens = [r.tokens_between(first, first + count - len(r.spec_tokens)) + r.spec_tokens
                  for r, first, count in zip(requests, firsts.tolist(), output.counts)]
        return self.input_batch.step_batch(slots, np.concatenate(tokens),
                                           np.asarray(output.counts, np.int32), firsts)

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
        proposals, q = self.draft.propose(  # q [bucket(proposing rows), K, V]
            requests, max(r.lookahead for r in requests),
            self.spec_config.num_speculative_tokens + 1,
            self.scheduler.config.max_num_batched_tokens)
        for r, proposal in zip(requests, proposals):
            r.spec_tokens = proposal
        # rows whose draft is still catching up: a plain decode this step
        self.withdraw_proposals(output, [i for i, p in zip(spec_rows, proposals) if not p])
        if q is None:
            return None
        proposing = [i for i, proposal in zip(spec_rows, proposals) if proposal]
        rows = bucket(len(output.entries))
        return place_rows(q, pad_to(np.asarray(proposing), (len(q),), rows), rows=rows)

    def withdraw_proposals(self, output: SchedulerOutput, rows: list[int] | None = None) -> None:
        """Takes the proposals of `rows` (default: every row) out of the step and its scheduled
        counts. Every row's, in a step that prefills a chunk longer than a verification step
        holds (k + 1 tokens a sequence): it runs as a plain step, whose programs are warm, where
        verifying would run a prefill program of every token's logits, compiled on first use
        (and [N, V] of them)."""
        for i in range(len(output.requests)) if rows is None else rows:
            r = output.requests[i]
            output.counts[i] -= r.lookahead  # the scheduled proposals (a draft's: not drawn yet)
            r.spec_tokens, r.lookahead = [], 0

    def warmup(self, rows: int) -> None:
        """Compiles the acceptance (`verify`) of a verification step of `rows` rows (a bucket),
        greedy and sampled, the sampler of its rows when all are greedy (a round samples every
        row's token by the sampler) and, with a draft model, the placing of its proposals'
        distributions among the rows: ahead of time from shapes, or where the runner runs its
        samplers (a mesh's logits are replicated) by running them on zero logits. (The draft's
        own programs: DraftProposer.warmup.)"""
        self.runner.warmup_sampler(rows, "greedy")
        k, vocab = self.spec_config.num_speculative_tokens, self.runner.cfg.vocab_size
        arrays = SamplingArrays.defaults(rows)
        floats = (jax.ShapeDtypeStruct if not self.runner.runs_samplers else
                  lambda shape, dtype: self.runner._placed(np.zeros(shape, dtype)))
        logits = floats((rows, k + 1, vocab), np.float32)
        draft_probs = floats((rows, k, vocab), np.float32) if self.draft is not None else None
        args = (logits, np.zeros((rows, k), np.int32), np.zeros(rows, np.int32), draft_probs,
                arrays.temperature, arrays.top_k, arrays.top_p, arrays.min_p, arrays.seeds,
                arrays.steps)
        for all_greedy in (True, False):
            if self.runner.runs_samplers:
                jax.block_until_ready(verify(*args, all_greedy=all_greedy))
            else:
                verify.lower(*args, all_greedy=all_greedy).compile()
        if self.draft is not None:  # the draft runs on one device: from shapes
            for num in (1 << i for i in range(rows.bit_length())):
                place_rows.lower(jax.ShapeDtypeStruct((num, k, vocab), jnp.float32),
                                 np.zeros(num, np.int32), rows=rows).compile()

    def verification_indices(self, batch: StepBatch, num_draft: np.ndarray) -> tuple:
        """The flat indices of the tokens whose logits a verification step keeps, over
        bucket(S) rows (padding rows: token 0), as engine.runner.verification_indices shapes
        them: int32 [s, k + 1], each row's window (the token before its first proposal, each
        proposal, then its last token repeated), and int32 [s], each row's last token."""
        k1 = self.spec_config.num_speculative_tokens + 1
        rows, num_seqs = len(num_draft), batch.num_seqs
        ends = batch.query_start_loc[1:] - 1  # [S]
        windows = np.minimum((ends - num_draft[:num_seqs])[:, None] + np.arange(k1),
                             ends[:, None])
        return pad_to(windows, (rows, k1), 0), pad_to(ends, (rows,), 0)

    def accept(self, window_logits: jax.Array, num_draft: np.ndarray, requests: list[Request],
               draft_probs):
        """Exact acceptance of every speculating row's proposal (engine/speculative.py), from
        the logits of each row's window (`verification_indices`) and its number of proposals
        (int32 [s], bucket(S) rows)."""
        k = self.spec_config.num_speculative_tokens
        rows = len(num_draft)
        draft_tokens = np.zeros((rows, k), np.int32)
        for i, r in enumerate(requests):
            draft_tokens[i, : len(r.spec_tokens)] = r.spec_tokens
        arrays = SamplingArrays.from_requests(requests).padded(rows)
        accepted, tokens = verify(
            window_logits, draft_tokens, num_draft, draft_probs, arrays.temperature,
            arrays.top_k, arrays.top_p, arrays.min_p, arrays.seeds, arrays.steps,
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
