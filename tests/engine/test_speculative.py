"""Speculative decoding: greedy outputs equal plain greedy decoding (n-gram and draft proposers,
mixed batches, preemption, the real SmolLM2), exactness of `verify`'s rejection sampling, the
output distribution through the engine against the model's exact one, the batch cut-off and
adaptive k, and the acceptance counters.

Speed: the engines of one target model share one jitted step (see make_engine), so each bucket
program is compiled once for the module; all tiny engines have the same sizes, so the same
padded shapes recur.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from configs.model import TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from engine.sampling import sample
from engine.speculative import SpecConfig, SpecStats, propose_ngram, verify
from models.weights import model_from_pure_dict
from tests.engine.weights import unit_scale_pure_dict

CFG = TINY_LLAMA31  # untied output head: greedy output does not just echo the input
DRAFT_CFG = CFG.replace(num_layers=1, name="tiny-llama31-draft")
K = 3
ENGINE = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=16,
                      num_pages=16)
# 5 pages: two requests of 33+ tokens (3 pages each) do not fit together, so requests preempt.
TINY_POOL = dataclasses.replace(ENGINE, num_pages=5)


def check_all_free(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.pool.ref_counts == [0] * engine.pool.num_pages
    engine.pool.check_invariants()


def check_stats_add_up(stats: SpecStats) -> None:
    """The counters agree with each other (per-position rates need not decrease)."""
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.drafted_per_position) == stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    if stats.num_drafts:
        assert stats.drafted_per_position[0] == stats.num_drafts
    assert all(0 <= a <= d for a, d in zip(stats.accepted_per_position,
                                           stats.drafted_per_position))
    summary = stats.as_dict()
    assert all(0.0 <= r <= 1.0 for r in summary["acceptance_per_position"])
    assert summary["mean_acceptance_length"] == pytest.approx(
        1 + stats.num_accepted_tokens / max(stats.num_drafts, 1))


# ------------------------------------------------------------------------- tiny models, engines

@pytest.fixture(scope="module")
def target():
    return model_from_pure_dict(CFG, unit_scale_pure_dict(CFG, 3, final_norm=0.3))


@pytest.fixture(scope="module")
def small_draft():
    """A 1-layer draft: the target's embedding, head, final norm and first layer (as
    scripts/distill_draft.py starts one), so it agrees with the target now and then."""
    pure = unit_scale_pure_dict(CFG, 3, final_norm=0.3)
    pure["layers"] = {0: pure["layers"][0]}
    return model_from_pure_dict(DRAFT_CFG, pure)


@pytest.fixture(scope="module")
def make_engine(target, small_draft):
    """make_engine(engine_cfg, method=None|'ngram'|'draft-small'|'draft-self', **spec fields).

    Every engine's target step is one shared jitted function (it reads only the graphdef and the
    config, the same for all), and so is every small draft's; the target as its own draft
    shares the target's.
    """
    steps = {}

    def share(runner, key):
        runner.share_programs(steps.setdefault(key, runner))

    def make(engine_cfg=ENGINE, method=None, **spec_fields):
        spec, draft = None, None
        if method is not None:
            spec = SpecConfig("ngram" if method == "ngram" else "draft",
                              **({"num_speculative_tokens": K} | spec_fields))
            draft = {"draft-small": (DRAFT_CFG, small_draft), "draft-self": (CFG, target)
                     }.get(method)
        engine = LLMEngine(CFG, target, None, engine_cfg, spec, draft)
        share(engine.runner, "target")
        if engine.draft is not None:
            share(engine.draft.runner, "target" if method == "draft-self" else "small")
        return engine

    return make


def repetitive_prompts(seed: int, lengths) -> list[list[int]]:
    """Prompts that repeat a short random phrase (n-gram lookup finds matches in them)."""
    rng = np.random.default_rng(seed)
    prompts = []
    for length in lengths:
        phrase = rng.integers(3, CFG.vocab_size, int(rng.integers(3, 6))).tolist()
        prompts.append((phrase * 8)[:length])
    return prompts


def mixed_requests():
    """Greedy speculating requests (one may stop at EOS) and non-speculating ones (logprobs;
    penalties, counted on the device) for one batch."""
    prompts = repetitive_prompts(0, [15, 12, 14, 9, 13, 11])
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=28),
              SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=18, ignore_eos=True, repetition_penalty=2.0,
                             frequency_penalty=1.0)]
    return prompts, params


@pytest.fixture(scope="module")
def plain_outputs(make_engine):
    """Plain greedy outputs of mixed_requests per engine config (cached)."""
    cache = {}

    def get(engine_cfg):
        if engine_cfg not in cache:
            engine = make_engine(engine_cfg)
            cache[engine_cfg] = engine.generate(*mixed_requests())
            check_all_free(engine)
        return cache[engine_cfg]

    return get


# ------------------------------------------------------------------------------ greedy equality

@pytest.mark.parametrize("engine_cfg", [ENGINE, TINY_POOL], ids=["roomy", "preempting"])
@pytest.mark.parametrize("method", ["ngram", "draft-small", "draft-self"])
def test_greedy_speculation_equals_plain_greedy(make_engine, plain_outputs, method, engine_cfg):
    """Token for token the plain greedy outputs, in a batch mixed with a non-speculating request
    (logprobs) and under preemption; every page is free at the end."""
    engine = make_engine(engine_cfg, method)
    outputs = engine.generate(*mixed_requests())
    plain = plain_outputs(engine_cfg)
    for got, want in zip(outputs, plain):
        assert got.output_ids == want.output_ids
        assert got.finish_reason == want.finish_reason
    assert engine.stats.num_generated_tokens == sum(
        len(sample.token_ids) for o in outputs for sample in o.outputs)
    for (got_lp, got_top), (want_lp, want_top) in zip(outputs[3].outputs[0].logprobs,
                                                       plain[3].outputs[0].logprobs):
        assert got_lp == pytest.approx(want_lp, abs=1e-4) and set(got_top) == set(want_top)
    check_all_free(engine)
    stats = engine.spec_stats
    check_stats_add_up(stats)
    assert stats.num_drafts > 0
    if method == "draft-self":  # the target as its own draft: every proposal is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:  # some proposals are accepted and some rejected
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()
    if engine_cfg is TINY_POOL:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", [None, "draft-self"])
def test_speculated_tokens_are_prefix_cached(make_engine, method):
    """Pages filled by accepted proposals join the prefix cache like decoded ones: a follow-up
    request that extends the whole sequence hits all its full pages (a 13-token prompt puts
    page boundaries inside the accepted runs)."""
    engine = make_engine(ENGINE, method)
    prompt = repetitive_prompts(0, [13])[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=45, ignore_eos=True))
    sequence = prompt + out.output_ids
    [follow_up] = engine.generate([sequence + [5]], SamplingParams(max_tokens=1))
    assert follow_up.num_prefix_hit_tokens == len(sequence) // 16 * 16
    check_all_free(engine)


def test_speculation_stops_at_the_end_of_a_small_pool(make_engine):
    """A sequence that fills the whole KV cache (3 pages, less than max_model_len) ends there
    like plain decoding; proposals never reach past the pool (the request would preempt itself
    and the engine stall)."""
    small = dataclasses.replace(ENGINE, num_pages=3)
    prompt = repetitive_prompts(0, [14])[0]
    params = SamplingParams(max_tokens=45, ignore_eos=True)
    [want] = make_engine(small).generate([prompt], params)
    engine = make_engine(small, "draft-self")
    [got] = engine.generate([prompt], params)
    assert got.output_ids == want.output_ids and len(prompt + got.output_ids) == 3 * 16
    check_all_free(engine)


def test_a_draft_catches_up_on_a_long_prompt_one_chunk_a_step(make_engine):
    """A draft new to a prompt longer than the step's token budget catches up one budget's
    chunk an engine step (the row decodes plainly meanwhile, then speculates), so no step runs
    the draft over the whole prompt; the tokens stay plain greedy's."""
    budget = 32
    engine_cfg = dataclasses.replace(ENGINE, max_model_len=192, max_num_batched_tokens=budget)
    prompt = np.random.default_rng(1).integers(3, CFG.vocab_size, 4 * budget + 5).tolist()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    [want] = make_engine(engine_cfg).generate([prompt], params)
    engine = make_engine(engine_cfg, "draft-self")
    runner = engine.draft.runner
    run, draft_tokens = runner.execute_padded, []

    def counting(batch):
        draft_tokens[-1] += len(batch.token_ids)
        return run(batch)

    runner.execute_padded = counting
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished():
        draft_tokens.append(0)
        engine.step()
    got = engine.output_of(request_id)
    assert got.output_ids == want.output_ids
    # A step's draft work: one catch-up chunk, then K proposing steps (K + 1 tokens, then one
    # each). The whole prompt at once would be 4 chunks.
    assert max(draft_tokens) <= budget + 2 * K
    assert engine.spec_stats.num_drafts > 0
    check_all_free(engine)


def test_smollm2_ngram_repeat_paragraph_equals_plain_greedy(smollm2):
    """The real model repeating a paragraph: n-gram speculation gives the plain greedy tokens
    with well over one token per verification step."""
    paragraph = ("The quick brown fox jumps over the lazy dog. The dog wakes up, looks around, "
                 "and goes back to sleep under the old oak tree.")
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{
        "role": "user",
        "content": f"Repeat the following paragraph exactly, word for word:\n\n{paragraph}"}]))
    engine_cfg = EngineConfig(max_model_len=128, max_num_seqs=1, max_num_batched_tokens=128,
                              page_size=16, num_pages=8)
    params = SamplingParams(max_tokens=24)
    plain = LLMEngine(smollm2.cfg, smollm2.model, tokenizer, engine_cfg)
    [want] = plain.generate([prompt], params)
    spec = LLMEngine(smollm2.cfg, smollm2.model, tokenizer, engine_cfg, SpecConfig("ngram", K))
    spec.runner.share_programs(plain.runner)  # the same model: reuse the compiled programs
    [got] = spec.generate([prompt], params)
    assert got.output_ids == want.output_ids
    assert "sleep under the old oak tree" in got.text
    check_stats_add_up(spec.spec_stats)
    assert spec.spec_stats.mean_acceptance_length > 1.5, spec.spec_stats.as_dict()
    check_all_free(spec)


# ----------------------------------------------------------------- verify: sampling exactness

def filtered_probs(logits: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    """softmax(logits / temperature) restricted to the nucleus (the most likely tokens whose
    mass before them is < top_p), renormalized; float64, over the last axis."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p >= 1.0:
        return p
    order = np.argsort(-p, axis=-1)
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True)


def tv_bound(num_samples: int, num_values: int, delta: float = 1e-6) -> float:
    """A bound that the total-variation distance of an empirical distribution of n samples from
    its true one exceeds with probability < delta: E[TV] <= sqrt(V / n) / 2 (Cauchy-Schwarz),
    plus McDiarmid's deviation sqrt(ln(1 / delta) / (2 n)) (one sample moves TV by 1 / n)."""
    return (0.5 * math.sqrt(num_values / num_samples)
            + math.sqrt(math.log(1 / delta) / (2 * num_samples)))


def total_variation(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    return 0.5 * np.abs(counts / len(samples) - probs).sum()


VOCAB = 8
ROWS = 20000


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.3, 1.0), (1.0, 0.9)])
@pytest.mark.parametrize("point_mass", [False, True], ids=["draft", "ngram"])
def test_verify_outputs_follow_the_target_distribution(temperature, top_p, point_mass):
    """The first new token ~ p_0, and given that proposal 0 was accepted, the second ~ p_1,
    whatever the proposer's q (here unlike p and zero on some tokens); n-gram proposals are
    point masses."""
    rng = np.random.default_rng(int(temperature * 10) + 7 * point_mass)
    target_logits = 1.5 * rng.standard_normal((3, VOCAB))  # positions 0..2 (K = 2)
    p = filtered_probs(target_logits, temperature, top_p)
    if point_mass:  # proposals as prompt lookup makes them: mostly one continuation
        usual = np.argsort(-p, axis=-1)[:2, 1]  # each position's second most likely token
        draft_tokens = np.where(rng.random((ROWS, 2)) < 0.7, usual,
                                rng.integers(0, VOCAB, (ROWS, 2)))
        draft_probs = None
    else:
        q = rng.dirichlet(np.ones(VOCAB), size=2)
        q[:, :2] = 0.0  # the draft never proposes tokens 0 and 1
        q /= q.sum(-1, keepdims=True)
        draft_tokens = np.stack([rng.choice(VOCAB, ROWS, p=q[i]) for i in range(2)], axis=1)
        draft_probs = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (ROWS, 2, VOCAB))
    num_draft = np.where(np.arange(ROWS) % 2 == 0, 2, 1).astype(np.int32)  # K = 2 and K = 1
    accepted, tokens = verify(
        jnp.broadcast_to(jnp.asarray(target_logits, jnp.float32), (ROWS, 3, VOCAB)),
        jnp.asarray(draft_tokens, jnp.int32), jnp.asarray(num_draft), draft_probs,
        jnp.full(ROWS, temperature, jnp.float32), jnp.zeros(ROWS, jnp.int32),
        jnp.full(ROWS, top_p, jnp.float32), jnp.zeros(ROWS, jnp.float32),
        jnp.arange(ROWS, dtype=jnp.uint32), jnp.full(ROWS, 5, jnp.int32))
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    assert ((0 <= accepted) & (accepted <= num_draft)).all()
    # Accepted tokens are the proposals.
    for i in range(2):
        took = accepted > i
        assert (tokens[took, i] == draft_tokens[took, i]).all()
    assert total_variation(tokens[:, 0], p[0]) < tv_bound(ROWS, VOCAB)
    second = tokens[accepted >= 1, 1]
    assert 0.05 * ROWS < len(second) < 0.95 * ROWS  # acceptance and rejection both happen
    assert total_variation(second, p[1]) < tv_bound(len(second), VOCAB)


def verify_args(rows: int, rng):
    """Random sampling arguments of `rows` rows for verify / sample: greedy, temperature, top-k,
    top-p and min-p rows mixed, random seeds and steps."""
    return dict(temperature=jnp.asarray(rng.choice([0.0, 0.6, 1.0, 1.5], rows), jnp.float32),
                top_k=jnp.asarray(rng.choice([0, 5], rows), jnp.int32),
                top_p=jnp.asarray(rng.choice([1.0, 0.8], rows), jnp.float32),
                min_p=jnp.asarray(rng.choice([0.0, 0.05], rows), jnp.float32),
                seeds=jnp.asarray(rng.integers(0, 2**32, rows), jnp.uint32),
                steps=jnp.asarray(rng.integers(0, 100, rows), jnp.int32))


def test_verify_without_proposals_samples_like_the_sampler():
    """Rows with num_draft 0 give exactly engine.sampling.sample's token for the same logits,
    parameters, seed and step, with and without draft distributions in the call.
    (The shapes are those of the test above: its compiled programs are reused.)"""
    rng = np.random.default_rng(1)
    a = verify_args(ROWS, rng)
    target_logits = jnp.asarray(2 * rng.standard_normal((ROWS, 3, VOCAB)), jnp.float32)
    want = sample(target_logits[:, 0], a["temperature"], a["top_k"], a["top_p"], a["seeds"],
                  a["steps"], a["min_p"])
    junk = jnp.asarray(rng.integers(0, VOCAB, (ROWS, 2)), jnp.int32)  # beyond num_draft
    for draft_probs in (None, jax.nn.softmax(jnp.asarray(
            rng.standard_normal((ROWS, 2, VOCAB)), jnp.float32))):
        accepted, tokens = verify(target_logits, junk, jnp.zeros(ROWS, jnp.int32), draft_probs,
                                  a["temperature"], a["top_k"], a["top_p"], a["min_p"],
                                  a["seeds"], a["steps"])
        assert (np.asarray(accepted) == 0).all()
        np.testing.assert_array_equal(np.asarray(tokens)[:, 0], np.asarray(want))


def test_verify_greedy_rows_accept_the_argmax_prefix():
    """Greedy rows keep the proposals while they are the argmax, then take the argmax, even in a
    batch with sampled rows."""
    rng = np.random.default_rng(2)
    a = verify_args(ROWS, rng)
    logits = rng.standard_normal((ROWS, 3, VOCAB)).astype(np.float32)  # K = 2
    best = logits.argmax(-1)  # [ROWS, 3]
    wrong = (best + 1) % VOCAB
    case = np.arange(ROWS) % 3  # 0: both right (bonus token too); 1: second wrong; 2: first
    drafts = np.where((case == 1)[:, None] & (np.arange(2) == 1), wrong[:, :2], best[:, :2])
    drafts = np.where((case == 2)[:, None] & (np.arange(2) == 0), wrong[:, :2], drafts)
    accepted, tokens = verify(jnp.asarray(logits), jnp.asarray(drafts, jnp.int32),
                              jnp.full(ROWS, 2, jnp.int32), None, a["temperature"], a["top_k"],
                              a["top_p"], a["min_p"], a["seeds"], a["steps"])
    greedy = np.asarray(a["temperature"]) == 0
    accepted, tokens = np.asarray(accepted)[greedy], np.asarray(tokens)[greedy]
    np.testing.assert_array_equal(accepted, np.array([2, 1, 0])[case[greedy]])
    for row, a_ in enumerate(accepted):
        assert tokens[row, : a_ + 1].tolist() == best[greedy][row, : a_ + 1].tolist()


# ------------------------------------------------ the engine's output distribution (vocab 16)

SMALL_VOCAB = TINY_LLAMA31.replace(vocab_size=16, name="tiny-vocab16", bos_token_id=None,
                                   eos_token_ids=())
SMALL_DRAFT = SMALL_VOCAB.replace(num_layers=1, name="tiny-vocab16-draft")
PROMPT = [3, 9, 14, 3, 9]
NUM_REQUESTS = 1536
WAVE = 64


@pytest.fixture(scope="module")
def small_vocab_models():
    """(target, draft, shared jitted steps, the target's continuation_logits): random models of
    16 tokens whose next-token distributions are spread (neither near-uniform nor one-hot), the
    draft's unlike the target's. The logits do not depend on the sampling parameters, so the
    test's parametrizations share them (one reference prefill, compiled once)."""
    target = model_from_pure_dict(SMALL_VOCAB, unit_scale_pure_dict(SMALL_VOCAB, 11, final_norm=1.0))
    draft = model_from_pure_dict(SMALL_DRAFT, unit_scale_pure_dict(SMALL_DRAFT, 12, final_norm=1.0))
    return target, draft, {}, continuation_logits(target)


def continuation_logits(model) -> np.ndarray:
    """The model's logits [t1, t2, len(PROMPT) + 2, 16] of PROMPT + (t1, t2) for every two-token
    continuation (full_sequence_logits: one prefill of all 256 rows)."""
    v = SMALL_VOCAB.vocab_size
    t1, t2 = np.meshgrid(np.arange(v), np.arange(v), indexing="ij")
    rows = np.concatenate([np.tile(PROMPT, (v * v, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    return full_sequence_logits(SMALL_VOCAB, model, rows).reshape(v, v, len(PROMPT) + 2, v)


def exact_joint(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """P(t1, t2, t3) [16, 16, 16] of the first three sampled tokens after PROMPT, from the
    model's continuation_logits and filtered_probs."""
    p1 = filtered_probs(logits[0, 0, len(PROMPT) - 1], temperature, top_p)  # [16]
    p2 = filtered_probs(logits[:, 0, len(PROMPT)], temperature, top_p)  # [t1, 16]
    p3 = filtered_probs(logits[:, :, len(PROMPT) + 1], temperature, top_p)  # [t1, t2, 16]
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p_value(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of integer samples to probs (cells expected < 5 times are pooled)."""
    expected = probs * len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    small = expected < 5
    assert counts[probs == 0].sum() == 0, "a token of probability zero was sampled"
    exp_cells = np.append(expected[~small], expected[small].sum())
    obs_cells = np.append(counts[~small], counts[small].sum())
    keep = exp_cells > 0
    chi2 = ((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum()
    return float(stats.chi2.sf(chi2, keep.sum() - 1))


@pytest.mark.parametrize("temperature, top_p", [(0.8, 1.0), (1.3, 0.85)])
def test_engine_sampling_distribution_matches_the_target(small_vocab_models, temperature, top_p):
    """Over 1536 seeded requests, the first three tokens (t1 from the prefill, t2 and t3 from
    draft speculation with k = 2) fit the target's exact distribution (chi-square on t2, t3 and
    the pair (t2, t3)). t1 comes from plain sampling of the prefill, which checks the
    reference itself."""
    target, draft, steps, logits = small_vocab_models
    joint = exact_joint(logits, temperature, top_p)
    p1 = joint.sum((1, 2))
    assert 0.2 < p1.max() < 0.9  # spread, neither uniform nor one-hot
    # Waves of WAVE requests: each wave's prompts are prefilled in one step (a prefill step's
    # cost on the CPU grows with the square of its sequences).
    engine_cfg = EngineConfig(max_model_len=16, max_num_seqs=WAVE,
                              max_num_batched_tokens=WAVE * len(PROMPT), page_size=16,
                              num_pages=WAVE)
    spec = SpecConfig("draft", num_speculative_tokens=2, max_batch=WAVE)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature,
                             top_p=top_p, seed=i) for i in range(NUM_REQUESTS)]
    engine = LLMEngine(SMALL_VOCAB, target, None, engine_cfg, spec, (SMALL_DRAFT, draft))
    # one compiled program per shape across this test's parameters
    engine.runner.share_programs(steps.setdefault("target", engine.runner))
    engine.draft.runner.share_programs(steps.setdefault("draft", engine.draft.runner))
    v = SMALL_VOCAB.vocab_size
    outs = np.asarray([o.output_ids[:3] for start in range(0, NUM_REQUESTS, WAVE)
                       for o in engine.generate([PROMPT] * WAVE, params[start:start + WAVE])])
    check_all_free(engine)
    for label, samples, probs in (
            ("t1", outs[:, 0], p1),
            ("t2", outs[:, 1], joint.sum((0, 2))),
            ("t3", outs[:, 2], joint.sum((0, 1))),
            ("(t2, t3)", outs[:, 1] * v + outs[:, 2], joint.sum(0).reshape(-1))):
        p_value = chi_square_p_value(samples, probs)
        assert p_value > 1e-4, (label, p_value)
    # The draft disagrees with the target often enough to exercise acceptance and rejection.
    stats_ = engine.spec_stats
    check_stats_add_up(stats_)
    assert stats_.num_drafts >= NUM_REQUESTS
    assert 0.15 < stats_.acceptance_rate < 0.9, stats_.as_dict()


# --------------------------------------------------- batch cut-off, adaptive k, counters, n-grams

def record_lookaheads(engine):
    """Wraps the speculative component's planning to log each step's {request id: lookahead}."""
    log, plan = [], engine.spec.plan

    def planned(context_limit):
        plan(context_limit)
        log.append({r.request_id: r.lookahead for r in engine.scheduler.running})

    engine.spec.plan = planned
    return log


def test_no_speculation_above_the_batch_cut_off(make_engine):
    """spec max_batch=1: two running requests make no proposals; one alone does."""
    prompts = repetitive_prompts(5, [12, 12])
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = make_engine(ENGINE, "ngram", max_batch=1)
    log = record_lookaheads(engine)
    engine.generate(prompts, params)
    assert engine.spec_stats.num_drafts == 0
    assert all(k == 0 for step in log for k in step.values())
    check_all_free(engine)
    alone = make_engine(ENGINE, "ngram", max_batch=1)
    alone.generate(prompts[:1], params)
    assert alone.spec_stats.num_drafts > 0


def record_verifications(engine):
    """Wraps the speculative component's post-verification update to log (request id,
    drafted, accepted)."""
    log, after = [], engine.spec.after_verification

    def logged(request, output, row, accepted, stats):
        log.append((request.request_id, len(request.spec_tokens), accepted))
        after(request, output, row, accepted, stats)

    engine.spec.after_verification = logged
    return log


def test_lookahead_adapts_to_acceptance(make_engine):
    """k starts at num_speculative_tokens and stays there while everything is accepted (the
    target as its own draft); with a poor draft it never grows after a step that accepted
    nothing, and it shrinks below num_speculative_tokens."""
    prompts = repetitive_prompts(6, [10, 13])
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    full = make_engine(ENGINE, "draft-self")
    log = record_lookaheads(full)
    full.generate(prompts, params)
    for request_id in range(len(prompts)):
        lookaheads = [step[request_id] for step in log if step.get(request_id)]
        # Full acceptance: every step proposes K but the last (cut by the room to max_tokens).
        assert lookaheads[:-1] == [K] * (len(lookaheads) - 1) and 0 < lookaheads[-1] <= K
    poor = make_engine(ENGINE, "draft-small")
    verified = record_verifications(poor)
    poor.generate(prompts, params)
    check_stats_add_up(poor.spec_stats)
    for request_id in range(len(prompts)):
        steps = [(drafted, accepted) for rid, drafted, accepted in verified if rid == request_id]
        assert steps[0][0] == K
        assert min(drafted for drafted, _ in steps) < K
        for (drafted, accepted), (next_drafted, _) in zip(steps, steps[1:]):
            if accepted == 0:
                assert next_drafted <= drafted
    assert any(accepted == 0 for _, _, accepted in verified)


@pytest.mark.parametrize("k", [0, 16])
def test_speculation_lengths_beyond_a_verification_program_are_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be 1 to 15"):
        SpecConfig("ngram", k)


def test_spec_stats_counts():
    stats_ = SpecStats()
    for drafted, accepted in [(4, 4), (4, 0), (2, 1), (0, 0), (3, 3)]:
        stats_.record(drafted, accepted)
    assert (stats_.num_drafts, stats_.num_draft_tokens, stats_.num_accepted_tokens) == (4, 13, 8)
    assert stats_.drafted_per_position == [4, 4, 3, 2]
    assert stats_.accepted_per_position == [3, 2, 2, 1]
    assert stats_.mean_acceptance_length == 3.0
    check_stats_add_up(stats_)


def test_propose_ngram_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" last occurred before "7 8": the latest match of the longest suffix wins.
    assert propose_ngram(tokens, 3, 1, 4) == [7, 8, 5]
    assert propose_ngram(tokens, 1, 1, 4) == [7]
    assert propose_ngram([4, 5, 6], 2, 1, 3) == []  # no earlier occurrence
    assert propose_ngram([5, 6, 5, 6, 5], 4, 2, 2) == [6, 5]  # the proposal may run to the end
    assert propose_ngram([7, 7], 3, 1, 1) == [7]
