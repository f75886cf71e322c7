"""Multi-step rounds (EngineConfig.num_decode_steps; vLLM's multi-step scheduling): while every
running request decodes, one program runs num_decode_steps decode steps
(ModelRunner.execute_multi_step) and the host schedules, dispatches and reads tokens once per
round. With asynchronous scheduling a round is launched before the host reads the step or round
before it, like a single step: its first tokens come from that one's samples on the device.
With EngineConfig.mixed_rounds a step with prefill chunks is a round too (the step, then decode
steps of its rows, ModelRunner.execute_mixed_round).

A component of LLMEngine: it decides whether a scheduled step can run as a round (taking the
pages the round needs) and launches it; the engine appends the tokens.
"""
from __future__ import annotations

import numpy as np

from engine.input_batch import InputBatch
from engine.runner import ModelRunner
from engine.step_batch import bucket
from engine.scheduler import Scheduler, SchedulerOutput

DECODE, MIXED = "decode", "mixed"  # the kinds of round


class MultiStepRounds:
    """Runs scheduled steps as rounds of `num_steps` model steps (see the module docstring)."""

    def __init__(self, num_steps: int, mixed_rounds: bool, max_num_seqs: int,
                 runner: ModelRunner, scheduler: Scheduler, input_batch: InputBatch):
        if num_steps < 2:
            raise ValueError(f"a round needs num_steps >= 2, got {num_steps}")
        self.num_steps, self.mixed_rounds, self.max_num_seqs = num_steps, mixed_rounds, max_num_seqs
        # The scheduler owns the pages (scheduler.pool): a round takes its pages from there.
        self.runner, self.scheduler, self.input_batch = runner, scheduler, input_batch

    def ready(self, output: SchedulerOutput, context_limit: int,
              any_logprobs: bool) -> str | None:
        """The kind of round this scheduled step can run as (DECODE, MIXED), its pages taken;
        None: it runs as a single step. any_logprobs: some unfinished request wants logprobs
        (rounds return none; the rows are checked only then)."""
        if not output.entries or output.preempted:
            return None
        if self._decode_ready(output, context_limit, any_logprobs):
            return DECODE
        if self._mixed_ready(output, context_limit, any_logprobs):
            return MIXED
        return None

    def launch(self, kind: str, output: SchedulerOutput, prev_inputs) -> tuple:
        """Launches a round of `kind` (from `ready`) without waiting: (PreparedStep, results
        (tokens [num_steps, bucket(S)],), the last step's tokens [sample_rows]). prev_inputs:
        the in-flight step's next_inputs (asynchronous scheduling), or None."""
        if kind == DECODE:
            step = self.input_batch.prepare_decode(output)
            tokens, last = self.runner.execute_multi_step(
                step.batch, step.arrays, self.num_steps, prev_inputs, step.sample_index)
        elif kind == MIXED:
            step = self.input_batch.prepare(output)
            tokens, last = self.runner.execute_mixed_round(
                step.batch, np.asarray(step.completes, np.bool_), step.arrays, self.num_steps,
                prev_inputs, step.sample_index)
        else:
            raise ValueError(f"unknown kind of round {kind!r}: expected {DECODE!r} or {MIXED!r}")
        return step, (tokens,), last

    def _decode_ready(self, output: SchedulerOutput, context_limit: int,
                      any_logprobs: bool) -> bool:
        """Whether this step can run as num_steps decode steps: every scheduled request decodes
        one token (known, or in flight from the step before), none wants logprobs, the context
        has room for all the steps, and the pool has pages for them (taken here). Vectorized
        over the scheduler's per-row records (SchedulerOutput)."""
        if output.entries[-1][1] != 1 or _wants_logprobs(output, any_logprobs):
            return False  # (admissions come last)
        counts, firsts, totals, _ = output.columns()  # [S] each
        if (not (counts == 1).all() or not (firsts == totals - 1).all()
                or int(firsts.max()) + self.num_steps > context_limit):
            return False
        return self._grow_rows(output, np.arange(len(firsts)), firsts + self.num_steps)

    def _mixed_ready(self, output: SchedulerOutput, context_limit: int,
                     any_logprobs: bool) -> bool:
        """Whether this step (with prefill chunks) can run as a mixed round: the step, then
        num_steps - 1 decode steps of its rows that complete their prompt or decode. Needs more
        than half of the sequence slots' bucket scheduled (the decode steps run over the step's
        padded rows, which prefill steps pad to that bucket), no logprobs, context room for the
        rows that go on, and pages for them (taken here). While requests wait and 1/16 of the
        slots or more are free, the step runs alone: a mixed round admits only once per round,
        too slowly to keep the slots full when prompts are long."""
        if not self.mixed_rounds or 2 * len(output.entries) <= bucket(self.max_num_seqs):
            return False
        free = self.max_num_seqs - len(self.scheduler.running)
        if self.scheduler.num_waiting and free >= max(1, self.max_num_seqs // 16):
            return False  # refill the slots with single admission steps first
        if _wants_logprobs(output, any_logprobs):
            return False
        counts, firsts, totals, _ = output.columns()  # [S] each
        ends = firsts + counts
        going_on = np.flatnonzero(ends >= totals)  # rows whose step token is their next one
        ends = ends[going_on] + self.num_steps - 1
        if len(ends) and int(ends.max()) > context_limit:
            return False
        return self._grow_rows(output, going_on, ends)

    def _grow_rows(self, output: SchedulerOutput, rows: np.ndarray, ends: np.ndarray) -> bool:
        """Pages for the scheduled `rows` (indices) to hold `ends` tokens each
        (BlockPool.grow_all: False at the first the pool cannot give, with the pages taken so
        far kept); the output's pages held (SchedulerOutput.held) follow."""
        pool = self.scheduler.pool
        size = pool.page_size
        held = output.held()  # [S]
        short = ends > held[rows] * size
        rows, ends = rows[short], ends[short]
        if not len(rows):
            return True
        requests = output.requests
        grown = pool.grow_all([requests[i].pages for i in rows.tolist()], ends)
        if grown:
            held[rows] = -(-ends // size)
        else:  # some rows got their pages, some not
            held[rows] = [len(requests[i].pages) for i in rows.tolist()]
        return grown


def _wants_logprobs(output: SchedulerOutput, any_logprobs: bool) -> bool:
    """Whether a scheduled request wants logprobs: a pass over the rows only while some
    unfinished request does."""
    return any_logprobs and any(r.params.logprobs is not None for r in output.requests)

