"""Multi-step decoding (EngineConfig.num_decode_steps): several decode steps per program.

The outputs must not change: random request streams (chunked prefill, preemption, aborts,
priorities, seeded sampling, penalties) give the same tokens and finish reasons as single
steps; a request that stops inside a multi-step round drops its extra tokens and leaves no
page behind; rounds really run several steps, and the program's tokens equal single steps'.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from engine.llm_engine import EngineConfig, LLMEngine
from engine.multi_step import MIXED
from engine.output_processor import OutputProcessor, stop_reason
from engine.request import FinishReason, Request, SamplingParams
from tests.engine.test_continuous_batching import (BASE, CFG, HYPOTHESIS, STRESS, check_all_free,
                                                   engine_maker, random_prompt, request_streams,
                                                   same_outcomes_across)
from scripts.bench.host_phases import round_sets
from tests.engine.weights import unit_scale_model

MULTI_STRESS = dataclasses.replace(STRESS, num_decode_steps=3)
MULTI_ASYNC_STRESS = dataclasses.replace(MULTI_STRESS, async_scheduling=True)
MULTI_BASE = dataclasses.replace(BASE, num_decode_steps=4, num_pages=12)
SINGLE_BASE = dataclasses.replace(MULTI_BASE, num_decode_steps=1)


@pytest.fixture(scope="module")
def make_engine():
    return engine_maker(unit_scale_model(CFG, 3))


def multi_step_rounds(engine: LLMEngine) -> list[int]:
    """Logs the model steps of each round."""
    log, step = [], engine.step

    def logged():
        before = engine.stats.num_model_steps
        deltas = step()
        log.append(engine.stats.num_model_steps - before)
        return deltas

    engine.step = logged
    return log


def test_random_streams_equal_single_steps(make_engine):
    """Same outputs and finish reasons as single steps for every request not aborted, streamed
    tokens equal to the outputs, no page leaks, and multi-step rounds did run."""
    multi = []

    @HYPOTHESIS
    @given(stream=request_streams())
    def run(stream):
        _, rounds = same_outcomes_across(make_engine, (STRESS, MULTI_STRESS), stream,
                                         multi_step_rounds)
        multi.append(sum(n > 1 for n in rounds))

    run()
    assert sum(multi) > 0


def test_random_streams_with_asynchronous_rounds_equal_single_steps(make_engine):
    """Asynchronous scheduling with multi-step rounds (each round or step launched before the
    host reads the one before): the same outcomes as synchronous single steps, and rounds did
    read their first tokens on the device."""
    overlapped = []
    config = MULTI_ASYNC_STRESS

    @HYPOTHESIS
    @given(stream=request_streams())
    def run(stream):
        engines = []

        def instrument(engine):
            engines.append(engine)
            return multi_step_rounds(engine)

        _, rounds = same_outcomes_across(make_engine, (STRESS, config), stream, instrument)
        overlapped.append((sum(n > 1 for n in rounds), engines[1].stats.num_tokens_from_device))

    run()
    assert sum(r for r, _ in overlapped) > 0 and sum(t for _, t in overlapped) > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_and_seeded_outputs_with_stops_inside_a_round(make_engine, overlap):
    """max_tokens that are not multiples of the round, a stop token met inside a round and
    seeded sampling (plain and with cuts): the tokens of single steps; the stopped request's
    extra tokens are computed and dropped, and every page is free at the end; rounds launched
    synchronously and asynchronously."""
    rng = np.random.default_rng(40)
    prompts = [random_prompt(rng, n) for n in (5, 17, 30, 9)]
    [free_run] = make_engine(SINGLE_BASE).generate(
        [prompts[0]], SamplingParams(max_tokens=14, ignore_eos=True))
    stop = free_run.output_ids[6]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=7, ignore_eos=True),
              SamplingParams(max_tokens=11, ignore_eos=True, temperature=0.9, seed=5),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.1, top_k=20,
                             top_p=0.9, seed=6)]
    results = {}
    for cfg in (SINGLE_BASE, dataclasses.replace(MULTI_BASE, async_scheduling=overlap)):
        engine = make_engine(cfg)
        log = multi_step_rounds(engine)
        outs = engine.generate(prompts, params)
        check_all_free(engine)
        results[cfg.num_decode_steps] = [(o.output_ids, o.finish_reason) for o in outs]
        if cfg.num_decode_steps > 1:
            assert max(log) == 4, log
            assert (engine.stats.num_tokens_from_device > 0) == overlap
    assert results[4] == results[1]
    first = free_run.output_ids.index(stop)
    assert results[4][0] == (free_run.output_ids[: first + 1], FinishReason.STOP)
    assert [len(ids) for ids, _ in results[4][1:]] == [7, 11, 10]


def test_rounds_fall_back_to_single_steps(make_engine):
    """Logprobs and a context too short for a whole round take single steps (and give single
    steps' outputs); num_decode_steps below 1 is refused."""
    rng = np.random.default_rng(41)
    prompt = random_prompt(rng, 12)
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)
    outs = {}
    for cfg in (SINGLE_BASE, MULTI_BASE):
        engine = make_engine(cfg)
        log = multi_step_rounds(engine)
        [out] = engine.generate([prompt], params)
        outs[cfg.num_decode_steps] = out.output_ids
        assert max(log) == 1
    assert outs[4] == outs[1]
    # Context: 96 tokens. A prompt of 89: the prefill step, one round of 4 (positions 89-92),
    # then 93 + 4 > 96: single steps to the end of the context.
    engine = make_engine(MULTI_BASE)
    log = multi_step_rounds(engine)
    [out] = engine.generate([random_prompt(rng, 89)], SamplingParams(max_tokens=50,
                                                                      ignore_eos=True))
    assert len(out.output_ids) == 96 - 89 and out.finish_reason == FinishReason.LENGTH
    assert log == [1, 4, 1, 1]
    with pytest.raises(ValueError, match="num_decode_steps"):
        EngineConfig(num_decode_steps=0)


PENALIZED = [dict(repetition_penalty=1.6, presence_penalty=1.5, frequency_penalty=0.8),
             dict(repetition_penalty=1.3, frequency_penalty=0.6, temperature=0.9, seed=3),
             dict(presence_penalty=0.7, temperature=1.1, top_k=30, seed=4), {}]


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_inside_rounds_equal_single_steps(make_engine, overlap):
    """Penalized rows (repetition, presence, frequency; greedy and seeded sampling, beside an
    unpenalized row) read and count their tokens in the count table inside decode and mixed
    rounds: the tokens of single steps, the penalties changed them, and rounds ran; prompts
    of repeated tokens make the prompt flag matter."""
    rng = np.random.default_rng(43)
    prompts = [(random_prompt(rng, 4) * 5)[:n] for n in (13, 17, 6, 11)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **kw)
              for m, kw in zip((14, 9, 13, 10), PENALIZED)]
    results = {}
    for cfg in (SINGLE_BASE, dataclasses.replace(MULTI_BASE, async_scheduling=overlap,
                                                 num_pages=24)):
        engine = make_engine(cfg)
        log = multi_step_rounds(engine)
        results[cfg.num_decode_steps] = [o.output_ids for o in engine.generate(prompts, params)]
        check_all_free(engine)
        if cfg.num_decode_steps > 1:
            assert log[0] == 4 and max(log[1:]) == 4, log  # a mixed round, then decode rounds
    assert results[4] == results[1]
    plain = make_engine(SINGLE_BASE).generate(
        prompts, [dataclasses.replace(p, repetition_penalty=1.0, presence_penalty=0.0,
                                      frequency_penalty=0.0) for p in params])
    changed = [o.output_ids != r for o, r in zip(plain, results[1])]
    assert changed == [True, True, True, False]


def test_a_penalized_round_waits_for_its_program_off_the_serving_path(make_engine):
    """With a compile queue (a server's: LLMEngine.compile_in_background), a penalized round
    whose program has not compiled runs as a single step while the queue compiles it; once
    compiled, rounds run; the tokens equal single steps' throughout."""
    from engine.warmup import CompileQueue
    rng = np.random.default_rng(44)
    prompts = [random_prompt(rng, n) for n in (7, 12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=0.9)
    expected = [o.output_ids for o in make_engine(SINGLE_BASE).generate(prompts, params)]
    engine = make_engine(dataclasses.replace(MULTI_BASE, mixed_rounds=False))
    queue = CompileQueue(engine._compile_program)
    engine.rounds.compile_later = queue.ask
    log = multi_step_rounds(engine)
    assert [o.output_ids for o in engine.generate(prompts, params)] == expected
    assert max(log) == 1
    assert queue.join(timeout=300)
    log.clear()
    assert [o.output_ids for o in engine.generate(prompts, params)] == expected
    assert max(log) == 4


@pytest.mark.parametrize("mixed", [False, True])
def test_warmup_compiles_the_rounds_a_run_reaches(make_engine, mixed):
    """After warm-up, a greedy run of multi-step rounds (with mixed rounds: its first step,
    three prompts, runs as one) compiles nothing new."""
    rng = np.random.default_rng(42)
    lens = [10, 14, 12] if mixed else [10, 14]
    prompts = [random_prompt(rng, n) for n in lens]
    engine = make_engine(dataclasses.replace(MULTI_BASE, mixed_rounds=mixed))
    engine.warmup(num_seqs=len(lens), max_total_len=40, prompt_lens=lens)
    warmed = set(engine.runner.compiled_shapes)
    kinds = {key[0] for key in warmed if isinstance(key[0], str)}
    assert "multi_step" in kinds and ("mixed_round" in kinds) == mixed
    log = multi_step_rounds(engine)
    engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert max(log) == 4 and (log[0] == 4) == mixed
    assert set(engine.runner.compiled_shapes) == warmed


def test_warmup_with_penalties_compiles_the_penalized_rounds(make_engine):
    """`warmup(penalties=True)` also compiles the rounds of penalized rows: a penalized run
    of rounds (decode and mixed) then compiles nothing new (jax's compile log: the programs
    compiled ahead from shapes are the ones the run calls)."""
    from engine.compile_stats import compile_stats, count_compiles
    count_compiles()
    rng = np.random.default_rng(45)
    lens = [10, 14, 12]
    prompts = [random_prompt(rng, n) for n in lens]
    engine = make_engine(MULTI_BASE)
    engine.warmup(num_seqs=len(lens), max_total_len=40, prompt_lens=lens, samplers=False,
                  penalties=True)
    warmed = set(engine.runner.compiled_shapes)
    penalized_rounds = {key[0] for key in warmed if isinstance(key[0], str) and key[4]}
    assert penalized_rounds == {"multi_step", "mixed_round"}
    log = multi_step_rounds(engine)
    before = compile_stats()
    engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True,
                                            repetition_penalty=1.2))
    assert max(log) == 4 and log[0] == 4
    assert set(engine.runner.compiled_shapes) == warmed
    assert (compile_stats() - before).programs == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_under_load(overlap):
    """Under load (three times more requests than slots, a request ending almost every step),
    rounds give single steps' outputs, rounds ran while requests waited, and no page leaks."""
    rng = np.random.default_rng(42)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(4, 24, 48)]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(8, 40, 48)]
    loaded = dataclasses.replace(BASE, max_num_seqs=16, max_num_batched_tokens=128,
                                 num_pages=64, enable_chunked_prefill=True,
                                 async_scheduling=overlap)
    make_engine = engine_maker(unit_scale_model(CFG, 3))  # its own: 16 slots, not 4
    outs = []
    for steps in (1, 4):
        engine = make_engine(dataclasses.replace(loaded, num_decode_steps=steps))
        engine.stats = type(engine.stats)(record_steps=True)
        outs.append([o.output_ids for o in engine.generate(prompts, params)])
        check_all_free(engine)
        steps_run = np.asarray(engine.stats.steps)  # (running, host, wall, exposed, steps, waiting)
        saturated = steps_run[round_sets(steps_run)["saturated"], 4]
        assert (saturated.max() > 1) == (steps > 1)
    assert all(out == outs[0] for out in outs[1:])


MIXED_STRESS = dataclasses.replace(MULTI_STRESS, mixed_rounds=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_random_streams_with_mixed_rounds_equal_single_steps(make_engine, overlap):
    """Mixed rounds (EngineConfig.mixed_rounds: a step with prefill chunks, then decode steps
    of its rows that completed their prompts or decode, in one program), synchronous and
    asynchronous: the outcomes of single steps on random request streams (chunked prefill,
    preemption, aborts, seeded sampling), and mixed rounds did run."""
    config = dataclasses.replace(MIXED_STRESS, async_scheduling=overlap)
    mixed = []

    @HYPOTHESIS
    @given(stream=request_streams())
    def run(stream):
        def instrument(engine):
            launches, inner = [], engine.rounds.launch if engine.rounds else None

            def launch(kind, output, prev_inputs):
                if kind == MIXED:
                    launches.append(len(output.entries))
                return inner(kind, output, prev_inputs)
            if engine.rounds is not None:
                engine.rounds.launch = launch
            return launches

        _, launches = same_outcomes_across(make_engine, (STRESS, config), stream, instrument)
        mixed.append(len(launches))

    run()
    assert sum(mixed) > 0


@given(prompt_len=st.integers(1, 6), num_outputs=st.integers(0, 6),
       max_tokens=st.integers(1, 14), stops=st.sets(st.integers(0, 5), max_size=2),
       tokens=st.lists(st.integers(0, 5), min_size=2, max_size=8), limit=st.integers(2, 20))
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
def test_a_rounds_tokens_are_cut_where_token_by_token_appends_stop(
        prompt_len, num_outputs, max_tokens, stops, tokens, limit):
    """OutputProcessor.append cuts a round's tokens (no detokenizer) at once where appending
    them one by one with stop_reason stops: the first stop id, or the token that reaches
    max_tokens or the context limit, a stop id winning a tie; then the same finish reason,
    reported once to on_finish."""
    assume(prompt_len + num_outputs < limit and num_outputs < max_tokens)
    ended = []
    processor = OutputProcessor(None, lambda r, why: ended.append((r.request_id, why)))
    request = Request(0, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                      seed=0, output_ids=[1] * num_outputs, group_id=0,
                      stop_ids=frozenset(stops), first_token_time=0.0)
    processor.add(0, [request])
    want, reason = list(request.output_ids), None
    for token in tokens:  # the reference: token by token
        want.append(token)
        reason = stop_reason(Request(0, request.prompt_ids, request.params, seed=0,
                                     output_ids=want, stop_ids=request.stop_ids), token, limit)
        if reason is not None:
            break
    delta = processor.append(request, list(tokens), None, 1.0, limit)
    assert request.output_ids == want
    assert delta.token_ids == want[num_outputs:]
    assert (delta.finish_reason, request.finish_reason) == (reason, reason)
    assert ended == ([] if reason is None else [(0, reason)])
    assert processor.finished_request_ids() == ([] if reason is None else [0])
