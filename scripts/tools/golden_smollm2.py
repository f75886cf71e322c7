"""SmolLM2-135M-Instruct's goldens (part 2 and 3 of scripts/tools/make_golden.py): HF token ids,
fp32 logits and a greedy continuation of three prompts from the GGUF loaded by transformers,
and the perplexity of the pydoc topics text (runs only in the torch environment)."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from scripts.tools.golden_decode import hf_greedy, manual_greedy, path_margins, versions

SMOL_NEW_TOKENS, SMOL_LAST_POSITIONS, PPL_TOKENS = 32, 4, 2048
SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]
SMOL_CHAT_MESSAGE = "What is the capital of France?"


def make_smollm2(out_root: Path, gguf_path: str, topics_path: str, topics_text: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert next(model.parameters()).dtype == torch.float32

    chat = [{"role": "user", "content": SMOL_CHAT_MESSAGE}]
    chat_text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompts = SMOL_PROMPTS + [chat_text]
    names = ["france", "fibonacci", "chat_france"]

    arrays = {}
    entries = []
    for name, text in zip(names, prompts):
        ids = tok(text, add_special_tokens=False).input_ids
        default_ids = tok(text).input_ids
        ids_t = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            logits = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t)).logits[0]
        last = logits[-SMOL_LAST_POSITIONS:].float().numpy().astype(np.float32)
        gen = hf_greedy(model, ids_t, SMOL_NEW_TOKENS)
        manual, _ = manual_greedy(model, ids_t, SMOL_NEW_TOKENS)
        margins = path_margins(model, ids_t, gen)
        gen_ids = gen[0].tolist()
        agree = gen_ids == manual[0].tolist()
        if not agree:
            raise RuntimeError(f"{name}: generate() {gen_ids} != recomputed {manual[0].tolist()}")
        eos_positions = [i for i, t in enumerate(gen_ids) if t in (tok.eos_token_id,)]
        arrays[f"{name}_ids"] = np.asarray(ids, np.int32)
        arrays[f"{name}_last_logits"] = last
        arrays[f"{name}_greedy_ids"] = np.asarray(gen_ids, np.int32)
        arrays[f"{name}_greedy_margins"] = margins[0].numpy().astype(np.float32)
        entries.append({
            "name": name, "text": text, "ids": ids, "num_ids": len(ids),
            "tokens": tok.convert_ids_to_tokens(ids),
            "hf_default_ids_differ": default_ids != ids,
            "hf_default_ids": default_ids,
            "last_logits_positions": list(range(len(ids) - SMOL_LAST_POSITIONS, len(ids))),
            "last_logits_argmax": [int(i) for i in last.argmax(-1)],
            "greedy_ids": gen_ids,
            "greedy_text": tok.decode(gen_ids, skip_special_tokens=False),
            "greedy_matches_recomputed_no_cache": agree,
            "greedy_min_margin": float(margins.min()),
            "greedy_first_eos_index": eos_positions[0] if eos_positions else None,
            "greedy_text_until_eos": tok.decode(
                gen_ids[:eos_positions[0]] if eos_positions else gen_ids,
                skip_special_tokens=False),
        })
        print(f"{name}: {len(ids)} ids, greedy {tok.decode(gen_ids)!r} (no-cache agrees: {agree})",
              flush=True)

    # Perplexity over Python 3.12's pydoc topics.
    ppl_ids = tok(topics_text, add_special_tokens=False).input_ids[:PPL_TOKENS]
    assert len(ppl_ids) == PPL_TOKENS
    ids_t = torch.tensor([ppl_ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t)).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids_t[0, 1:],
                                                reduction="none")
    ppl = math.exp(nll.mean().item())
    arrays["ppl_ids"] = np.asarray(ppl_ids, np.int32)
    arrays["ppl_nll"] = nll.float().numpy().astype(np.float32)
    print(f"ppl over {PPL_TOKENS} tokens: {ppl:.4f}", flush=True)

    np.savez(out_root / "smollm2.npz", **arrays)
    info = {
        "description": "HF transformers fp32 reference for SmolLM2-135M-Instruct (Q4_1 GGUF, "
                       "dequantized by HF via the gguf package). Token ids use "
                       "add_special_tokens=False.",
        "gguf_file": gguf_name,
        "gguf_sha256": _sha256_file(gguf_path),
        "hf_tokenizer_adds_bos_by_default": any(e["hf_default_ids_differ"] for e in entries),
        "hf_tokenizer": {"class": type(tok).__name__, "bos_token": tok.bos_token,
                         "bos_token_id": tok.bos_token_id, "eos_token": tok.eos_token,
                         "eos_token_id": tok.eos_token_id,
                         "pre_tokenizer": str(tok.backend_tokenizer.pre_tokenizer),
                         "decoder": str(tok.backend_tokenizer.decoder)},
        "chat_template": tok.chat_template,
        "chat_messages": chat,
        "greedy_new_tokens": SMOL_NEW_TOKENS,
        "greedy_settings": "model.generate(do_sample=False, max_new_tokens=32, eos_token_id=None): "
                           "plain argmax at every step; EOS neither stops nor is suppressed. "
                           "Checked equal to argmax of full no-cache recomputation. "
                           "*_greedy_margins = chosen logit minus best other logit per step "
                           "(no-cache forward along the path).",
        "last_logits_count": SMOL_LAST_POSITIONS,
        "npz_keys": {k: [list(v.shape), str(v.dtype)] for k, v in arrays.items()},
        "prompts": entries,
        "ppl_text_source": "Python 3.12.1 pydoc_data.topics.topics (file " + topics_path +
                           "), joined as '\\n\\n'.join(topics[k] for k in sorted(topics)); "
                           "ids = tokenizer(text, add_special_tokens=False).input_ids[:2048]; "
                           "ppl = exp(mean CE of ids[1:] given ids[:-1]), one fp32 forward.",
        "ppl_text_sha256": hashlib.sha256(topics_text.encode("utf-8")).hexdigest(),
        "ppl_text_num_chars": len(topics_text),
        "ppl_num_tokens": PPL_TOKENS,
        "ppl": ppl,
        "ppl_mean_nll": nll.mean().item(),
        "versions": versions(),
    }
    (out_root / "smollm2.json").write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
