"""The tiny byte-level BPE tokenizer the golden models share, its tokenizer_config.json with a
ChatML template, and its golden encodings (scripts/tools/make_golden.py writes them; runs in the
separate Python 3.11 environment with tokenizers and transformers)."""
from __future__ import annotations

import codecs
import contextlib
import io
import json
from pathlib import Path

from configs.model import TINY_LLAMA

# Special tokens of the tiny tokenizer, mirroring SmolLM2's first three ids.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tokenizer_training_text(topics_text: str) -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # `this` prints the Zen on first import
        import this as zen_module
    zen = codecs.decode(zen_module.s, "rot13")
    return zen + "\n\n" + topics_text[:20000]


def build_tiny_tokenizer(training_text: str, vocab_size: int):
    """A byte-level BPE with exactly `vocab_size` entries, all ids < vocab_size.

    256 byte symbols would not leave room for special tokens and merges, so the alphabet is
    restricted to printable ASCII plus tab and newline (97 symbols); other bytes are not
    representable by this tokenizer (HF silently drops them when encoding). Ids: 0-2 special
    tokens, then the alphabet, then merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    allowed_bytes = [9, 10] + list(range(32, 127))
    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()  # set of the 256 mapped chars
    # Reproduce the GPT-2 byte->unicode mapping for the chosen bytes.
    mapping = _gpt2_bytes_to_unicode()
    alphabet = [mapping[b] for b in allowed_bytes]
    assert set(alphabet) <= set(byte_to_unicode)
    text = "".join(ch for ch in training_text if ch in "\t\n" or 32 <= ord(ch) < 127)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, show_progress=False,
                                  min_frequency=2)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    if len(vocab) != vocab_size or max(vocab.values()) != vocab_size - 1:
        raise RuntimeError(f"tiny tokenizer has {len(vocab)} entries, wanted {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert vocab[t] == i, (t, vocab[t])
    return tok


def _gpt2_bytes_to_unicode() -> dict:
    """The GPT-2 reversible byte -> printable unicode character mapping."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def write_tokenizer(tok, cfg, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    bos = SPECIAL_TOKENS[cfg.bos_token_id] if cfg.bos_token_id is not None else None
    eos = SPECIAL_TOKENS[cfg.eos_token_ids[0]]
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")


def write_tokenizer_golden(out_root: Path, versions: dict) -> None:
    """Sample encodings of the shared tiny tokenizer, through HF's tokenizer class."""
    from transformers import AutoTokenizer
    vocab = TINY_LLAMA.vocab_size
    hf_tok = AutoTokenizer.from_pretrained(str(out_root / TINY_LLAMA.name))
    samples = ["Beautiful is better than ugly.", "Hello, world!\n  indented\tTab 12345",
               "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x + 1\n"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    rendered = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    enc = []
    for s in samples + [rendered]:
        ids = hf_tok(s, add_special_tokens=False).input_ids
        enc.append({"text": s, "ids": ids, "tokens": hf_tok.convert_ids_to_tokens(ids),
                    "decoded": hf_tok.decode(ids, skip_special_tokens=False)})
    tj = {"description": "Encodings of the tiny byte-level BPE shared by tiny-llama, "
                         "tiny-llama31 and tiny-qwen2 (HF AutoTokenizer, add_special_tokens=False).",
          "vocab_size": vocab, "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
          "chat_messages": chat, "chat_rendered": rendered, "encodings": enc,
          "hf_adds_special_tokens_by_default":
              hf_tok(samples[0]).input_ids != hf_tok(samples[0], add_special_tokens=False).input_ids,
          "versions": versions}
    (out_root / "tokenizer_golden.json").write_text(json.dumps(tj, indent=2) + "\n")
