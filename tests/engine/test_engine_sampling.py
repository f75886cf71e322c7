"""Sampling parameters end to end through the engine: logprobs of the chosen and top-N tokens
against the model's own log-softmax, and repetition / presence / frequency penalties against a
numpy reference (the models and engines of tests/engine/test_continuous_batching.py)."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from tests.engine.test_continuous_batching import (CFG, PAGE, STRESS, check_all_free,
                                                   make_engine, model, random_prompt)

# The fixtures `model` and `make_engine` are test_continuous_batching's (module-scoped: this
# module builds its own instances); pytest finds them by name in this module's namespace.
FIXTURES = (model, make_engine)


# ------------------------------------------------------------------------------------- logprobs

def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_logits(model, sequences):
    """Raw logits of every position of each sequence, from one fresh full-sequence prefill
    (rows padded at the end to one length: causal, so padding changes no earlier position)."""
    width = max(len(s) for s in sequences)
    rows = np.asarray([list(s) + [3] * (width - len(s)) for s in sequences], np.int32)
    return full_sequence_logits(CFG, model, rows, page_size=PAGE)


def test_logprobs_match_the_models_log_softmax(make_engine, model):
    rng = np.random.default_rng(24)
    prompts = [random_prompt(rng, 11), random_prompt(rng, 30)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=1.2, seed=4)]
    engine = make_engine(STRESS)
    outs = engine.generate(prompts, params)
    logits = reference_logits(model, [o.prompt_ids + o.output_ids for o in outs])
    for out, p, row in zip(outs, params, logits):
        assert len(out.outputs[0].logprobs) == len(out.output_ids) == 6
        for t, (token, (chosen, top)) in enumerate(zip(out.output_ids, out.outputs[0].logprobs)):
            expected = log_softmax(row[len(out.prompt_ids) + t - 1])
            assert chosen == pytest.approx(expected[token], abs=1e-4)
            assert len(top) == p.logprobs
            values = list(top.values())
            assert values == sorted(values, reverse=True)
            assert list(top) == np.argsort(-expected)[:p.logprobs].tolist()
            np.testing.assert_allclose(values, np.sort(expected)[::-1][:p.logprobs], atol=1e-4)
            if p.temperature == 0:
                assert token == next(iter(top)) and chosen == pytest.approx(values[0])
    check_all_free(engine)


# ------------------------------------------------------------------------------------ penalties

def numpy_penalized(logits, prompt, output, rep, presence, frequency):
    """HF repetition penalty over prompt and output tokens; OpenAI presence / frequency
    penalties over output tokens; in float64."""
    x = np.asarray(logits, np.float64).copy()
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in collections.Counter(output).items():
        x[t] -= frequency * c + presence
    return x


def test_penalties_from_the_count_table_match_numpy():
    """apply_penalties over count-table rows written from histories (prompt and output tokens,
    longer than one write chunk too) on fresh random logits: float32 against the float64
    reference within 1e-5 relative, for rows whose tokens repeat, appear in both prompt and
    output, or are absent. A rewritten slot forgets its previous owner."""
    import jax

    from engine import penalty_counts
    from engine.penalty_counts import PenaltyCounts
    from engine.sampling import apply_penalties
    rng = np.random.default_rng()
    vocab, rows = 50, 6
    prompts = [rng.integers(0, vocab, n).tolist() for n in (1, 7, 30, 0, 12, 3)]
    outputs = [rng.integers(0, vocab, n).tolist() for n in (0, 9, 40, 5, 1, 300)]
    outputs[1] += prompts[1][:3]  # output tokens the prompt has too
    prompts[2] = rng.integers(0, vocab, penalty_counts.WRITE_CHUNK + 5).tolist()  # two chunks
    table = PenaltyCounts(rows, vocab)
    slots = rng.permutation(table.rows)[:rows]
    for slot in slots:  # stale owners, overwritten below
        table.write(int(slot), rng.integers(0, vocab, 9).tolist(), [1, 2, 3])
    for slot, prompt, output in zip(slots, prompts, outputs):
        table.write(int(slot), prompt, output)
    rep, pres, freq = (rng.uniform(lo, hi, rows).astype(np.float32)
                       for lo, hi in ((0.5, 3.0), (-2, 2), (-2, 2)))
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    counts = np.asarray(table.device)[slots]
    got = np.asarray(jax.jit(apply_penalties)(logits, counts, rep, pres, freq))
    for i in range(rows):
        want = numpy_penalized(logits[i], prompts[i], outputs[i], float(rep[i]), float(pres[i]),
                               float(freq[i]))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_the_penalized_sampler_counts_the_tokens_it_draws():
    """Over several steps, `sample_penalized` draws each row's argmax of the numpy-penalized
    logits and counts the drawn token in its slot, but only for counted rows (a prefill chunk
    short of its prompt's end is not); padding rows read and write nothing."""
    from engine.penalty_counts import PenaltyCounts
    from engine.sampling import (NO_SLOT, PenaltyRows, SamplingArrays, pack_sampling,
                                 sample_penalized)
    rng = np.random.default_rng()
    vocab, rows = 40, 3
    table = PenaltyCounts(8, vocab)
    prompts = [rng.integers(0, vocab, 6).tolist() for _ in range(rows)]
    slots = np.array([5, 0, 3], np.int32)
    for slot, prompt in zip(slots, prompts):
        table.write(int(slot), prompt, [])
    outputs = [[] for _ in range(rows)]
    counted = np.array([True, True, False])
    strengths = np.array([[1.5] * rows, [0.7] * rows, [0.4] * rows], np.float32)
    penalties = PenaltyRows(slots, counted, strengths).padded(4)
    assert penalties.slots[-1] == NO_SLOT
    floats, ints = pack_sampling(SamplingArrays.defaults(4))
    for _ in range(6):
        logits = rng.normal(0, 1, (4, vocab)).astype(np.float32)
        tokens, table.device = sample_penalized(logits, floats, ints, table.device,
                                                penalties.packed(), penalties.strengths,
                                                mode="greedy")
        tokens = np.asarray(tokens)
        for i in range(rows):
            want = numpy_penalized(logits[i], prompts[i], outputs[i], 1.5, 0.7, 0.4)
            assert tokens[i] == int(np.argmax(want))
            if counted[i]:
                outputs[i].append(int(tokens[i]))
    after = np.asarray(table.device)
    fresh = PenaltyCounts(8, vocab)
    for slot, prompt, output in zip(slots, prompts, outputs):
        fresh.write(int(slot), prompt, output)
    np.testing.assert_array_equal(after, np.asarray(fresh.device))


def test_penalties_match_numpy_and_push_the_expected_way(make_engine, model):
    """Every generated token is the argmax of the numpy-penalized model logits; where it differs
    from the unpenalized argmax g, it moved the way the penalty pushes. The prompt repeats a few
    tokens and its plain greedy first token is one of them, so the repetition penalty changes
    the very first token."""
    engine = make_engine(STRESS)
    rng = np.random.default_rng(25)
    plain = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(200):
        prompt = random_prompt(rng, 12) * 3
        [first] = engine.generate([prompt], plain)
        if first.output_ids[0] in prompt:
            break
    else:
        pytest.fail("no prompt whose greedy first token repeats a prompt token")
    cases = {"repetition": SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=3.0),
             "presence": SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0),
             "frequency": SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=2.0),
             "negative presence": SamplingParams(max_tokens=10, ignore_eos=True,
                                                 presence_penalty=-2.0),
             "plain": SamplingParams(max_tokens=10, ignore_eos=True)}
    outs = dict(zip(cases, engine.generate([prompt] * len(cases), list(cases.values()))))
    check_all_free(engine)
    logits = dict(zip(cases, reference_logits(model, [prompt + o.output_ids
                                                       for o in outs.values()])))
    assert outs["repetition"].output_ids[0] != first.output_ids[0]
    for name, p in cases.items():
        output, moved = outs[name].output_ids, 0
        for t, x in enumerate(output):
            raw = logits[name][len(prompt) + t - 1]
            before = output[:t]
            penalized = numpy_penalized(raw, prompt, before, p.repetition_penalty,
                                        p.presence_penalty, p.frequency_penalty)
            assert x == int(np.argmax(penalized)), (name, t)
            g = int(np.argmax(raw))
            if x == g:
                continue
            moved += 1
            seen = set(prompt) | set(before)
            if name == "repetition":
                assert g in seen and x not in seen
            elif name == "presence":
                assert g in before and x not in before
            elif name == "frequency":
                assert before.count(g) > before.count(x)
            elif name == "negative presence":
                assert x in before and g not in before
        assert (moved > 0) == (name != "plain"), (name, output)
