"""Start-up: `LLMEngine.warmup` compiles every program a run can reach, so a run after it
compiles nothing (engine/warmup.py lists the reachable steps)."""
from __future__ import annotations

import numpy as np

from configs.model import TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.sampling import sample_packed
from models.weights import random_model


def test_a_run_after_warmup_compiles_nothing():
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16))
    shapes = engine.warmup_shapes()
    assert engine.warmup() == len(shapes)  # one new program per reachable step shape
    compiled = set(engine.runner.compiled_shapes)
    programs = engine.runner._step_and_argmax._cache_size()
    assert programs == len(compiled)
    samplers = sample_packed._cache_size()
    # Mixed traffic: prompts from 1 to 40 tokens (chunked by the 32-token budget), decodes of
    # up to 4 sequences beside prefill chunks, sequences up to the 64-token context.
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 40, 7, 23, 33, 2, 15)]
    # Greedy, plainly sampled and top-p rows: the sampler programs are warm too.
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=[0.0, 0.8, 1.0][i % 3],
                             top_p=0.9 if i % 3 == 2 else 1.0, seed=i)
              for i, m in enumerate(rng.integers(1, 24, len(prompts)))]
    outs = engine.generate(prompts, params)
    assert [len(o.output_ids) for o in outs] == [p.max_tokens for p in params]
    assert engine.runner.compiled_shapes == compiled
    assert engine.runner._step_and_argmax._cache_size() == programs
    assert sample_packed._cache_size() == samplers
