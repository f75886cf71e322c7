"""Multi-step rounds of the LLM engine (EngineConfig.num_decode_steps; vLLM's multi-step
scheduling): while every running request decodes, one program runs num_decode_steps decode steps
(ModelRunner.execute_multi_step) and the host schedules, dispatches and reads tokens once per
round. A mixin of LLMEngine: it uses the engine's scheduler, pool, runner and _append_tokens.
"""
from __future__ import annotations

import time

import numpy as np

from engine.runner import fetch_samples
from engine.scheduler import SchedulerOutput


class MultiStepRounds:
    """LLMEngine's multi-step rounds (see the module docstring)."""

    def _multi_step_ready(self, output: SchedulerOutput) -> bool:
        """Whether this step can run as num_decode_steps decode steps: every scheduled request
        decodes one known token, none has penalties or logprobs, the context has room for all
        the steps, and the pool has pages for them (taken here)."""
        steps = self.engine_cfg.num_decode_steps
        if (steps == 1 or not output.scheduled or output.preempted or self._penalized
                or self.spec_config is not None or not self.runner.supports_multi_step):
            return False
        limit = self._context_limit()
        for it in output.scheduled:
            r = it.request
            if (it.num_new_tokens != 1 or r.num_computed_tokens != r.num_tokens - 1
                    or r.num_computed_tokens + steps > limit or r.params.logprobs is not None):
                return False
        return all(self.pool.grow(it.request.pages, it.request.num_computed_tokens + steps)
                   for it in output.scheduled)

    def _multi_step(self, output: SchedulerOutput) -> list:
        """Runs num_decode_steps decode steps of the scheduled requests as one program and
        appends each request's tokens (up to its stop condition)."""
        steps = self.engine_cfg.num_decode_steps
        requests = [it.request for it in output.scheduled]
        slots = self.scheduler.rows.slots(requests)
        batch = self._step_batch(
            slots, [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in requests],
            np.ones(len(requests), np.int32), [r.num_computed_tokens for r in requests])
        tokens = self.runner.execute_multi_step(batch, self._sampling_arrays(requests, slots),
                                                steps, self.engine_cfg.unroll_decode_steps)
        start = time.perf_counter()
        [tokens] = fetch_samples((tokens,), steps)  # [steps, bucket(S)]
        tokens = tokens[:, : len(requests)].T.tolist()  # [S][steps]
        now = time.perf_counter()
        self._wait_s += now - start
        for it in output.scheduled:
            it.num_new_tokens = steps
        self.scheduler.update_computed(output)
        self.stats.num_computed_tokens += output.num_tokens
        self._round_steps = steps
        limit = self._context_limit()
        return [self._append_tokens(r, row, None, now, limit)
                for r, row in zip(requests, tokens)]
