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


def test_warmup_on_a_mesh_compiles_what_a_run_reaches():
    """The sharded runner (a one-device mesh here) warms its steps and samplers too."""
    from engine.mesh import make_mesh
    cfg = TINY_LLAMA31
    engine = LLMEngine(cfg, random_model(cfg, 5), None, EngineConfig(
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, page_size=16),
        mesh=make_mesh(1, 1))
    assert engine.warmup() == len(engine.warmup_shapes())
    compiled, samplers = set(engine.runner.compiled_shapes), sample_packed._cache_size()
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.9, top_k=5, seed=1)]
    outs = engine.generate([[1, 2, 3], list(range(4, 30))], params)
    assert [len(o.output_ids) for o in outs] == [6, 5]
    assert engine.runner.compiled_shapes == compiled
    assert sample_packed._cache_size() == samplers
