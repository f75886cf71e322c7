"""Phi-3's LongRoPE against transformers: tests/golden/tiny-phi3-longrope (original length 8,
context 64) written by scripts/tools/make_golden.py. Its 12-token prompts run on the long
factors, its 6-token prompts on the short ones until their greedy continuation crosses the
length (where transformers recomputes the sequence and the engine does not: models/longrope.py).
float32 throughout: logits within relative 1e-4, greedy tokens equal (every golden step wins by
at least 0.05).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from configs.model import config_from_dict, config_to_dict
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.perplexity import full_sequence_logits
from engine.speculative import SpecConfig
from ops import rope_kv
from ops.backends import select_kernels
from quant.loader import load_model
from tests.conftest import GOLDEN_DIR
from tests.models.test_golden import relative_error
from tests.models.lowering import lowered_step_text
from tests.ops.conftest import h200_lowering  # noqa: F401  (the fixture)

DIRECTORY = os.path.join(GOLDEN_DIR, "tiny-phi3-longrope")


@pytest.fixture(scope="module")
def phi3():
    return load_model(DIRECTORY), dict(np.load(os.path.join(DIRECTORY, "golden.npz")))


def test_longrope_config(phi3):
    scaling = phi3[0].cfg.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("longrope", 8)
    assert len(scaling.short_factor) == len(scaling.long_factor) == phi3[0].cfg.head_dim // 2
    # transformers' default: sqrt(1 + ln(64 / 8) / ln(8))
    assert math.isclose(scaling.attention_factor, math.sqrt(2.0))
    stored = json.loads(json.dumps(config_to_dict(phi3[0].cfg)))  # as orbax checkpoints keep it
    assert config_from_dict(stored) == phi3[0].cfg


def test_longrope_short_logits_match_transformers(phi3):
    """The 6-token prompts: short factors (tests/models/test_golden.py checks the 12-token ones,
    long factors)."""
    loaded, golden = phi3
    logits = full_sequence_logits(loaded.cfg, loaded.model, golden["crossing_input_ids"],
                                  page_size=4)
    assert relative_error(logits, golden["crossing_logits"]) < 1e-4


def test_longrope_greedy_matches_transformers(phi3):
    """Long prompts prefilled in one step: all 16 tokens. Short prompts: the tokens chosen before
    the sequence crosses the original length (at positions 5 to 7), and at least one token
    after it differs (transformers recomputes the earlier tokens with the long factors there)."""
    loaded, golden = phi3
    params = SamplingParams(max_tokens=golden["greedy_ids"].shape[1], ignore_eos=True)
    prompts = [r.tolist() for r in (*golden["input_ids"], *golden["crossing_input_ids"])]
    engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer,
                       EngineConfig(max_model_len=64, max_num_seqs=4, page_size=4))
    assert not engine.engine_cfg.enable_prefix_caching
    got = [o.output_ids for o in engine.generate(prompts, params)]
    assert got[:2] == golden["greedy_ids"].tolist()
    within = loaded.cfg.rope_scaling.original_max_position_embeddings - len(prompts[2]) + 1
    crossing = golden["crossing_greedy_ids"].tolist()
    assert [ids[:within] for ids in got[2:]] == [ids[:within] for ids in crossing]
    assert got[2:] != crossing
    with pytest.raises(ValueError, match="speculative decoding"):
        LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer, EngineConfig(max_model_len=64),
                  spec_config=SpecConfig())


def test_longrope_lowers_with_gpu_kernels(h200_lowering, monkeypatch, phi3):  # noqa: F811
    """Both passes of RoPE + KV write run the Pallas kernel, the attention its ragged kernel;
    the layers share one traced layer (models.llama.run_layer), so each pass is traced once."""
    cfg = phi3[0].cfg
    calls = []

    def spy(*args, **kwargs):
        calls.append(True)
        return kernel(*args, **kwargs)
    kernel = rope_kv._rope_kv_pallas
    monkeypatch.setattr(rope_kv, "_rope_kv_pallas", spy)
    text = lowered_step_text(cfg, select_kernels("gpu", hopper=True), num_pages=32,
                             page_size=4, tokens=32, seqs=4, width=8)
    assert "triton" in text and h200_lowering
    assert cfg.num_layers > 1 and len(calls) == 2
