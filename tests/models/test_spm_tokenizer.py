"""The SentencePiece BPE tokenizer read from GGUF (tokenizer.ggml.model == "llama").

tests/golden/spm_tokenizer.json holds a tiny SentencePiece BPE model (byte fallback, one
user-defined piece) and sentencepiece's own encodings of fixed edge cases and random strings
(scripts/tools/make_spm_golden.py). Its pieces are written into GGUF files here, read back with
`Tokenizer.from_gguf`, and must encode and decode as sentencepiece did; on hypothesis-drawn text
they must encode as `reference_encode`, a direct transcription of SentencePiece's BPE rule that is
itself checked against the golden.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from engine.detokenizer import IncrementalDetokenizer
from models.spm_tokenizer import SPACE, TOKEN_BYTE, TOKEN_NORMAL, TOKEN_USER_DEFINED
from models.tokenizer import Tokenizer

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "spm_tokenizer.json")
                    .read_text(encoding="utf-8"))
USER_PIECES = [t for t, k in zip(GOLDEN["tokens"], GOLDEN["token_types"])
               if k == TOKEN_USER_DEFINED]
PREFIX_MODES = {True: ("ids", "decoded"), False: ("ids_no_prefix", "decoded_no_prefix")}


def write_spm_gguf(path: Path, *, add_space_prefix: bool | None = True, add_bos=True,
                   add_eos=False, extra=None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(GOLDEN["tokens"])
    w.add_token_scores(GOLDEN["scores"])
    w.add_token_types(GOLDEN["token_types"])
    w.add_unk_token_id(GOLDEN["unk_token_id"])
    w.add_bos_token_id(GOLDEN["bos_token_id"])
    w.add_eos_token_id(GOLDEN["eos_token_id"])
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if add_space_prefix is not None:  # absent: SentencePiece's default, on
        w.add_add_space_prefix(add_space_prefix)
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> dict[bool, Tokenizer]:
    """The golden model as a GGUF tokenizer, with the dummy prefix (Llama) and without (Gemma)."""
    d = tmp_path_factory.mktemp("spm")
    return {True: Tokenizer.from_gguf(write_spm_gguf(d / "prefix.gguf", add_space_prefix=None)),
            False: Tokenizer.from_gguf(write_spm_gguf(d / "plain.gguf", add_space_prefix=False))}


def reference_encode(text: str, add_space_prefix: bool) -> list[int]:
    """SentencePiece's BPE, step by step: spaces to "▁" (plus one leading "▁"), user-defined
    pieces matched longest first and kept whole, other characters as symbols; merge the adjacent
    pair whose concatenation is the highest-scored normal piece (leftmost on ties) until none is;
    a symbol that is no piece becomes its UTF-8 bytes' pieces."""
    ids = {}
    for i, t in enumerate(GOLDEN["tokens"]):
        ids.setdefault(t, i)
    kinds = dict(zip(GOLDEN["tokens"], GOLDEN["token_types"]))
    normal = {t: GOLDEN["scores"][ids[t]] for t in ids if kinds[t] == TOKEN_NORMAL}
    text = text.replace(" ", SPACE)
    if add_space_prefix and text:
        text = SPACE + text
    symbols, whole, i = [], [], 0
    while i < len(text):
        user = max((p for p in USER_PIECES if text.startswith(p, i)), key=len, default=None)
        symbols.append(user or text[i])
        whole.append(user is not None)
        i += len(user or text[i])
    while True:
        best = None
        for j in range(len(symbols) - 1):
            score = normal.get(symbols[j] + symbols[j + 1])
            if not (whole[j] or whole[j + 1]) and score is not None and (
                    best is None or score > best[0]):
                best = (score, j)
        if best is None:
            break
        j = best[1]
        symbols[j:j + 2] = [symbols[j] + symbols[j + 1]]
        whole[j:j + 2] = [False]
    out = []
    for s in symbols:
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
    return out


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_reference_matches_sentencepiece(add_space_prefix):
    key, _ = PREFIX_MODES[add_space_prefix]
    for case in GOLDEN["cases"]:
        assert reference_encode(case["text"], add_space_prefix) == case[key], case["text"]


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_gguf_tokenizer_matches_sentencepiece(spm, add_space_prefix):
    tok = spm[add_space_prefix]
    key, decoded = PREFIX_MODES[add_space_prefix]
    for case in GOLDEN["cases"]:
        assert tok.encode(case["text"]) == case[key], case["text"]
        assert tok.decode(case[key]) == case.get(decoded, case["text"]), case["text"]
    # The one known difference: text that is exactly a user-defined piece gets no "▁" before it.
    piece = USER_PIECES[0]
    assert tok.encode(piece) == [tok.token_to_id(piece)]


FRAGMENTS = st.one_of(
    st.text(alphabet=" \n\tabcdefhilmnoprstuTx0123456789.,;:'\"éαλж東京語🙂🚀☃", min_size=1,
            max_size=6),
    st.sampled_from(sorted({w for c in GOLDEN["cases"] for w in c["text"].split(" ")})
                    + ["  ", "<sep>", " the"]))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(FRAGMENTS, max_size=8), add_space_prefix=st.booleans())
def test_gguf_tokenizer_matches_reference_bpe(spm, parts, add_space_prefix):
    text = "".join(parts)
    assume(not (add_space_prefix and text in USER_PIECES))
    tok = spm[add_space_prefix]
    ids = tok.encode(text)
    assert ids == reference_encode(text, add_space_prefix)
    assert tok.decode(ids) == text  # identity normalization, spaces kept: a lossless round trip


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_streamed_text_is_the_decoded_text(spm, add_space_prefix):
    """Token by token, the incremental detokenizer's deltas add up to the whole decode (the
    prefix's dropped space and byte pieces of one character included)."""
    tok = spm[add_space_prefix]
    for case in GOLDEN["cases"]:
        ids = case[PREFIX_MODES[add_space_prefix][0]]
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.add(ids[:n], finished=n == len(ids))
                           for n in range(1, len(ids) + 1))
        assert streamed == tok.decode(ids), case["text"]


def test_special_tokens_and_save(spm, tmp_path):
    tok = spm[True]
    bos, eos = GOLDEN["bos_token_id"], GOLDEN["eos_token_id"]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.add_eos) == (
        bos, (eos,), True, False)
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == ("<s>", "</s>", len(GOLDEN["tokens"]))
    fox = tok.encode("The fox.")
    assert tok.encode("The fox.", add_special_tokens=True) == [bos] + fox
    # Control pieces written in text are recognized; the text after one gets its own prefix.
    assert tok.encode("<s>The fox.</s>") == [bos] + fox + [eos]
    assert tok.decode([bos] + fox + [eos]) == "The fox."
    assert tok.decode([bos] + fox, skip_special_tokens=False) == "<s> The fox."
    byte_ids = [i for i, k in enumerate(GOLDEN["token_types"]) if k == TOKEN_BYTE]
    assert set(tok.encode("🙂")) <= {tok.token_to_id(SPACE)} | set(byte_ids)
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_dir(tmp_path / "saved")
    for case in GOLDEN["cases"][:30]:
        assert again.encode(case["text"], add_special_tokens=True) == tok.encode(
            case["text"], add_special_tokens=True)
    assert (again.bos_token_id, again.eos_token_ids, again.add_bos) == (bos, (eos,), True)


def test_add_eos_and_errors(tmp_path):
    tok = Tokenizer.from_gguf(write_spm_gguf(tmp_path / "eos.gguf", add_bos=False, add_eos=True))
    assert tok.encode("a", add_special_tokens=True) == tok.encode("a") + [GOLDEN["eos_token_id"]]
    with pytest.raises(ValueError, match="remove_extra_whitespaces"):
        Tokenizer.from_gguf(write_spm_gguf(
            tmp_path / "ws.gguf", extra=lambda w: w.add_remove_extra_whitespaces(True)))
    short = tmp_path / "short.gguf"
    w = gguf.GGUFWriter(str(short), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(GOLDEN["tokens"])
    w.add_token_scores(GOLDEN["scores"][:-1])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"one score per token .* 400 tokens, 399 scores"):
        Tokenizer.from_gguf(short)
