"""On a GPU: the engine with the Pallas attention kernels gives the jnp reference's tokens.

Skipped without a GPU (CI has none); run on the H200 with `pytest tests/engine/test_gpu_engine.py`.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import LLAMA32_1B, get_preset
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from models.weights import random_model

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def decisive_model(cfg, dtype):
    """Random weights scaled so greedy choices are not near-ties."""
    model = random_model(cfg, 0, dtype)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda a: (a * 3).astype(a.dtype), state)
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("preset,dtype", [("llama3.2-1b-4layers", jnp.float32),
                                          ("llama3.2-1b-4layers", jnp.bfloat16),
                                          ("llama3.1-8b", jnp.bfloat16)])
def test_pallas_kernels_match_reference_greedy(preset, dtype, monkeypatch):
    """Issue 4's end-to-end check: llama3.1-8b (all 32 layers, random weights) and a 4-layer 1B."""
    cfg = LLAMA32_1B.replace(num_layers=4) if preset.endswith("4layers") else get_preset(preset)
    model = decisive_model(cfg, dtype)
    rng = np.random.default_rng(0)
    # The 8B case keeps to prompts that prefill in one step: each program compiles for several
    # seconds there, and a run must fit a device session (the first try, with a 700-token
    # prompt chunked over steps, was still compiling after 190 s).
    lengths = (5, 37, 130) if cfg.num_layers > 4 else (5, 37, 130, 700)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine_cfg = EngineConfig(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=512)
    outputs = {}
    for impl in ("pallas", "reference"):
        if impl == "reference":
            monkeypatch.setenv("PALLASITE_ATTENTION", "reference")
        engine = LLMEngine(cfg, model, None, engine_cfg)
        outputs[impl] = [o.output_ids for o in engine.generate(prompts, params)]
        del engine  # free its KV cache before the next engine allocates one
    matches = [np.mean(np.asarray(a) == np.asarray(b))
               for a, b in zip(outputs["pallas"], outputs["reference"])]
    print(f"{preset} {jnp.dtype(dtype).name}: token agreement per prompt {matches}")
    # Greedy decoding of a random model amplifies any rounding difference once a near-tie flips
    # (the kernel's dot precision differs from the reference's), so only the first tokens must
    # agree: measured on the H200 (2026-11-29), float32 runs diverged at token 21 at the
    # earliest and bf16 runs at token 13.
    agree = 16 if dtype == jnp.float32 else 8
    for a, b in zip(outputs["pallas"], outputs["reference"]):
        assert a[:agree] == b[:agree]
