"""Text <-> token ids, and chat templates, for byte-level BPE models (GPT-2, SmolLM2, Llama 3, Qwen2)
and SentencePiece BPE ones read from GGUF files (Llama 2, Gemma, Phi-3).

`Tokenizer` wraps a `tokenizers.Tokenizer` and carries what the engine needs besides the vocabulary:
BOS/EOS ids, whether BOS (and EOS) are added, and the checkpoint's own jinja2 chat template. It is
built from an HF directory (tokenizer.json + tokenizer_config.json) or from a GGUF file's metadata, and
`save()` writes the HF pair back so that a converted checkpoint directory is self-contained.

Pure Python: no jax import.
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from models.gguf_file import open_gguf
from models.spm_tokenizer import sentencepiece_bpe

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns, as published in the models' own tokenizer.json files.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre values we can rebuild, grouped by the HF pre-tokenizer they denote.
_GPT2_PRE = ("gpt2", "default")                 # GPT-2 regex, byte level
_DIGITS_GPT2_PRE = ("smollm", "starcoder")      # single digits split off, then GPT-2 regex
_LLAMA3_PRE = ("llama-bpe", "llama3")            # Llama 3 regex (digits in runs of <= 3)
_QWEN2_PRE = ("qwen2",)                          # Qwen2 regex (single digits), NFC normalized
SUPPORTED_GGUF_PRE_TOKENIZERS = _GPT2_PRE + _DIGITS_GPT2_PRE + _LLAMA3_PRE + _QWEN2_PRE
SUPPORTED_GGUF_TOKENIZER_MODELS = ("gpt2", "llama")


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _unique(ids: Iterable[Optional[int]]) -> tuple[int, ...]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return tuple(out)


class Tokenizer:
    """A byte-level or SentencePiece BPE tokenizer with BOS/EOS ids and a chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: Optional[int],
                 eos_token_ids: Sequence[int], add_bos: bool, chat_template: Optional[str],
                 vocab_size: Optional[int] = None, add_eos: bool = False):
        self._tok = tokenizer
        self._bos_token_id = None if bos_token_id is None else int(bos_token_id)
        self._eos_token_ids = _unique(eos_token_ids)
        self._add_bos = bool(add_bos)
        if self._add_bos and self._bos_token_id is None:
            raise ValueError("add_bos is set but the tokenizer has no BOS token")
        self._add_eos = bool(add_eos)
        if self._add_eos and not self._eos_token_ids:
            raise ValueError("add_eos is set but the tokenizer has no EOS token")
        self._chat_template = chat_template
        self._compiled_template = None
        self._vocab_size = max(int(vocab_size or 0), tokenizer.get_vocab_size(with_added_tokens=True))

    # ------------------------------------------------------------------ properties

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (EOS first, then e.g. end-of-turn tokens)."""
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` appends EOS."""
        return self._add_eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def chat_template(self) -> Optional[str]:
        return self._chat_template

    @property
    def bos_token(self) -> Optional[str]:
        return None if self._bos_token_id is None else self.id_to_token(self._bos_token_id)

    @property
    def eos_token(self) -> Optional[str]:
        return self.id_to_token(self._eos_token_ids[0]) if self._eos_token_ids else None

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The vocabulary string of `token_id` (as stored, e.g. 'Ġthe' or '▁the'), or None."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. '<|im_start|>') are
        recognized. With add_special_tokens, BOS is prepended and EOS appended where the model's
        config says so."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self._add_bos:
            ids = [self._bos_token_id] + ids
        if add_special_tokens and self._add_eos:
            ids = ids + [self._eos_token_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Renders `messages` ([{'role': ..., 'content': ...}, ...]) with the checkpoint's own
        jinja2 template, the way HF transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
        if not self._chat_template:
            raise ValueError("this checkpoint's tokenizer has no chat template; "
                             "encode plain text instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    # ------------------------------------------------------------------ HF files

    def save(self, directory: str | os.PathLike) -> None:
        """Writes tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "chat_template": self._chat_template,
            # Not an HF key: every stop id, so that a reload keeps end-of-turn tokens too.
            "eos_token_ids": list(self._eos_token_ids),
            "vocab_size": self._vocab_size,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Reads tokenizer.json (+ tokenizer_config.json if present) from `directory`."""
        d = Path(directory)
        config = d / "tokenizer_config.json"
        return cls.from_hf_files(d / "tokenizer.json", config if config.exists() else None)

    @classmethod
    def from_hf_files(cls, tokenizer_json_path: str | os.PathLike,
                      tokenizer_config_path: str | os.PathLike | None = None, *,
                      eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Builds from HF files. `eos_token_ids` (e.g. from the model's config.json) are added to
        the tokenizer config's EOS token. The chat template is read from `chat_template.jinja`
        beside tokenizer.json (where transformers 5 saves it; it wins, as in transformers), else
        from the tokenizer config."""
        tj = Path(tokenizer_json_path)
        if not tj.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tj}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # the Rust error says what is wrong; no deep trace needed
            raise ValueError(f"{tj} is not a valid tokenizer.json: {e}") from None
        config: dict = {}
        if tokenizer_config_path is not None:
            tc = Path(tokenizer_config_path)
            if not tc.is_file():
                raise FileNotFoundError(f"tokenizer config file not found: {tc}")
            try:
                config = json.loads(tc.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{tc} is not valid JSON: {e}") from None

        def token_id(key: str) -> Optional[int]:
            content = _token_content(config.get(key))
            if content is None:
                return None
            token_id = tok.token_to_id(content)
            if token_id is None:
                raise ValueError(f"{key} {content!r} of {tokenizer_config_path} is not in the "
                                 f"vocabulary of {tj}")
            return token_id

        bos = config.get("bos_token_id", token_id("bos_token"))
        eos = _unique([token_id("eos_token"), *config.get("eos_token_ids", ()), *eos_token_ids])
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"]) and bos is not None
        else:  # infer from the post-processor, as HF fast tokenizers do
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(with_special) and with_special[0] == bos
        add_eos = bool(config.get("add_eos_token", False)) and bool(eos)
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, add_bos=add_bos,
                   chat_template=_chat_template(tj.parent, config),
                   vocab_size=config.get("vocab_size"), add_eos=add_eos)

    # ------------------------------------------------------------------ GGUF

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Builds the tokenizer from a GGUF file's metadata (`reader`: a gguf.GGUFReader or a path).

        Supports tokenizer.ggml.model "gpt2" (byte-level BPE, with the pre-tokenizers listed in
        SUPPORTED_GGUF_PRE_TOKENIZERS) and "llama" (SentencePiece BPE: models/spm_tokenizer.py);
        anything else raises ValueError naming it.
        """
        if isinstance(reader, (str, os.PathLike)):
            reader = open_gguf(reader)
        field = lambda key, default=None: _gguf_field(reader, key, default)  # noqa: E731

        model = field("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
        if model not in SUPPORTED_GGUF_TOKENIZER_MODELS:
            raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' "
                             f"(byte-level BPE), 'llama' (SentencePiece BPE)")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF tokenizer has no token list (tokenizer.ggml.tokens)")
        token_types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but "
                             f"{len(token_types)} token types")
        bos = field("tokenizer.ggml.bos_token_id")
        eos = _unique([field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id"),
                       field("tokenizer.ggml.eom_token_id")])
        unk = field("tokenizer.ggml.unknown_token_id")
        for name, i in (("bos", bos), ("unknown", unk), *(("eos", e) for e in eos)):
            if i is not None and not 0 <= i < len(tokens):
                raise ValueError(f"GGUF {name} token id {i} is outside the vocabulary "
                                 f"(size {len(tokens)})")

        if model == "gpt2":
            tok = _byte_level_from_gguf(field, tokens, token_types)
        else:
            tok = _sentencepiece_from_gguf(field, tokens, token_types, unk)
        add_bos = bool(field("tokenizer.ggml.add_bos_token", False)) and bos is not None
        add_eos = bool(field("tokenizer.ggml.add_eos_token", False)) and bool(eos)
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, add_bos=add_bos,
                   chat_template=field("tokenizer.chat_template"), vocab_size=len(tokens),
                   add_eos=add_eos)


def _byte_level_from_gguf(field, tokens: list[str], token_types: list[int]) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model == "gpt2": byte-level BPE from the token list and merges."""
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_GGUF_PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_PRE_TOKENIZERS)}")
    merges = field("tokenizer.ggml.merges", [])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # duplicates (padding tokens) keep their first id
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                     ignore_merges=pre in _LLAMA3_PRE)
    tok = tokenizers.Tokenizer(bpe)
    if pre in _QWEN2_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()

    # Control tokens become special added tokens (matched in text, skipped by decode);
    # user-defined ones plain added tokens (matched, kept). Their ids come from the vocab.
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def _sentencepiece_from_gguf(field, tokens: list[str], token_types: list[int],
                             unk: Optional[int]) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model == "llama": SentencePiece BPE from the pieces and their scores."""
    scores = field("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"GGUF SentencePiece tokenizer needs one score per token "
                         f"(tokenizer.ggml.scores): {len(tokens)} tokens, "
                         f"{'no' if scores is None else len(scores)} scores")
    if field("tokenizer.ggml.remove_extra_whitespaces", False):
        raise ValueError("unsupported GGUF tokenizer setting "
                         "tokenizer.ggml.remove_extra_whitespaces = true")
    if field("tokenizer.ggml.precompiled_charsmap"):
        raise ValueError("unsupported GGUF tokenizer setting tokenizer.ggml.precompiled_charsmap "
                         "(a SentencePiece normalization table)")
    # SentencePiece's own default: the dummy prefix is on unless the file says otherwise.
    add_prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
    return sentencepiece_bpe(tokens, scores, token_types, unk_id=unk, add_space_prefix=add_prefix)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer equivalent to llama.cpp's pre-tokenizer `pre`."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = _LLAMA3_PATTERN if pre in _LLAMA3_PRE else _QWEN2_PATTERN
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _chat_template(directory: Path, config: dict) -> Optional[str]:
    """The chat template of an HF tokenizer directory: chat_template.jinja, else the config's."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return _pick_template(config.get("chat_template"))


def _pick_template(template) -> Optional[str]:
    """tokenizer_config.json's chat_template is a string or a list of {name, template}."""
    if template is None or isinstance(template, str):
        return template
    named = {t.get("name"): t.get("template") for t in template}
    return named.get("default", next(iter(named.values()), None))


def _compile_template(source: str):
    import jinja2
    from jinja2 import ext, sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the checkpoint's chat template does not parse: {e}") from None
