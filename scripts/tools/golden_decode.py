"""Greedy continuations and their margins with HF transformers, and the package versions a
golden was written with: shared by scripts/tools/make_golden.py and golden_smollm2.py (runs only
in the torch environment, as they do)."""
from __future__ import annotations

import importlib.metadata
import sys


def versions() -> dict:
    import torch
    import transformers
    out = {"python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": transformers.__version__}
    for pkg in ("gguf", "tokenizers", "safetensors", "accelerate", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out



def manual_greedy(model, input_ids, new_tokens: int):
    """Greedy decoding by full recomputation (no KV cache), to cross-check model.generate.

    Returns (new ids [B, new_tokens], top1-minus-top2 logit margins [B, new_tokens]).
    """
    import torch
    ids = input_ids
    margins = []
    with torch.no_grad():
        for _ in range(new_tokens):
            last = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
            top2 = last.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
            ids = torch.cat([ids, last.argmax(-1, keepdim=True)], dim=1)
    return ids[:, input_ids.shape[1]:], torch.stack(margins, dim=1)


def hf_greedy(model, input_ids, new_tokens: int):
    """Plain argmax decoding of exactly `new_tokens` tokens with model.generate (KV cache).

    EOS is an ordinary token here: it neither stops decoding nor is suppressed. (min_new_tokens
    would suppress EOS through a logits processor and change the ids, so it is not used; instead
    no eos id is given, in the call's config nor in the model's default generation config.)
    """
    import copy
    import torch
    from transformers import GenerationConfig
    saved = copy.deepcopy(model.generation_config)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gc = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                          pad_token_id=0, bos_token_id=None, num_beams=1, temperature=None,
                          top_p=None, top_k=None)
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=gc)
    finally:
        model.generation_config = saved
    gen = out[:, input_ids.shape[1]:]
    assert gen.shape[1] == new_tokens, gen.shape
    return gen


def path_margins(model, input_ids, gen):
    """Signed margins of a greedy path, from one no-cache forward over prompt + generated ids.

    margin[b, t] = logit of the chosen token gen[b, t] minus the best other logit at that step;
    negative would mean the full forward prefers another token there.
    """
    import torch
    full = torch.cat([input_ids, gen], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=torch.ones_like(full)).logits
    steps = logits[:, input_ids.shape[1] - 1:-1].double()
    chosen = steps.gather(-1, gen[..., None])[..., 0]
    others = steps.scatter(-1, gen[..., None], float("-inf")).max(-1).values
    return (chosen - others).float()
