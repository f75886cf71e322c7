"""Writes tests/golden/spm_tokenizer.json: a tiny SentencePiece BPE model and its own encodings.

Runs ONLY in a separate Python that has the `sentencepiece` and `protobuf` packages (neither is a
project dependency; the tests only read the JSON this writes):

    python -m venv /tmp/spvenv && /tmp/spvenv/bin/pip install sentencepiece protobuf
    /tmp/spvenv/bin/python scripts/tools/make_spm_golden.py

The model is trained the way Llama-2-style vocabularies are (BPE, byte fallback, identity
normalization, spaces kept, digits split, one user-defined symbol) on the paragraphs below. The
JSON holds the GGUF tokenizer fields of that model (pieces, scores, token types, special ids) and,
for fixed edge cases plus seeded random strings, sentencepiece's ids both with the dummy space
prefix (Llama, Phi-3) and without it (Gemma), and its decoded text where that differs from the
input.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
USER_SYMBOL = "<sep>"

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Then the dog sleeps, and the fox runs home.
In 1969, 3 astronauts flew 384400 km to the Moon; 12 people have walked on it since.
Café, naïve, résumé and jalapeño keep their accents; Straße and Ærø keep their letters.
Ελληνικά γράμματα: αλφα, βήτα, γάμμα. Русский текст тоже здесь, и цифры 2024 года.
東京は日本の首都です。 北京是中国的首都。 서울은 한국의 수도입니다.
Indented  code   uses    several     spaces:    if x  ==  1:    return  x  +  2
Numbers like 3.14159, 2.71828 and 1,000,000 appear in tables, lists and prose alike.
She said: "tokenizers split text into pieces", and he answered 'pieces merge by score'.
Newlines end lines; tabs	separate	columns; and   runs   of   spaces   stay.
"""

EDGE_CASES = [
    "", " ", "  ", "\n", "\n\n", "a", " a", "a ", "  leading", "trailing  ", "multiple   spaces",
    "line one\nline two\n", "tab\there", "emoji 🙂 needs bytes 🚀!", "🙂", "日本語のテキスト",
    "naïve café", "x = 1  +  2", "1234567890", "The fox.", " The fox.", f"a{USER_SYMBOL}b",
    f"{USER_SYMBOL} start", "unknown ☃ snowman ǅ", "mixed Ελλάδα and Русь 42",
]


def random_strings(rng: random.Random, count: int) -> list[str]:
    """Strings mixing training words, spaces, digits, newlines and characters outside the model."""
    words = TRAINING_TEXT.split()
    extra = list("abcxyz0123456789 \n\t.,;!?-éüßαλж東語🙂🚀☃ǅ")
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 5)):
            if rng.random() < 0.6:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(extra) for _ in range(rng.randint(1, 4))))
            parts.append(rng.choice([" ", " ", "  ", "\n", ""]))
        out.append("".join(parts))
    return out


def train(directory: Path, vocab_size: int) -> Path:
    prefix = directory / "tiny"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT.splitlines()), model_prefix=str(prefix),
        model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=0.995,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=[USER_SYMBOL], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    return prefix.with_suffix(".model")


def without_dummy_prefix(model_path: Path) -> spm.SentencePieceProcessor:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    proto.normalizer_spec.add_dummy_prefix = False
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "tests" / "golden" / "spm_tokenizer.json")
    parser.add_argument("--vocab_size", type=int, default=400)
    parser.add_argument("--random_cases", type=int, default=30)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_path = train(Path(tmp), args.vocab_size)
        sp = spm.SentencePieceProcessor(model_file=str(model_path))
        sp_plain = without_dummy_prefix(model_path)
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(model_path.read_bytes())

    # SentencePiece's piece types carry the same numbers as GGUF's token types.
    kinds = sentencepiece_model_pb2.ModelProto.SentencePiece
    gguf_type = {kinds.NORMAL: 1, kinds.UNKNOWN: 2, kinds.CONTROL: 3, kinds.USER_DEFINED: 4,
                 kinds.UNUSED: 5, kinds.BYTE: 6}
    texts = EDGE_CASES + random_strings(random.Random(0), args.random_cases)
    cases = []
    for text in texts:
        ids, ids_plain = sp.encode(text), sp_plain.encode(text)
        case = {"text": text, "ids": ids, "ids_no_prefix": ids_plain}
        # Decoded text is stored only where it differs from the input.
        for key, processor, case_ids in (("decoded", sp, ids),
                                         ("decoded_no_prefix", sp_plain, ids_plain)):
            if processor.decode(case_ids) != text:
                case[key] = processor.decode(case_ids)
        cases.append(case)
    golden = {
        "description": "A tiny SentencePiece BPE model (scripts/tools/make_spm_golden.py, "
                       f"sentencepiece {spm.__version__}) as GGUF tokenizer fields, and "
                       "sentencepiece's own encodings with and without the dummy space prefix.",
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "token_types": [gguf_type[p.type] for p in proto.pieces],
        "unk_token_id": sp.unk_id(), "bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(),
        "cases": cases,
    }
    args.out.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {args.out}: {len(golden['tokens'])} pieces, {len(cases)} cases")


if __name__ == "__main__":
    main()
