"""A SentencePiece BPE vocabulary (pieces, scores, piece types) as a `tokenizers.Tokenizer`.

GGUF files of Llama-2-style models, Gemma and Phi-3 carry their SentencePiece tokenizer as
`tokenizer.ggml.model == "llama"`: the pieces, one score each and one type each (GGUF's token
types: normal, unknown, control, user-defined, unused, byte). SentencePiece's BPE encodes text as:
spaces become "▁" (and one "▁" is prepended when the model adds a dummy prefix); every character
is a symbol; the adjacent pair whose concatenation is a piece with the highest score is merged,
leftmost first on ties, until no pair is a piece; a character that is no piece becomes its UTF-8
bytes, the pieces "<0x00>".."<0xFF>". The same result comes from a rank-ordered BPE whose merges
are every split of every normal piece into two normal pieces, ranked by the whole piece's score.

Pure Python: no jax import.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers

# GGUF token types (gguf.TokenType), the same numbers as SentencePiece's piece types.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
SPACE = "\u2581"  # "▁", SentencePiece's space


def merges_by_score(tokens: Sequence[str], scores: Sequence[float],
                    token_types: Sequence[int]) -> list[tuple[str, str]]:
    """Every (left, right) pair of normal pieces whose concatenation is a normal piece, the pairs
    of higher-scored pieces first (ties: the lower piece id, then the shorter left part)."""
    normal = {}
    for i, (piece, kind) in enumerate(zip(tokens, token_types)):
        if kind == TOKEN_NORMAL:
            normal.setdefault(piece, i)
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int],
                      *, unk_id: Optional[int], add_space_prefix: bool) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` that encodes and decodes like SentencePiece's BPE.

    Control and unknown pieces become special added tokens (recognized in text, skipped when
    decoding with skip_special_tokens); user-defined pieces plain added tokens matched in the
    normalized text, as SentencePiece matches them. With `add_space_prefix`, one "▁" is prepended
    to each stretch of text (the whole text, or the text after a special token) and one leading
    space is dropped when decoding.
    """
    if not (len(tokens) == len(scores) == len(token_types)):
        raise ValueError(f"SentencePiece vocabulary has {len(tokens)} pieces, {len(scores)} "
                         f"scores and {len(token_types)} piece types")
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        vocab.setdefault(piece, i)  # a duplicated piece keeps its first id
    if unk_id is None:
        unk_id = next((i for i, kind in enumerate(token_types) if kind == TOKEN_UNKNOWN), None)
    has_bytes = any(kind == TOKEN_BYTE for kind in token_types)
    bpe = models.BPE(vocab, merges_by_score(tokens, scores, token_types),
                     unk_token=None if unk_id is None else tokens[unk_id],
                     fuse_unk=True, byte_fallback=has_bytes)
    tok = tokenizers.Tokenizer(bpe)

    user_pieces = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_USER_DEFINED]
    tok.normalizer = _normalizer(add_space_prefix, user_pieces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)

    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    if special:
        tok.add_special_tokens(special)
    if user_pieces:
        tok.add_tokens([AddedToken(t, special=False, normalized=True) for t in user_pieces])
    return tok


def _normalizer(add_space_prefix: bool, user_pieces: Sequence[str]) -> normalizers.Normalizer:
    """Spaces to "▁", then the dummy prefix: one "▁" at the start of a non-empty stretch of text.

    Added tokens matched in normalized text are normalized themselves, so the prefix is not put
    before text that is exactly one user-defined piece: the piece keeps its own form (and such a
    stretch of text gets no prefix, where SentencePiece would give "▁" before the piece).
    """
    escape = normalizers.Replace(" ", SPACE)
    if not add_space_prefix:
        return escape
    start = r"\A"
    if user_pieces:
        start += "(?!(?:" + "|".join(re.escape(p) for p in user_pieces) + r")\z)"
    return normalizers.Sequence([escape, normalizers.Replace(Regex(start), SPACE)])
