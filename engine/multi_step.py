"""Multi-step rounds of the LLM engine (EngineConfig.num_decode_steps; vLLM's multi-step
scheduling): while every running request decodes, one program runs num_decode_steps decode steps
(ModelRunner.execute_multi_step) and the host schedules, dispatches and reads tokens once per
round. With asynchronous scheduling a round is launched before the host reads the step or round
before it, like a single step: its first tokens come from that one's samples on the device.
With EngineConfig.mixed_rounds a step with prefill chunks is a round too (`_mixed_round_ready`:
the step, then decode steps of its rows, ModelRunner.execute_mixed_round); with
EngineConfig.pause_admissions_for_rounds admissions pause so that rounds can follow them.
A mixin of LLMEngine: it uses the engine's scheduler, pool, runner, in-flight step and
_append_tokens.
"""
from __future__ import annotations

import numpy as np

from engine.engine_types import InFlight, StreamDelta
from engine.runner import bucket
from engine.scheduler import SchedulerOutput


class MultiStepRounds:
    """LLMEngine's multi-step rounds (see the module docstring)."""

    def _rounds_possible(self) -> bool:
        """Whether rounds can run at all: more than one decode step per round, and no
        penalties, speculation or runner that rules them out. With
        EngineConfig.pause_admissions_for_rounds the engine then schedules for rounds
        (Scheduler.schedule's admit and whole_prompts): under load a request ends and
        a waiting one is admitted almost every step, and a step with a prefill chunk cannot
        be a round; so admissions pause after an admitting step while few slots are free
        (`_defer_admission`), and a prompt that does not fit what is left of a step's token
        budget waits for the next admitting step (unless it is that step's first admission),
        so that the step after an admission can be a round. A waiting request may wait up to
        a round longer."""
        return (self.engine_cfg.num_decode_steps > 1 and not self._penalized
                and self.spec_config is None and self.runner.supports_multi_step)

    def _defer_admission(self) -> bool:
        """Whether a step, when rounds are possible, admits no waiting request: when the step
        before admitted some and fewer than an eighth of the sequence slots are free (with
        more free, admissions go on step after step, so that the running set stays at least
        7/8 full)."""
        free = self.engine_cfg.max_num_seqs - len(self.scheduler.running)
        return self._admitted_last and free < self.engine_cfg.max_num_seqs // 8

    def _multi_step_ready(self, output: SchedulerOutput) -> bool:
        """Whether this step can run as num_decode_steps decode steps: every scheduled request
        decodes one token (known, or in flight from the step before), none has penalties or
        logprobs, the context has room for all the steps, and the pool has pages for them
        (taken here). Vectorized over the scheduler's per-row records (SchedulerOutput)."""
        steps = self.engine_cfg.num_decode_steps
        if (not output.entries or output.preempted or not self._rounds_possible()
                or output.entries[-1][1] != 1  # admissions come last
                or self._wants_logprobs(output)):
            return False
        counts, firsts, totals, _ = output.columns()  # [S] each
        if (not (counts == 1).all() or not (firsts == totals - 1).all()
                or int(firsts.max()) + steps > self._context_limit()):
            return False
        return self._grow_rows(output, np.arange(len(firsts)), firsts + steps)

    def _wants_logprobs(self, output: SchedulerOutput) -> bool:
        """Whether a scheduled request wants logprobs (rounds return none): a pass over the
        rows only while some unfinished request does."""
        return bool(self._with_logprobs) and any(
            r.params.logprobs is not None for r in output.requests)

    def _grow_rows(self, output: SchedulerOutput, rows: np.ndarray, ends: np.ndarray) -> bool:
        """Pages for the scheduled `rows` (indices) to hold `ends` tokens each
        (BlockPool.grow_all: False at the first the pool cannot give, with the pages taken so
        far kept); the output's pages held (SchedulerOutput.held) follow."""
        size = self.pool.page_size
        held = output.held()  # [S]
        short = ends > held[rows] * size
        rows, ends = rows[short], ends[short]
        if not len(rows):
            return True
        requests = output.requests
        grown = self.pool.grow_all([requests[i].pages for i in rows.tolist()], ends)
        if grown:
            held[rows] = -(-ends // size)
        else:  # some rows got their pages, some not
            held[rows] = [len(requests[i].pages) for i in rows.tolist()]
        return grown

    def _launch_round(self, output: SchedulerOutput) -> InFlight:
        """Launches num_decode_steps decode steps of the scheduled requests as one program,
        without waiting. A request whose newest token is still in flight (asynchronous
        scheduling) reads it on the device from the step before."""
        steps = self.engine_cfg.num_decode_steps
        prev = self._in_flight
        requests = output.requests
        # Each row's input token: in flight (read on the device from the step before: a
        # placeholder 0 here), or the request's last known one.
        pendings = output.columns()[3]  # [S]
        if pendings.all():  # asynchronous scheduling: every row
            tokens = np.zeros(len(requests), np.int32)
            placeholders = np.arange(len(requests))
            sources = [r.pending_row for r in requests]
        else:
            tokens = [0 if pending else r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
                      for r, pending in zip(requests, pendings.tolist())]
            placeholders = np.flatnonzero(pendings).tolist()
            sources = [requests[i].pending_row for i in placeholders]
        slots = self.scheduler.rows.slots(requests, output.held())
        batch = self._step_batch(slots, tokens, np.ones(len(requests), np.int32),
                                 output.columns()[1])
        sample_index = self._sample_index(len(requests), placeholders, sources)
        arrays = self._sampling_arrays(requests, slots)

        def dispatch():
            out, last = self.runner.execute_multi_step(
                batch, arrays, steps, self.engine_cfg.unroll_decode_steps,
                None if prev is None else prev.next_inputs, sample_index)
            return (out,), last

        return self._launched(output, requests, [True] * len(requests),
                              self._dispatch(dispatch), steps, slots)

    def _mixed_round_ready(self, output: SchedulerOutput) -> bool:
        """Whether this step (with prefill chunks) can run as a mixed round
        (EngineConfig.mixed_rounds): the step, then num_decode_steps - 1 decode steps of its
        rows that complete their prompt or decode. Needs more than half of the sequence slots'
        bucket scheduled (the decode steps run over the step's padded rows, which prefill steps
        pad to that bucket), no logprobs, context room for the rows that go on, and pages for
        them (taken here). While requests wait and 1/16 of the slots or more are free, the step
        runs alone: a mixed round admits only once per round, too slowly to keep the slots full
        when prompts are long (measured on the H200: at most 187 of 256 running)."""
        if (not self.engine_cfg.mixed_rounds or not output.entries or output.preempted
                or not self._rounds_possible()
                or 2 * len(output.entries) <= bucket(self.engine_cfg.max_num_seqs)):
            return False
        free = self.engine_cfg.max_num_seqs - len(self.scheduler.running)
        if self.scheduler.num_waiting and free >= max(1, self.engine_cfg.max_num_seqs // 16):
            return False  # refill the slots with single admission steps first
        if self._wants_logprobs(output):
            return False
        extra = self.engine_cfg.num_decode_steps - 1
        counts, firsts, totals, _ = output.columns()  # [S] each
        ends = firsts + counts
        going_on = np.flatnonzero(ends >= totals)  # rows whose step token is their next one
        ends = ends[going_on] + extra
        if len(ends) and int(ends.max()) > self._context_limit():
            return False
        return self._grow_rows(output, going_on, ends)

    def _launch_mixed_round(self, output: SchedulerOutput) -> InFlight:
        """Launches a mixed round (see `_mixed_round_ready`) as one program, without waiting."""
        steps = self.engine_cfg.num_decode_steps
        prev = self._in_flight
        requests, completes, batch, sample_index, arrays, slots = self._step_inputs(output)

        def dispatch():
            tokens, last = self.runner.execute_mixed_round(
                batch, np.asarray(completes, np.bool_), arrays, steps,
                self.engine_cfg.unroll_decode_steps,
                None if prev is None else prev.next_inputs, sample_index)
            return (tokens,), last

        return self._launched(output, requests, completes, self._dispatch(dispatch), steps,
                              slots)

    def _append_round(self, flight: InFlight, tokens: np.ndarray, now: float) -> list:
        """Appends a round's tokens [steps, bucket(S)] to its requests, each up to its stop
        condition (a request that stopped inside the round drops the rest); returns the
        deltas. A row none of whose tokens can end its request (no stop id of the round's
        requests among them, max_tokens and the context not reached: InFlight.may_end), that
        does not bring its first token and has no text to detokenize is appended whole; the
        others token by token (_append_tokens)."""
        limit = self._context_limit()
        steps = flight.steps
        requests = flight.requests
        block = tokens[:, : len(requests)].T  # [S, steps]
        detokenizers = self._detokenizers
        deltas = []
        slow_rows = slow_tokens = 0  # rows appended token by token, and their tokens
        for r, row, special, complete in zip(requests, block.tolist(),
                                             self._rows_that_may_stop(flight, block),
                                             flight.completes):
            if not complete:
                continue  # a mixed round's prefill chunk short of the prompt's end
            r.num_pending -= steps
            if r.finish_reason is not None:
                continue  # ended or aborted while the round ran: its tokens are dropped
            if special or (detokenizers and r.request_id in detokenizers):
                deltas.append(self._append_tokens(r, row, None, now, limit))
                slow_rows += 1
                slow_tokens += len(deltas[-1].token_ids)
            else:
                r.output_ids += row
                deltas.append(StreamDelta(r.group_id, r.sample_index, "", row, None, None))
        self.stats.num_generated_tokens += steps * (len(deltas) - slow_rows) + slow_tokens
        return deltas
