"""Multi-step rounds (EngineConfig.num_decode_steps; vLLM's multi-step scheduling): while every
running request decodes, one program runs num_decode_steps decode steps
(ModelRunner.execute_multi_step) and the host schedules, dispatches and reads tokens once per
round. With asynchronous scheduling a round is launched before the host reads the step or round
before it, like a single step: its first tokens come from that one's samples on the device.
With EngineConfig.mixed_rounds a step with prefill chunks is a round too (the step, then decode
steps of its rows, ModelRunner.execute_mixed_round).

Rows with penalties read and count their tokens in the count table inside the round
(engine/penalty_counts.py), in programs of their own. Where the engine compiles programs in the
background (a server), a penalized round whose program has not compiled yet runs as a single
step while its program compiles off the serving path (`compile_later`).

A component of LLMEngine: it decides whether a scheduled step can run as a round (taking the
pages the round needs) and launches it; the engine appends the tokens.
"""
from __future__ import annotations

import numpy as np

from engine.input_batch import InputBatch, PreparedStep
from engine.runner import ModelRunner
from engine.step_batch import bucket
from engine.scheduler import Scheduler, SchedulerOutput
from engine.warmup import round_program

DECODE, MIXED = "decode", "mixed"  # the kinds of round
PROGRAM_KINDS = {DECODE: "multi_step", MIXED: "mixed_round"}  # the runner's name of each


class MultiStepRounds:
    """Runs scheduled steps as rounds of `num_steps` model steps (see the module docstring)."""

    def __init__(self, num_steps: int, mixed_rounds: bool, max_num_seqs: int,
                 runner: ModelRunner, scheduler: Scheduler, input_batch: InputBatch):
        if num_steps < 2:
            raise ValueError(f"a round needs num_steps >= 2, got {num_steps}")
        self.num_steps, self.mixed_rounds, self.max_num_seqs = num_steps, mixed_rounds, max_num_seqs
        # The scheduler owns the pages (scheduler.pool): a round takes its pages from there.
        self.runner, self.scheduler, self.input_batch = runner, scheduler, input_batch
        # compile_later(program): compiles an engine.warmup.step_programs program off the
        # serving path; None: a round's program compiles when the round first runs.
        self.compile_later = None
        self._asked: set[tuple] = set()  # round keys handed to compile_later

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
        the in-flight step's next_inputs (asynchronous scheduling), or None. Where the
        round's program waits to compile (`compile_later`), launches nothing: (PreparedStep,
        None, None), the step to run as a single step."""
        if kind not in PROGRAM_KINDS:
            raise ValueError(f"unknown kind of round {kind!r}: expected {DECODE!r} or {MIXED!r}")
        step = (self.input_batch.prepare_decode(output) if kind == DECODE
                else self.input_batch.prepare(output))
        if not self._program_ready(kind, step):
            return step, None, None
        if kind == DECODE:
            tokens, last = self.runner.execute_multi_step(
                step.batch, step.arrays, self.num_steps, prev_inputs, step.sample_index)
        else:
            tokens, last = self.runner.execute_mixed_round(
                step.batch, np.asarray(step.completes, np.bool_), step.arrays, self.num_steps,
                prev_inputs, step.sample_index)
        return step, (tokens,), last

    def _program_ready(self, kind: str, step: PreparedStep) -> bool:
        """Whether the round can run now: its rows have no penalties (their programs compile
        with the others), there is no `compile_later`, or its program has compiled. Else the
        program is handed to compile_later, once per program (batches of one bucket share it)."""
        arrays = step.arrays
        if arrays.penalties is None or self.compile_later is None:
            return True
        key = self.runner.round_key(PROGRAM_KINDS[kind], step.batch, arrays, self.num_steps)
        if key in self.runner.compiled_rounds:
            return True
        if key in self._asked:
            return False
        self._asked.add(key)
        self.compile_later((self.runner.padding_q_lens(step.batch),
                            step.batch.block_tables.shape[1], False,
                            round_program(arrays.mode(), True)))
        return False

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

