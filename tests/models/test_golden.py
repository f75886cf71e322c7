"""Logits and greedy continuations against HF transformers (fp32) from the same weights.

Golden files come from scripts/tools/make_golden.py (HF transformers + torch, run separately); these
tests need no torch.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from quant.loader import load_model
from engine.perplexity import perplexity_of_ids
from tests.conftest import GOLDEN_DIR

# tiny-qwen3, tiny-mistral, tiny-gemma2, tiny-gemma3, tiny-phi3 and tiny-phi3-longrope are
# written by transformers' save_pretrained (untied heads, a sliding window shorter than the
# sequence, soft caps that bind, LongRoPE's long factors).
TINY = ("tiny-llama", "tiny-llama31", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma2",
        "tiny-gemma3", "tiny-phi3", "tiny-phi3-longrope")
PROMPTS = ("france", "fibonacci", "chat_france")


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    """max |ours - reference| over max |reference|."""
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def greedy(loaded, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    # A fixed 64 MiB cache: on a GPU a fraction of the device would give a 2-layer model page
    # arrays of gigabytes, sized blind to the other test processes on the card.
    engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer,
                       EngineConfig(max_model_len=min(256, loaded.cfg.max_position_embeddings),
                                    max_num_seqs=4, page_size=8, kv_cache_memory=64 << 20))
    params = SamplingParams(max_tokens=num_tokens, ignore_eos=True)
    return [o.output_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    directory = os.path.join(GOLDEN_DIR, request.param)
    return load_model(directory), dict(np.load(os.path.join(directory, "golden.npz")))


def test_tiny_logits_match_transformers(tiny):
    loaded, golden = tiny
    logits = full_sequence_logits(loaded.cfg, loaded.model, golden["input_ids"], page_size=4)
    assert logits.shape == golden["logits"].shape
    assert relative_error(logits, golden["logits"]) < 1e-4


@pytest.mark.gpu  # on a GPU: every family through the Pallas kernels (windows, soft caps)
def test_tiny_greedy_matches_transformers(tiny):
    loaded, golden = tiny
    prompts = [row.tolist() for row in golden["input_ids"]]
    with jax.default_matmul_precision("highest"):  # float32 products, as HF's fp32 reference
        ids = greedy(loaded, prompts, golden["greedy_ids"].shape[1])
    assert ids == golden["greedy_ids"].tolist()


def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_golden):
    meta, arrays = smollm2_golden
    for prompt in meta["prompts"]:
        text = prompt["text"]
        assert smollm2.tokenizer.encode(text) == arrays[prompt["name"] + "_ids"].tolist()
    chat = smollm2.tokenizer.apply_chat_template(meta["chat_messages"], add_generation_prompt=True)
    assert smollm2.tokenizer.encode(chat) == arrays["chat_france_ids"].tolist()


@pytest.mark.parametrize("name", PROMPTS)
def test_smollm2_logits_match_transformers(smollm2, smollm2_golden, name):
    _, arrays = smollm2_golden
    ids = arrays[name + "_ids"][None]
    logits = full_sequence_logits(smollm2.cfg, smollm2.model, ids)[0]
    reference = arrays[name + "_last_logits"]  # the last positions of the prompt
    assert relative_error(logits[-reference.shape[0]:], reference) < 1e-4


def test_smollm2_greedy_32_tokens_match_transformers(smollm2, smollm2_golden):
    _, arrays = smollm2_golden
    prompts = [arrays[name + "_ids"].tolist() for name in PROMPTS]
    expected = [arrays[name + "_greedy_ids"].tolist() for name in PROMPTS]
    assert greedy(smollm2, prompts, 32) == expected


def test_smollm2_perplexity_matches_transformers(smollm2, smollm2_golden):
    meta, arrays = smollm2_golden
    ppl, _ = perplexity_of_ids(smollm2.cfg, smollm2.model, arrays["ppl_ids"].tolist())
    assert abs(ppl / meta["ppl"] - 1) < 0.005


def test_sliding_window_through_chunks_and_prefix_cache():
    """tiny-mistral (window 5) and tiny-gemma2 (window 5 on alternate layers) in an engine that
    prefills in 5-token chunks and reuses cached prefix pages: greedy tokens equal HF's."""
    for name in ("tiny-mistral", "tiny-gemma2"):
        directory = os.path.join(GOLDEN_DIR, name)
        loaded, golden = load_model(directory), np.load(os.path.join(directory, "golden.npz"))
        engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer,
                           EngineConfig(max_model_len=64, max_num_seqs=2, page_size=4,
                                        max_num_batched_tokens=5))
        params = SamplingParams(max_tokens=golden["greedy_ids"].shape[1], ignore_eos=True)
        prompts = [row.tolist() for row in golden["input_ids"]]
        for _ in range(2):  # the second round hits the prefix cache
            outputs = [o.output_ids for o in engine.generate(prompts, params)]
            assert outputs == golden["greedy_ids"].tolist(), name
