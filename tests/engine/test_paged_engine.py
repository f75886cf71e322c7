"""The paged model path end to end: runner, model numerics, engine loop, donation, streaming.

Models are the tiny configs with random float32 weights drawn here at unit scale (the 0.02
initializer leaves every layer a near no-op, so greedy output would just repeat the last token):
attention and MLP then matter, and greedy continuations vary from token to token.
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.model import TINY_LLAMA, TINY_LLAMA31, TINY_QWEN2, ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import FinishReason, SamplingParams
from engine.device_arrays import fetch_samples
from engine.runner import ModelRunner
from engine.step_batch import StepBatch
from engine.sampling import SamplingArrays, logprobs_of, sample
from models.llama import rope_inv_freq
from models.weights import model_from_pure_dict
from tests.engine.weights import unit_scale_pure_dict

CONFIGS = {c.name: c for c in (TINY_LLAMA, TINY_LLAMA31, TINY_QWEN2)}
PAGE = 4
ENGINE_CFG = EngineConfig(max_model_len=64, max_num_seqs=4, page_size=PAGE)


def rel_close(actual, expected, rtol=1e-5, err_msg=""):
    """Elementwise within rtol of each value, plus rtol of the largest magnitude."""
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=rtol,
                               atol=rtol * np.abs(expected).max(), err_msg=err_msg)


# ------------------------------------------------------------------------- models and reference

def hf_rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """HF transformers' default / llama3 rope frequencies, in float64 (written independently)."""
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                      / (s.high_freq_factor - s.low_freq_factor))
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def reference_logits(cfg: ModelConfig, pure: dict, tokens, cached_kv=None) -> np.ndarray:
    """Dense float64 forward of one sequence: [T] token ids -> [T, V] logits. cached_kv: None,
    or a function i -> (k [T, KVH, D] after RoPE, v [T, KVH, D]) whose keys and values layer i's
    attention reads instead of its own (a KV cache's stored rows)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), pure)
    d, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    seq = len(tokens)

    def rms_norm(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)

    def proj(x, layer, name):
        y = x @ layer[name]["kernel"]
        return y + layer[name]["bias"] if "bias" in layer[name] else y

    angles = np.arange(seq)[:, None] * hf_rope_inv_freq(cfg)[None]  # [T, D/2]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None]  # [T, 1, D]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None]

    def rope(x):  # [T, N, D], rotate-half
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    causal = np.tril(np.ones((seq, seq), bool))
    x = p["embed_tokens"]["embedding"][np.asarray(tokens)]  # [T, hidden]
    for i in range(cfg.num_layers):
        layer = p["layers"][i]
        a = layer["self_attn"]
        hn = rms_norm(x, layer["input_layernorm"]["weight"])
        q = rope(proj(hn, a, "q_proj").reshape(seq, h, d))
        if cached_kv is None:
            k = rope(proj(hn, a, "k_proj").reshape(seq, kvh, d))
            v = proj(hn, a, "v_proj").reshape(seq, kvh, d)
        else:
            k, v = cached_kv(i)
        out = np.zeros((seq, h, d))
        for head in range(h):
            kv = head // (h // kvh)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(d)  # [T, T]
            scores = np.where(causal, scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(seq, h * d) @ a["o_proj"]["kernel"]
        hn = rms_norm(x, layer["post_attention_layernorm"]["weight"])
        m = layer["mlp"]
        gate = hn @ m["gate_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * (hn @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
    x = rms_norm(x, p["norm"]["weight"])
    if cfg.tie_word_embeddings:
        return x @ p["embed_tokens"]["embedding"].T
    return x @ p["lm_head"]["kernel"]


# ------------------------------------------------------------------------------ step batches

RAGGED = "query_start_loc" in {f.name for f in dataclasses.fields(StepBatch)}


def step_batch(rows) -> StepBatch:
    """rows: (token list, start, end, physical pages) each: compute tokens [start, end).

    Builds the runner's StepBatch layout: rectangular [B, T] (rows shorter than T padded with
    slot -1), or ragged (flat tokens split by query_start_loc) where the runner uses that.
    """
    b = len(rows)
    w = max(len(pages) for *_, pages in rows)
    tables = np.zeros((b, w), np.int32)
    kv_lens = np.array([end for _, _, end, _ in rows], np.int32)
    counts = np.array([end - start for _, start, end, _ in rows], np.int32)
    per_row = []
    for i, (tokens, start, end, pages) in enumerate(rows):
        pos, pages = np.arange(start, end), np.asarray(pages)
        tables[i, :len(pages)] = pages
        per_row.append((tokens[start:end], pos, pages[pos // PAGE] * PAGE + pos % PAGE))
    if RAGGED:
        start_loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        flat = [np.concatenate([r[j] for r in per_row]).astype(np.int32) for j in range(3)]
        return StepBatch(*flat, tables, query_start_loc=start_loc, kv_lens=kv_lens,
                         logits_indices=start_loc[1:] - 1)
    t = counts.max()
    token_ids = np.zeros((b, t), np.int32)
    positions = np.zeros((b, t), np.int32)
    slots = np.full((b, t), -1, np.int32)
    for i, (tok, pos, slot) in enumerate(per_row):
        token_ids[i, :len(pos)], positions[i, :len(pos)], slots[i, :len(pos)] = tok, pos, slot
    return StepBatch(token_ids, positions, slots, tables, kv_lens, counts - 1)


def run_all_logits(runner: ModelRunner, rows) -> list[np.ndarray]:
    """Logits of every computed token of each row: [end - start, V] per row."""
    logits = np.asarray(runner.execute_all_logits(step_batch(rows)))
    counts = [end - start for _, start, end, _ in rows]
    if RAGGED:
        return np.split(logits, np.cumsum(counts)[:-1])
    return [logits[i, :n] for i, n in enumerate(counts)]


def run_last_logits(runner: ModelRunner, rows) -> np.ndarray:
    """Logits of the last computed token of each row: [B, V]."""
    return np.asarray(runner.execute(step_batch(rows)))





def take_pages(rng, num_pages, *lengths):
    """Disjoint, shuffled physical page lists for sequences of these lengths."""
    perm = rng.permutation(num_pages)
    out, used = [], 0
    for n in lengths:
        k = -(-n // PAGE)
        out.append(perm[used:used + k])
        used += k
    assert used <= num_pages
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request):
    """(cfg, pure weights, runner) per tiny config; the runner's cache has 128 pages of 4."""
    cfg = CONFIGS[request.param]
    pure = unit_scale_pure_dict(cfg, seed=len(request.param))
    model = model_from_pure_dict(cfg, pure)
    return cfg, pure, ModelRunner(cfg, model, num_pages=128, page_size=PAGE)


# --------------------------------------------------------------------------- model numerics

def test_rope_frequencies_match_hf_formula():
    for cfg in CONFIGS.values():
        np.testing.assert_allclose(rope_inv_freq(cfg), hf_rope_inv_freq(cfg), rtol=1e-6)
    # The llama3 scaling of TINY_LLAMA31 really scales some frequencies and smooths others.
    base = 1.0 / TINY_LLAMA31.rope_theta ** (np.arange(0, 8, 2) / 8)
    ratio = hf_rope_inv_freq(TINY_LLAMA31) / base
    assert ratio.max() == 1.0 and ratio.min() == pytest.approx(1 / 8)
    assert ((ratio > 1 / 8 + 1e-6) & (ratio < 1 - 1e-6)).any()


def test_prefill_then_decode_equals_full_forward_and_reference(setup):
    """Two sequences prefilled together (13 and 6 tokens), then 6 decode steps of both, give
    the logits of one full forward over each whole sequence and of the float64 reference."""
    cfg, pure, runner = setup
    rng = np.random.default_rng(1)
    seq_a = rng.integers(0, cfg.vocab_size, 19).tolist()
    seq_b = rng.integers(0, cfg.vocab_size, 12).tolist()
    pa, pb, pa_full, pb_full = take_pages(rng, 128, 19, 12, 19, 12)
    prefill_a, prefill_b = run_all_logits(runner, [(seq_a, 0, 13, pa), (seq_b, 0, 6, pb)])
    steps = [run_last_logits(runner, [(seq_a, 13 + k, 14 + k, pa), (seq_b, 6 + k, 7 + k, pb)])
             for k in range(6)]  # each [2, V]
    inc_a = np.concatenate([prefill_a, np.stack([s[0] for s in steps])])  # [19, V]
    inc_b = np.concatenate([prefill_b, np.stack([s[1] for s in steps])])  # [12, V]
    full_a, full_b = run_all_logits(runner, [(seq_a, 0, 19, pa_full), (seq_b, 0, 12, pb_full)])
    ref_a, ref_b = reference_logits(cfg, pure, seq_a), reference_logits(cfg, pure, seq_b)
    rel_close(inc_a, full_a, err_msg="incremental vs full forward, sequence a")
    rel_close(inc_b, full_b, err_msg="incremental vs full forward, sequence b")
    rel_close(full_a, ref_a, err_msg="full forward vs float64 reference, sequence a")
    rel_close(full_b, ref_b, err_msg="full forward vs float64 reference, sequence b")
    rel_close(inc_a, ref_a, err_msg="incremental vs float64 reference")
    # The logits really depend on the context (the layers are not no-ops).
    assert np.abs(ref_a[-1] - reference_logits(cfg, pure, seq_a[-3:])[-1]).max() > 0.1


@pytest.mark.parametrize("setup", ["tiny-qwen2"], indirect=True)  # 4 compiles per config
def test_chunked_prefill_equals_one_shot(setup):
    """A 70-token prompt computed in chunks of 1, 7 and 64 tokens gives the logits of one-shot
    prefill at every position."""
    cfg, pure, runner = setup
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, cfg.vocab_size, 70).tolist()
    pages = take_pages(rng, 128, 70, 70, 70, 70)
    [one_shot] = run_all_logits(runner, [(prompt, 0, 70, pages[0])])
    rel_close(one_shot, reference_logits(cfg, pure, prompt), err_msg="one-shot vs reference")
    for chunk, chunk_pages in zip((1, 7, 64), pages[1:]):
        parts = []
        for start in range(0, 70, chunk):
            end = min(start + chunk, 70)
            # The block table already lists every page of the prompt: pages past kv_len hold
            # stale data from other tests and must be ignored.
            parts += run_all_logits(runner, [(prompt, start, end, chunk_pages)])
        chunked = np.concatenate(parts)
        rel_close(chunked, one_shot, err_msg=f"chunks of {chunk}")
        rel_close(chunked[-1], one_shot[-1], err_msg=f"final logits, chunks of {chunk}")


def test_physical_page_assignment_changes_nothing(setup):
    """Consecutive, interleaved and reversed physical pages give bit-identical logits."""
    cfg, _, runner = setup
    rng = np.random.default_rng(3)
    seq_a = rng.integers(0, cfg.vocab_size, 20).tolist()
    seq_b = rng.integers(0, cfg.vocab_size, 13).tolist()
    assignments = [  # (pages of a, pages of b): a holds 20 tokens in 5 pages, b 13 in 4
        (np.arange(5), np.arange(5, 9)),
        (np.array([120, 3, 77, 41, 9]), np.array([8, 100, 42, 64])),
        (np.array([127, 126, 125, 124, 123]), np.array([60, 59, 58, 57])),
    ]
    results = []
    for pa, pb in assignments:
        prefill = run_all_logits(runner, [(seq_a, 0, 19, pa), (seq_b, 0, 12, pb)])
        decode = run_last_logits(runner, [(seq_a, 19, 20, pa), (seq_b, 12, 13, pb)])
        results.append((*prefill, decode))
    for result in results[1:]:
        for got, expected in zip(result, results[0]):
            np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def llama():
    """TINY_LLAMA31 with unit-scale random weights: (cfg, model). Its output head is untied, so
    greedy decoding does not settle into repeating the input token."""
    return TINY_LLAMA31, model_from_pure_dict(TINY_LLAMA31, unit_scale_pure_dict(TINY_LLAMA31, 7))


@pytest.fixture(scope="module")
def engine(llama):
    return LLMEngine(*llama, engine_cfg=ENGINE_CFG)


def all_pages_free(e: LLMEngine) -> bool:
    return e.pool.num_free == e.pool.num_pages and not e.has_unfinished()


def test_generate_batched_equals_each_alone(llama):
    """Three greedy and three seeded-sampling requests run together (more than max_num_seqs, so
    some wait) produce, token for token, what each produces alone in a fresh engine."""
    cfg, model = llama
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 10, 29)]
    max_tokens = (12, 5, 20)
    greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    seeded = [SamplingParams(max_tokens=m, temperature=0.8, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i, m in enumerate(max_tokens)]
    batched_engine = LLMEngine(cfg, model, engine_cfg=ENGINE_CFG)
    batched = batched_engine.generate(prompts + prompts, greedy + seeded)
    assert all_pages_free(batched_engine)
    for i, prompt in enumerate(prompts):
        alone_engine = LLMEngine(cfg, model, engine_cfg=ENGINE_CFG)  # fresh for each prompt
        for out, params in ((batched[i], greedy[i]), (batched[3 + i], seeded[i])):
            [alone] = alone_engine.generate([prompt], params)
            assert out.output_ids == alone.output_ids, (i, params)
            assert out.prompt_ids == prompt
            assert len(out.output_ids) == params.max_tokens
            assert out.finish_reason == alone.finish_reason == FinishReason.LENGTH
            assert all_pages_free(alone_engine)
    # Greedy continuations are not trivial repeats, and sampling really samples.
    assert len(set(batched[2].output_ids)) > 5
    assert any(batched[i].output_ids != batched[3 + i].output_ids for i in range(3))


def greedy_reference(engine: LLMEngine, prompt, n):
    [out] = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    return out.output_ids


def test_stop_token_eos_and_ignore_eos(llama, engine):
    cfg, model = llama
    prompt = [17, 99, 3, 250, 41, 8, 77]
    continuation = greedy_reference(engine, prompt, 10)
    stop = continuation[3]
    first = continuation.index(stop)
    assert cfg.eos_token_ids[0] not in continuation[:first + 1]
    expected = continuation[:first + 1]
    # A stop token ends the request right after it, with or without ignore_eos.
    for ignore_eos in (False, True):
        [out] = engine.generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=(stop,),
                                                         ignore_eos=ignore_eos))
        assert out.output_ids == expected and out.finish_reason == FinishReason.STOP
    # The same token as the model's eos: STOP, unless ignore_eos, which runs to max_tokens.
    eos_engine = LLMEngine(cfg.replace(eos_token_ids=(stop,)), model, engine_cfg=ENGINE_CFG)
    [out] = eos_engine.generate([prompt], SamplingParams(max_tokens=10))
    assert out.output_ids == expected and out.finish_reason == FinishReason.STOP
    [out] = eos_engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert out.output_ids == continuation and out.finish_reason == FinishReason.LENGTH
    assert all_pages_free(engine) and all_pages_free(eos_engine)


def test_max_tokens_and_max_model_len(engine):
    prompt = [5, 200, 31, 64, 9]
    continuation = greedy_reference(engine, prompt, 9)
    for n in (1, 2, 7):
        [out] = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
        assert out.output_ids == continuation[:n] and out.finish_reason == FinishReason.LENGTH
    limit = ENGINE_CFG.max_model_len
    rng = np.random.default_rng(5)
    for prompt_len in (58, limit - 1):
        long_prompt = rng.integers(3, 256, prompt_len).tolist()
        [out] = engine.generate([long_prompt], SamplingParams(max_tokens=100, ignore_eos=True))
        assert len(out.prompt_ids) + len(out.output_ids) == limit
        assert out.finish_reason == FinishReason.LENGTH
    assert all_pages_free(engine)


@pytest.mark.parametrize("prompt, message", [
    (list(range(3, 3 + ENGINE_CFG.max_model_len)), "max_model_len"),
    (list(range(3, 4 + ENGINE_CFG.max_model_len)), "max_model_len"),
    ([], "empty"),
    ([5, 256, 7], "outside the vocabulary"),
    ([5, -1], "outside the vocabulary"),
    ("some text", "tokenizer"),
])
def test_bad_prompts_raise(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([prompt], SamplingParams(max_tokens=4))
    assert all_pages_free(engine)  # nothing was queued


def test_cache_is_donated_and_updated_in_place(llama):
    cfg, model = llama
    num_pages = 256
    runner = ModelRunner(cfg, model, num_pages=num_pages, page_size=PAGE)
    # a scanned runner (the CPU's layer loop) holds every layer's pages in one array
    layers = runner.cache.stacked_layers or 1
    page_shape = (cfg.num_kv_heads, layers * num_pages, PAGE, cfg.head_dim)
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, cfg.vocab_size, 11).tolist()
    [pages] = take_pages(rng, num_pages, 11)
    for batch in (step_batch([(tokens, 0, 10, pages)]), step_batch([(tokens, 10, 11, pages)])):
        old = runner.cache
        runner.execute(batch)
        assert all(a.is_deleted() for a in old.k_pages + old.v_pages)
        assert not any(a.is_deleted() for a in runner.cache.k_pages + runner.cache.v_pages)
        assert runner.cache.k_pages[0].shape == page_shape

        args = runner._step_args(batch)  # exactly as runner.execute passes them
        fused_args = (*args, runner.sample_rows)
        for hlo in (runner._step.lower(*args).compile().as_text(),  # and with the argmax:
                    runner._step_and_argmax.lower(*fused_args).compile().as_text()):
            assert not full_page_copies(hlo, page_shape), full_page_copies(hlo, page_shape)
            # Every k and v page array is an output aliased to its donated input.
            alias = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo).group(1)
            assert alias.count("alias)") == 2 * len(runner.cache.k_pages), alias
    # The check can fail: without donation XLA must copy the pages before the scatter.
    undonated = jax.jit(runner._step_impl, static_argnames=("layout", "all_logits"))
    assert full_page_copies(undonated.lower(*args).compile().as_text(), page_shape)


def full_page_copies(hlo: str, shape) -> list[str]:
    """HLO instructions producing an array of the page shape that are a `copy` (or a fusion
    named after one)."""
    dims = ",".join(map(str, shape))
    return re.findall(rf"^\s*(?:%\S*copy\S* = f32\[{dims}\]\S* .*|.*= f32\[{dims}\]\S* copy\(.*)$",
                      hlo, flags=re.M)


def test_compiled_shapes_stay_bounded(llama):
    cfg, model = llama
    fresh = LLMEngine(cfg, model, engine_cfg=ENGINE_CFG)
    [out] = fresh.generate([[11, 12, 13, 14, 15]], SamplingParams(max_tokens=41, ignore_eos=True))
    assert len(out.output_ids) == 41  # one prefill step and 40 decode steps
    # Block tables grow from 2 to 12 pages: widths bucket to 4, 8, 16, so one prefill program
    # and three decode programs (not one per step or per width).
    assert len(fresh.runner.compiled_shapes) <= 4, fresh.runner.compiled_shapes
    assert fresh.runner._step_and_argmax._cache_size() == len(fresh.runner.compiled_shapes)


# --------------------------------------------------------------------------------- streaming

def byte_tokenizer():
    """A byte-level tokenizer of vocab 256 where token id b is the byte b (no merges)."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from models.tokenizer import Tokenizer
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's stand-in character of each byte
        chars[b] = chr(b) if b in printable else chr(256 + (extra := extra + 1) - 1)
    tok = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template=None)


CHAIN = "aé中😀"  # 10 distinct bytes: 61 | c3 a9 | e4 b8 ad | f0 9f 98 80


@pytest.fixture(scope="module")
def chain_engine():
    """TINY_LLAMA31 rewired into a bigram machine whose greedy successor of each byte of CHAIN is
    the next byte (cyclically), with the byte tokenizer: its greedy output text is known."""
    cfg = TINY_LLAMA31
    pure = unit_scale_pure_dict(cfg, 11)
    chain = list(CHAIN.encode())
    rng = np.random.default_rng(11)
    # Orthogonal embeddings of norm sqrt(hidden) (RMS 1) for the chain bytes.
    basis, _ = np.linalg.qr(rng.standard_normal((cfg.hidden_size, len(chain))))
    embedding = pure["embed_tokens"]["embedding"]
    head = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
    for i, b in enumerate(chain):
        embedding[b] = basis[:, i] * math.sqrt(cfg.hidden_size)
        head[:, chain[(i + 1) % len(chain)]] = embedding[b]  # logit 64 for the successor, else 0
    pure["lm_head"]["kernel"] = head
    pure["norm"]["weight"] = np.ones_like(pure["norm"]["weight"])
    for layer in pure["layers"].values():  # attention and MLP add nothing to the residual
        layer["self_attn"]["o_proj"]["kernel"][:] = 0
        layer["mlp"]["down_proj"]["kernel"][:] = 0
    tokenizer = byte_tokenizer()
    assert tokenizer.encode(CHAIN) == chain and tokenizer.decode(chain) == CHAIN
    return LLMEngine(cfg, model_from_pure_dict(cfg, pure), tokenizer, engine_cfg=ENGINE_CFG)


def collect(deltas):
    texts, tokens, finish = {}, {}, {}
    for d in deltas:
        assert finish.get(d.request_id) is None, "delta after the request finished"
        texts.setdefault(d.request_id, []).append(d.text)
        tokens.setdefault(d.request_id, []).extend(d.token_ids)
        finish[d.request_id] = d.finish_reason
    return texts, tokens, finish


def test_stream_multibyte_characters_are_never_split(chain_engine):
    e = chain_engine
    # "a" continues with é中😀 (9 bytes); after 11 tokens it has started the next é (c3 alone).
    texts, tokens, finish = collect(e.stream(["a", "a"], [SamplingParams(max_tokens=9),
                                                          SamplingParams(max_tokens=11)]))
    first, second = sorted(texts)  # request ids, in the order added
    assert texts[first] == ["", "é", "", "", "中", "", "", "", "😀"]
    assert texts[second] == texts[first] + ["a", "\ufffd"]  # unfinished é only at the very end
    assert "".join(texts[second]) == e.tokenizer.decode(tokens[second]) == "é中😀a\ufffd"
    assert finish == {first: FinishReason.LENGTH, second: FinishReason.LENGTH}
    assert all_pages_free(e)


def test_stream_deltas_concatenate_to_the_final_text(chain_engine):
    """Sampling at a high temperature emits random bytes, many of them invalid UTF-8: deltas
    still add up to the final text, and a delta only ends mid-character at the very end."""
    e = chain_engine
    prompts = ["a", "中", "x😀"]
    params = [SamplingParams(max_tokens=24, temperature=20.0, seed=s) for s in (1, 2, 3)]
    texts, tokens, finish = collect(e.stream(prompts, params))
    assert len(texts) == 3 and all(len(t) == 24 for t in tokens.values())
    for rid in texts:
        final = e.tokenizer.decode(tokens[rid])
        assert "".join(texts[rid]) == final
        running = ""
        for delta in texts[rid][:-1]:
            running += delta
            assert not running.endswith("\ufffd") and final.startswith(running)
    text = "".join("".join(t) for t in texts.values())
    assert "\ufffd" in text  # invalid bytes did occur
    [out] = e.generate(["a"], SamplingParams(max_tokens=9))
    assert out.text == "é中😀" and out.finish_reason == FinishReason.LENGTH
    assert all_pages_free(e)


@pytest.mark.parametrize("rows", ["mixed", "plain", "greedy"])
def test_execute_and_sample_equals_step_then_sampler(llama, rows):
    """execute_and_sample (the step and its argmax in one program; the sampler as a second
    program when rows sample) gives the tokens, logprobs and K/V of execute_padded followed by
    sample (whose mode "cuts" handles every row), for greedy, plainly sampled and cut rows of a
    ragged batch (prefill chunks and a decode row)."""
    cfg, model = llama
    rng = np.random.default_rng(12)
    lengths = (9, 1, 14)
    rows_in = [(rng.integers(0, cfg.vocab_size, n).tolist(), 0, n, pages)
               for n, pages in zip(lengths, take_pages(rng, 64, *lengths))]
    batch = step_batch(rows_in)
    temperature = {"mixed": [0.0, 0.9, 1.3], "plain": [0.7, 0.0, 1.1], "greedy": [0.0] * 3}
    cuts = rows == "mixed"
    arrays = SamplingArrays(
        temperature=np.array(temperature[rows], np.float32),
        top_k=np.array([0, 7, 0] if cuts else [0] * 3, np.int32),
        top_p=np.array([1.0, 1.0, 0.8] if cuts else [1.0] * 3, np.float32),
        min_p=np.array([0.0, 0.05, 0.0] if cuts else [0.0] * 3, np.float32),
        seeds=np.array([3, 4, 5], np.uint32), steps=np.array([0, 2, 6], np.int32),
        num_logprobs=4)
    assert arrays.mode() == {"mixed": "cuts", "plain": "plain", "greedy": "greedy"}[rows]
    one, two = (ModelRunner(cfg, model, num_pages=64, page_size=PAGE, max_seqs=4)
                for _ in range(2))
    fused = fetch_samples(one.execute_and_sample(batch, arrays), 3)
    logits = two.execute_padded(batch)[:3]
    want = sample(logits, *(jnp.asarray(getattr(arrays, f)) for f in (
        "temperature", "top_k", "top_p", "seeds", "steps", "min_p")))  # mode "cuts"
    np.testing.assert_array_equal(fused[0], np.asarray(want))
    chosen, top_ids, top_logprobs = logprobs_of(logits, want, 4)
    np.testing.assert_array_equal(fused[2], np.asarray(top_ids))
    for got, expected in ((fused[1], chosen), (fused[3], top_logprobs)):
        np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-5, atol=1e-5)
    greedy = np.argmax(np.asarray(logits), -1)
    assert (fused[0] == greedy).all() == (rows == "greedy")  # the others really sampled
    # The same caches afterwards: the fused program wrote the same K/V.
    for a, b in zip(one.cache.k_pages + one.cache.v_pages, two.cache.k_pages + two.cache.v_pages):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)