"""The engine with the TPU kernels interpreted on the CPU (PALLASITE_KERNELS=tpu_interpret):
the tiny model's greedy tokens equal the reference path's, over a batch that mixes a prefill
with decodes and spans several pages."""
from __future__ import annotations

import numpy as np

from configs.model import TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from models.weights import model_from_pure_dict
from tests.engine.weights import unit_scale_pure_dict

# A step budget of 16 tokens chunks the prompts (11 and 14 tokens): the second step is the first
# request's decode and a 9-token prefill chunk of the second.
ENGINE_CFG = EngineConfig(max_model_len=64, max_num_seqs=2, page_size=8,
                          max_num_batched_tokens=16)


def test_greedy_tokens_equal_the_reference_path(monkeypatch):
    model = model_from_pure_dict(TINY_LLAMA31, unit_scale_pure_dict(TINY_LLAMA31, 7))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, TINY_LLAMA31.vocab_size, n).tolist() for n in (11, 14)]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    monkeypatch.setenv("PALLASITE_KERNELS", "device")
    reference = LLMEngine(TINY_LLAMA31, model, engine_cfg=ENGINE_CFG)
    assert reference.runner.kernels.attention == "reference"
    want = [out.output_ids for out in reference.generate(prompts, params)]
    monkeypatch.setenv("PALLASITE_KERNELS", "tpu_interpret")
    tpu = LLMEngine(TINY_LLAMA31, model, engine_cfg=ENGINE_CFG)
    assert tpu.runner.kernels.tpu and tpu.runner.kernels.attention == "pallas_interpret"
    got = [out.output_ids for out in tpu.generate(prompts, params)]
    assert got == want
    assert len(set(want[0] + want[1])) > 3  # not a trivial repeat
