"""Continuous batching end to end: random request streams with chunked prefill, preemption,
aborts and priorities against each request run alone; chunk sizes; prefix caching; n > 1; stop
strings; admission errors; and the real SmolLM2. (Logprobs and penalties:
tests/engine/test_engine_sampling.py.)

Speed: every engine built by `make_engine` shares one jitted model step (per model), so a bucket
program compiled by one engine is reused by every later one (a fresh LLMEngine would otherwise
compile all its programs again). All tiny engines have the same cache (6 pages of 16 tokens),
max_num_seqs and max_model_len, so the same padded shapes recur; they differ only in host-side
settings (token budget, chunking, prefix caching).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from configs.model import TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import FinishReason, SamplingParams
from tests.engine.weights import unit_scale_model

CFG = TINY_LLAMA31  # untied output head: greedy output does not just repeat the input
PAGE = 16
# The reference ("alone") engine: no prefix caching, no chunking (96 tokens >= max_model_len).
BASE = EngineConfig(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=96, page_size=PAGE,
                    num_pages=6, enable_prefix_caching=False, enable_chunked_prefill=False)
# Stress: prefix caching, chunks of 16 tokens, and 6 pages: two requests of 49+ tokens (4 pages
# each) already do not fit together, so running requests get preempted.
STRESS = dataclasses.replace(BASE, max_num_batched_tokens=16, enable_chunked_prefill=True,
                             enable_prefix_caching=True)
HYPOTHESIS = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def model():
    return unit_scale_model(CFG, 3)


@pytest.fixture(scope="module")
def make_engine(model):
    """make_engine(engine_cfg=BASE, tokenizer=None): a fresh engine of the module's model."""
    return engine_maker(model)


def check_pages(engine: LLMEngine) -> None:
    """Pool invariants, and reference counts equal to the running requests holding each page."""
    pool = engine.pool
    pool.check_invariants()
    holders = collections.Counter(p for r in engine.scheduler.running for p in r.pages)
    assert pool.ref_counts == [holders.get(p, 0) for p in range(pool.num_pages)]
    assert pool.num_free == pool.num_pages - len(holders)
    waiting = [w[2] for w in engine.scheduler._waiting]
    assert all(not r.pages for r in waiting)  # preempted and queued requests hold no pages


def check_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished() and engine.num_running == engine.num_waiting == 0
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.pool.ref_counts == [0] * engine.pool.num_pages
    engine.pool.check_invariants()


def random_prompt(rng, n):
    return rng.integers(3, CFG.vocab_size, n).tolist()


def recording_schedule(engine):
    """Wraps engine.scheduler.schedule to log each step's [(request, computed before, new)]."""
    log, schedule = [], engine.scheduler.schedule

    def record(*args, **kwargs):
        out = schedule(*args, **kwargs)
        log.append([(r, r.num_computed_tokens, count)
                    for r, count in zip(out.requests, out.counts)])
        return out

    engine.scheduler.schedule = record
    return log


# ------------------------------------------------------------------------ alone references

@pytest.fixture(scope="module")
def alone(make_engine):
    """alone(prompt, params) -> (output ids, finish reason) of the request alone in a fresh
    reference engine (no prefix caching, no chunking); cached per (prompt, params)."""
    results = {}

    def run(prompt, params):
        key = (tuple(prompt), params)
        if key not in results:
            engine = make_engine(BASE)
            [out] = engine.generate([list(prompt)], params)
            results[key] = (out.output_ids, out.finish_reason)
            check_all_free(engine)
        return results[key]

    return run


# --------------------------------------------------------------------- random request streams

@st.composite
def request_streams(draw):
    """A list of requests: prompt (1..40 tokens, often sharing a prefix of one or two pages),
    sampling parameters (greedy, sampled, or with penalties), arrival step, priority and an
    optional abort step."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shared = random_prompt(rng, 2 * PAGE)
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.one_of(st.integers(1, 40), st.integers(30, 40)))  # long ones preempt
        prefix = draw(st.sampled_from([0, 0, PAGE, 2 * PAGE]))
        prompt = (shared[:prefix] + random_prompt(rng, 40))[:length]
        kind = draw(st.sampled_from(["greedy", "sampled", "penalized"]))
        if kind == "greedy":
            params = SamplingParams(max_tokens=draw(st.integers(1, 12)),
                                    ignore_eos=draw(st.booleans()))
        elif kind == "sampled":
            params = SamplingParams(max_tokens=draw(st.integers(1, 12)), ignore_eos=True,
                                    temperature=draw(st.sampled_from([0.7, 1.0, 1.5])),
                                    top_p=draw(st.sampled_from([0.6, 0.9, 1.0])),
                                    seed=draw(st.integers(0, 1000)))
        else:  # counts on the device, kept across preemption
            params = SamplingParams(max_tokens=draw(st.integers(1, 12)), ignore_eos=True,
                                    repetition_penalty=draw(st.sampled_from([1.3, 2.0])),
                                    presence_penalty=draw(st.sampled_from([0.0, 1.0, -1.0])),
                                    frequency_penalty=draw(st.sampled_from([0.0, 0.8])),
                                    temperature=draw(st.sampled_from([0.0, 1.0])),
                                    seed=draw(st.integers(0, 1000)))
        requests.append(dict(prompt=prompt, params=params,
                             arrival=draw(st.integers(0, 8)),
                             priority=draw(st.sampled_from([0, 0, 0, 1, -1])),
                             abort_after=draw(st.one_of(st.none(), st.integers(0, 15)))))
    return requests


def run_stream(engine, stream):
    """Feeds a stream into the engine step by step, checking the pages after every step.

    Returns ({stream index: request id}, {request id: [StreamDelta]}, aborted stream indices).
    """
    ids, deltas, aborted, reported = {}, collections.defaultdict(list), set(), []
    step = 0
    while step == 0 or engine.has_unfinished() or len(ids) < len(stream):
        for i, r in enumerate(stream):
            if r["arrival"] == step:
                ids[i] = engine.add_request(r["prompt"], r["params"], priority=r["priority"])
            if (r["abort_after"] is not None and i in ids and step == r["arrival"] + r["abort_after"]
                    and ids[i] not in reported):
                engine.abort(ids[i])
                aborted.add(i)
        for d in engine.step():
            deltas[d.request_id].append(d)
        reported += engine.finished_request_ids()
        check_pages(engine)
        step += 1
        assert step < 2000, "the engine does not make progress"
    reported += engine.finished_request_ids()
    assert sorted(reported) == sorted(ids.values())  # each reported finished exactly once
    return ids, deltas, aborted


def stream_outcomes(engine, stream) -> dict:
    """Runs a stream (run_stream), checks that no page leaks, that each request's streamed
    tokens are its output and that the engine counted them (EngineStats.num_generated_tokens);
    returns {stream index: (output ids, finish reason)}."""
    ids, deltas, _ = run_stream(engine, stream)
    check_all_free(engine)
    assert engine.stats.num_generated_tokens == sum(
        len(d.token_ids) for per_request in deltas.values() for d in per_request)
    outcomes = {}
    for i, rid in ids.items():
        out = engine.output_of(rid)
        assert [t for d in deltas[rid] for t in d.token_ids] == out.output_ids
        outcomes[i] = (out.output_ids, out.finish_reason)
    return outcomes


def engine_maker(model):
    """make(engine_cfg=BASE, tokenizer=None): engines of one model that share one runner's
    compiled programs (the jitted step reads only the runner's graphdef and model config, the
    same for every engine of this model: each bucket compiles once)."""
    shared = []

    def make(engine_cfg=BASE, tokenizer=None):
        engine = LLMEngine(CFG, model, tokenizer, engine_cfg=engine_cfg)
        shared.append(engine.runner)
        engine.runner.share_programs(shared[0])  # one program per bucket
        return engine

    return make


def same_outcomes_across(make_engine, configs, stream, instrument) -> list:
    """Runs the stream on an engine of each config (stream_outcomes), asserts the outcomes agree
    (assert_same_unless_aborted) and returns the log instrument(engine) made of each run."""
    results, logs = [], []
    for cfg in configs:
        engine = make_engine(cfg)
        logs.append(instrument(engine))
        results.append(stream_outcomes(engine, stream))
    assert_same_unless_aborted(*results)
    return logs


def assert_same_unless_aborted(a: dict, b: dict) -> None:
    """Two runs' stream_outcomes agree for every request that ended by itself in both (an abort
    lands after a different number of tokens when the engines advance differently)."""
    assert a.keys() == b.keys()
    for i in a:
        if FinishReason.ABORT not in (a[i][1], b[i][1]):
            assert a[i] == b[i], i


def test_random_request_streams_equal_each_request_alone(make_engine, alone):
    """Every request finishes or is aborted, no page leaks, and each non-aborted greedy or seeded
    output equals the request's output alone; the streams did preempt, chunk and abort."""
    totals = collections.Counter()

    @HYPOTHESIS
    @given(stream=request_streams())
    def run(stream):
        engine = make_engine(STRESS)
        log = recording_schedule(engine)
        ids, deltas, aborted = run_stream(engine, stream)
        check_all_free(engine)
        totals["preemptions"] += engine.scheduler.num_preemptions
        totals["chunked prompts"] += sum(done + n < len(r.prompt_ids)
                                         for step in log for r, done, n in step)
        for i, r in enumerate(stream):
            out = engine.output_of(ids[i])
            streamed = [t for d in deltas[ids[i]] for t in d.token_ids]
            assert streamed == out.output_ids
            if out.finish_reason == FinishReason.ABORT:
                assert i in aborted
                totals["aborted"] += 1
                continue
            assert deltas[ids[i]][-1].finish_reason == out.finish_reason
            assert (out.output_ids, out.finish_reason) == alone(r["prompt"], r["params"]), i
            totals["finished"] += 1

    run()
    assert all(totals[k] > 0 for k in ("preemptions", "chunked prompts", "aborted", "finished")), \
        totals


def test_preemption_under_a_small_pool_recomputes_the_same_outputs(make_engine, alone):
    """Four 40-token prompts with 12 tokens each need 16 pages; the pool has 6: the youngest is
    preempted (pages freed, computed tokens dropped) and later resumes where it stopped."""
    rng = np.random.default_rng(20)
    prompts = [random_prompt(rng, 40) for _ in range(4)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=5)] * 2
    engine = make_engine(STRESS)
    log = recording_schedule(engine)
    outs = engine.generate(prompts, params)
    check_all_free(engine)
    assert engine.scheduler.num_preemptions > 0
    assert max(sum(n for *_, n in step) for step in log) <= STRESS.max_num_batched_tokens
    for prompt, p, out in zip(prompts, params, outs):
        assert (out.output_ids, out.finish_reason) == alone(prompt, p)
        assert len(out.output_ids) == 12


# ------------------------------------------------------------------------------ chunked prefill

def test_chunk_sizes_1_7_64_equal_unchunked_prefill(make_engine):
    """A 70-token prompt and a short one (added first, so its decodes run beside the long
    prompt's chunks) give the same outputs with token budgets 1, 7 and 64 as unchunked."""
    rng = np.random.default_rng(21)
    prompts = [random_prompt(rng, 9), random_prompt(rng, 70)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, seed=9)]
    engine = make_engine(BASE)
    log = recording_schedule(engine)
    expected = [o.output_ids for o in engine.generate(prompts, params)]
    assert [len(o) for o in expected] == [6, 4]
    assert any(n == 70 for step in log for *_, n in step)  # one-shot prefill of the long prompt
    for chunk in (1, 7, 64):
        engine = make_engine(dataclasses.replace(STRESS, max_num_batched_tokens=chunk))
        log = recording_schedule(engine)
        got = [o.output_ids for o in engine.generate(prompts, params)]
        assert got == expected, chunk
        check_all_free(engine)
        prefill_steps = [n for step in log for r, done, n in step
                         if len(r.prompt_ids) == 70 and done < 70]
        assert max(sum(n for *_, n in step) for step in log) <= chunk
        assert len(prefill_steps) >= math.ceil(70 / chunk)
        if chunk == 7:  # decode tokens of the short request ran in steps with prefill chunks
            assert any(len(step) == 2 for step in log)


# ------------------------------------------------------------------------------ prefix caching

def test_prefix_cache_hits_change_nothing_and_compute_fewer_tokens(make_engine):
    """Four requests with a 48-token system prompt (3 full pages), submitted one after another:
    the same outputs with the prefix cache on and off; with it on, each later request hits the
    3 pages and 3 * 48 fewer tokens are computed."""
    rng = np.random.default_rng(22)
    system = random_prompt(rng, 3 * PAGE)
    prompts = [system + random_prompt(rng, n) for n in (5, 9, 1, 12)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    results = {}
    for caching in (False, True):
        engine = make_engine(dataclasses.replace(STRESS, max_num_batched_tokens=96,
                                                 enable_prefix_caching=caching))
        outs = [engine.generate([p], params)[0] for p in prompts]
        check_all_free(engine)
        results[caching] = (outs, engine.stats.num_computed_tokens, engine.pool)
    (off, computed_off, _), (on, computed_on, pool) = results[False], results[True]
    assert [o.output_ids for o in on] == [o.output_ids for o in off]
    assert [o.num_prefix_hit_tokens for o in off] == [0, 0, 0, 0]
    assert [o.num_prefix_hit_tokens for o in on] == [0, 48, 48, 48]
    assert computed_off - computed_on == 3 * 48
    assert computed_off == sum(len(p) + 6 - 1 for p in prompts)
    assert pool.prefix_hit_tokens == 3 * 48 and 0 < pool.prefix_hit_rate < 1


def test_a_next_turn_hits_the_pages_of_the_previous_output(make_engine):
    """A conversation's second turn (first prompt + first output + new tokens) reuses every full
    page of the first turn, output pages included (keyed when the first request released them),
    and gives the same tokens as without the prefix cache."""
    rng = np.random.default_rng(24)
    first = random_prompt(rng, 20)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    results = {}
    for caching in (False, True):
        engine = make_engine(dataclasses.replace(STRESS, max_num_batched_tokens=96,
                                                 enable_prefix_caching=caching))
        turn1 = engine.generate([first], params)[0]
        history = first + turn1.output_ids  # 50 tokens: 3 full pages, 2 past the prompt's
        turn2 = engine.generate([history + random_prompt(np.random.default_rng(25), 7)],
                                SamplingParams(max_tokens=5, ignore_eos=True))[0]
        check_all_free(engine)
        results[caching] = (turn1.output_ids, turn2)
    assert results[True][0] == results[False][0]
    assert results[True][1].output_ids == results[False][1].output_ids
    assert results[False][1].num_prefix_hit_tokens == 0
    # 49 of the 50 history tokens were computed (the last output token never is): 3 pages
    assert results[True][1].num_prefix_hit_tokens == 3 * PAGE


# ---------------------------------------------------------------------------------------- n > 1

def test_parallel_samples_are_single_seeded_requests_sharing_prompt_pages(make_engine):
    rng = np.random.default_rng(23)
    prompt = random_prompt(rng, 40)  # 2 full pages + 8 tokens
    params = SamplingParams(n=3, max_tokens=8, temperature=1.5, seed=77, ignore_eos=True)
    engine = make_engine(STRESS)
    shared_seen = []
    gid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
        check_pages(engine)
        shared_seen.append(max(engine.pool.ref_counts))
    [done] = engine.finished_request_ids()
    out = engine.output_of(done)
    check_all_free(engine)
    assert gid == done and len(out.outputs) == 3
    samples = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in samples}) == 3, samples
    assert [o.index for o in out.outputs] == [0, 1, 2]
    # The later samples reuse the first one's two full prompt pages.
    assert out.num_prefix_hit_tokens == 2 * 2 * PAGE
    assert max(shared_seen) == 3  # the prompt pages were held by all three samples at once
    single = make_engine(BASE)
    for i, tokens in enumerate(samples):
        [alone] = single.generate([prompt], dataclasses.replace(params, n=1, seed=77 + i))
        assert alone.output_ids == tokens, i


# --------------------------------------------------------------------------------- stop strings

@pytest.fixture(scope="module")
def tokenizer():
    from models.tokenizer import Tokenizer
    directory = os.path.join(os.path.dirname(__file__), os.pardir, "golden", "tiny-llama")
    tok = Tokenizer.from_dir(directory)
    assert tok.vocab_size == CFG.vocab_size
    return tok


def test_stop_strings_cut_the_text_and_never_stream(make_engine, tokenizer):
    engine = make_engine(STRESS, tokenizer=tokenizer)
    prompt = "The quick brown fox jumps over the lazy dog"
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    [full] = engine.generate([prompt], free)
    text = full.text
    assert len(text) >= 12, text
    # A stop string from the middle of the text (its first occurrence), and one never produced.
    start = next(k for k in range(len(text) // 3, len(text) - 4)
                 if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    stop = text[start:start + 3]
    params = dataclasses.replace(free, stop=("\x00never\x00", stop))
    deltas = [d for d in engine.stream([prompt], params)]
    [done] = engine.finished_request_ids()
    out = engine.output_of(done)
    check_all_free(engine)
    assert out.text == text[:start] and out.finish_reason == FinishReason.STOP
    assert "".join(d.text for d in deltas) == out.text
    assert all(stop not in d.text for d in deltas)
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert all(d.finish_reason is None for d in deltas[:-1])
    # Generation stopped at the token that completed the stop string.
    tokens = out.output_ids
    assert tokens == full.output_ids[:len(tokens)]
    assert stop in tokenizer.decode(tokens) and stop not in tokenizer.decode(tokens[:-1])


# ---------------------------------------------------------------------------- abort and admission

def test_abort_frees_the_requests_pages_at_once(make_engine):
    rng = np.random.default_rng(26)
    engine = make_engine(STRESS)
    other = engine.add_request(random_prompt(rng, 3), SamplingParams(max_tokens=30,
                                                                      ignore_eos=True))
    engine.step()
    free_before = engine.pool.num_free
    holder_pages = list(engine.scheduler.running[0].pages)
    victim = engine.add_request(random_prompt(rng, 35),
                                SamplingParams(max_tokens=30, ignore_eos=True, n=2, seed=1,
                                               temperature=1.0))
    for _ in range(5):  # past its chunked prefill, into decoding
        engine.step()
    assert engine.pool.num_free < free_before
    engine.abort(victim)
    check_pages(engine)
    assert [r.pages for r in engine.scheduler.running] == [holder_pages]
    assert engine.pool.num_free == free_before  # the other request still fits in its pages
    assert engine.finished_request_ids() == [victim]
    out = engine.output_of(victim)
    assert [o.finish_reason for o in out.outputs] == [FinishReason.ABORT] * 2
    assert 0 < len(out.outputs[0].token_ids) < 30
    waiting = engine.add_request(random_prompt(rng, 5), SamplingParams(max_tokens=3))
    engine.abort(waiting)  # aborted before it ever ran
    while engine.has_unfinished():
        engine.step()
    assert sorted(engine.finished_request_ids()) == [other, waiting]
    check_all_free(engine)


def test_prompts_that_can_never_run_are_rejected_at_add_request(make_engine):
    small = make_engine(dataclasses.replace(STRESS, num_pages=2))  # 32 tokens in all
    small.add_request(list(range(3, 34)), SamplingParams(max_tokens=1))  # 31 + 1 token fit
    for prompt in (list(range(3, 35)), list(range(3, 43))):
        with pytest.raises(ValueError, match="can never run"):
            small.add_request(prompt, SamplingParams(max_tokens=1))
    engine = make_engine(STRESS)
    for n in (STRESS.max_model_len, STRESS.max_model_len + 5):
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=1))
    assert engine.num_waiting == 0 and small.num_waiting == 1
    check_all_free(engine)


def test_a_request_that_outgrows_the_pool_stops_at_its_capacity(make_engine, alone):
    """A prompt that fits a 2-page pool (32 tokens) but whose output would not: it finishes with
    LENGTH when the pool is full, and a request queued behind it still runs."""
    engine = make_engine(dataclasses.replace(STRESS, num_pages=2))
    prompt = list(range(3, 33))  # 30 tokens
    outs = engine.generate([prompt, [7, 8, 9]], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(outs[0].output_ids) == 2 and outs[0].finish_reason == FinishReason.LENGTH
    assert outs[0].output_ids == alone(prompt, SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(outs[1].output_ids) == 10
    check_all_free(engine)


# ------------------------------------------------------------------------------------- priority

def test_lower_priority_number_runs_first(make_engine):
    """max_num_seqs 1: a request added later with priority -1 runs before the earlier-added
    default-priority ones that wait (the one already running is not interrupted)."""
    engine = make_engine(dataclasses.replace(STRESS, max_num_seqs=1))
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.add_request([5, 6, 7], params)
    engine.step()
    second = engine.add_request([8, 9], params)
    third = engine.add_request([10, 11, 12, 13], params)
    urgent = engine.add_request([14, 15], params, priority=-1)
    order = []
    while engine.has_unfinished():
        engine.step()
        assert engine.num_running <= 1
        order += engine.finished_request_ids()
    assert order == [first, urgent, second, third]
    check_all_free(engine)


# ------------------------------------------------------------------------------- the real model

def test_smollm2_chat_prompts_batched_equal_each_alone(smollm2):
    """Three chat prompts through one engine (greedy, 16 tokens) equal each prompt alone."""
    tok = smollm2.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in
               ("What is the capital of France?", "Write a haiku about the sea.",
                "Give me three tips for sleeping well.")]
    sizes = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
                         page_size=16, num_pages=32)
    params = SamplingParams(max_tokens=16)
    single = LLMEngine(smollm2.cfg, smollm2.model, tok,
                       dataclasses.replace(sizes, enable_prefix_caching=False))
    expected = [single.generate([p], params)[0] for p in prompts]
    batched = LLMEngine(smollm2.cfg, smollm2.model, tok, sizes)
    batched.runner.share_programs(single.runner)  # same model: reuse the compiled programs
    outs = batched.generate(prompts, params)
    for got, want in zip(outs, expected):
        assert got.output_ids == want.output_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
    assert "Paris" in outs[0].text
    assert all(len(o.output_ids) > 4 for o in outs)
    check_all_free(batched)
