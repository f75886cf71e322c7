"""Asynchronous scheduling: step n+1 is launched before step n's tokens are read.

The engine's outputs must not change: random request streams (chunked prefill, preemption,
aborts, priorities, seeded sampling) give the same tokens, finish reasons and stream deltas as
the synchronous engine; a request ended by a stop token computes one token too many, which is
dropped; requests ended by length compute nothing extra; penalties overlap too.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given

from engine.llm_engine import LLMEngine
from engine.request import FinishReason, SamplingParams
from tests.engine.test_continuous_batching import (BASE, CFG, HYPOTHESIS, STRESS, check_all_free,
                                                   engine_maker, random_prompt, request_streams,
                                                   same_outcomes_across)
from tests.engine.weights import unit_scale_model

SYNC_STRESS = dataclasses.replace(STRESS, async_scheduling=False)
SYNC_BASE = dataclasses.replace(BASE, async_scheduling=False)
ASYNC_STRESS = dataclasses.replace(STRESS, async_scheduling=True)
ASYNC_BASE = dataclasses.replace(BASE, async_scheduling=True)


@pytest.fixture(scope="module")
def make_engine():
    return engine_maker(unit_scale_model(CFG, 3))


def overlapping_steps(engine: LLMEngine) -> list[bool]:
    """Wraps engine.step to log, per step, whether a launched step was left in flight."""
    log, step = [], engine.step

    def logged():
        deltas = step()
        log.append(engine._in_flight is not None)
        return deltas

    engine.step = logged
    return log


def test_random_streams_equal_the_synchronous_engine(make_engine):
    """Same outputs and finish reasons as synchronous scheduling for every request not aborted,
    streamed tokens equal to the outputs, no page leaks, and the engine did overlap its steps."""
    overlapped = []

    @HYPOTHESIS
    @given(stream=request_streams())
    def run(stream):
        sync_log, async_log = same_outcomes_across(
            make_engine, (SYNC_STRESS, ASYNC_STRESS), stream, overlapping_steps)
        assert not any(sync_log)
        overlapped.append(sum(async_log))

    run()
    assert sum(overlapped) > 0


def test_a_failed_dispatch_raises_from_step_and_leaves_nothing_in_flight(make_engine):
    """Asynchronous outputs (greedy and seeded, stop tokens, chunked prompts) equal the
    synchronous engine's; a dispatch that fails raises from engine.step(), with no step left
    in flight."""
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, n) for n in (5, 40, 17, 3)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=15, ignore_eos=True, stop_token_ids=(7, 11)),
              SamplingParams(max_tokens=6, temperature=0.7, top_k=5, seed=1)]
    sync = make_engine(SYNC_BASE).generate(prompts, params)
    engine = make_engine(ASYNC_BASE)
    outs = engine.generate(prompts, params)
    assert [o.output_ids for o in outs] == [o.output_ids for o in sync]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in sync]
    assert engine.stats.num_tokens_from_device > 0

    def failing(*args):
        raise RuntimeError("device lost")

    engine.runner.execute_and_sample = failing
    engine.add_request(prompts[0], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(3):
            engine.step()
    assert engine._in_flight is None


def test_stop_token_request_drops_its_extra_token(make_engine):
    """A request ended by a stop token had its next step launched already: that token is
    computed but dropped; the outputs and the freed pages are as without overlap."""
    rng = np.random.default_rng(30)
    prompt = random_prompt(rng, 12)
    [free_run] = make_engine(SYNC_BASE).generate(
        [prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    stop = free_run.output_ids[4]
    first = free_run.output_ids.index(stop)
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop,))
    computed = {}
    for cfg in (SYNC_BASE, ASYNC_BASE):
        engine = make_engine(cfg)
        [out] = engine.generate([prompt], params)
        check_all_free(engine)
        assert out.output_ids == free_run.output_ids[: first + 1]
        assert out.finish_reason == FinishReason.STOP
        computed[cfg.async_scheduling] = engine.stats.num_computed_tokens
    assert computed[True] == computed[False] + 1  # the dropped token's step


def test_length_limited_requests_compute_nothing_extra(make_engine):
    """max_tokens is known in advance: a request whose in-flight token is its last is held
    back, so the asynchronous engine computes exactly the synchronous engine's tokens."""
    rng = np.random.default_rng(31)
    prompts = [random_prompt(rng, n) for n in (5, 17, 30)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 4, 9)]
    runs = {}
    for cfg in (SYNC_BASE, ASYNC_BASE):
        engine = make_engine(cfg)
        outs = engine.generate(prompts, params)
        check_all_free(engine)
        runs[cfg.async_scheduling] = ([o.output_ids for o in outs],
                                      engine.stats.num_computed_tokens)
    assert runs[True] == runs[False]
    assert [len(o) for o in runs[True][0]] == [1, 4, 9]


def test_penalties_and_logprobs(make_engine):
    """Penalties count the output tokens on the device, so a penalized request overlaps its
    steps like any other; logprobs work while overlapping. Outputs equal the synchronous
    engine's, and the penalties changed the tokens."""
    rng = np.random.default_rng(32)
    prompts = [random_prompt(rng, 10), random_prompt(rng, 14)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=3.0,
                             frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3,
                             logprobs=3)]
    results = {}
    for cfg in (SYNC_BASE, ASYNC_BASE):
        engine = make_engine(cfg)
        log = overlapping_steps(engine)
        outs = engine.generate(prompts, params)
        check_all_free(engine)
        results[cfg.async_scheduling] = [(o.output_ids, o.outputs[0].logprobs) for o in outs]
        if cfg.async_scheduling:
            assert all(log[:-1]), log  # in flight after every step but the last
    [plain] = make_engine(SYNC_BASE).generate(prompts[:1], SamplingParams(max_tokens=16,
                                                                          ignore_eos=True))
    assert plain.output_ids != results[True][0][0]
    ids_sync, ids_async = ([o[0] for o in results[k]] for k in (False, True))
    assert ids_sync == ids_async
    for (_, lp_sync), (_, lp_async) in zip(results[False], results[True]):
        assert len(lp_sync) == len(lp_async)
        for a, b in zip(lp_sync, lp_async):
            if a is None:
                assert b is None
                continue
            np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-5)
            assert list(a[1]) == list(b[1])


def test_a_rejected_request_leaves_the_engine_as_it_was(make_engine):
    """add_request rejects a stop id beyond int64 and a penalized prompt that can never fit
    the pool with a ValueError and leaves no trace: later requests still overlap their steps
    (no penalized request is left behind) and stop at a new stop id."""
    small = dataclasses.replace(ASYNC_BASE, num_pages=2)  # 32 tokens in all
    rng = np.random.default_rng(11)
    prompt = random_prompt(rng, 8)
    engine = make_engine(small)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(prompt, SamplingParams(max_tokens=4, stop_token_ids=(2**70,)))
    with pytest.raises(ValueError, match="can never run"):
        engine.add_request(random_prompt(rng, 40),
                           SamplingParams(max_tokens=4, repetition_penalty=1.2))
    assert not engine.has_unfinished()
    [free_run] = make_engine(small).generate([prompt],
                                             SamplingParams(max_tokens=8, ignore_eos=True))
    stop = free_run.output_ids[3]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True,
                                                     stop_token_ids=(stop,)))
    assert out.output_ids == free_run.output_ids[: free_run.output_ids.index(stop) + 1]
    assert out.finish_reason == FinishReason.STOP
    assert engine.stats.num_tokens_from_device > 0
    check_all_free(engine)
