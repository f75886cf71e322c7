"""The model with its GPU-only fusions (ops/rope_kv.py, ops/rms_norm.py) gives the same greedy
tokens as without them, on the CPU: the kernels run in Pallas's interpreter.

On a GPU these kernels run by default; on the CPU the jnp ops do. Here their dispatch is made to
pick the interpreted kernels (the norm kernel for every row count), and a tiny Llama-3.1 model
(random unit-scale float32 weights, fused and separate q/k/v projections, GQA) generates with
chunked prefill and several decode steps: tokens must be equal and log-probabilities within
float32 rounding (1e-5).
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

from configs.model import TINY_LLAMA31
from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from models.llama import fuse_projections
from tests.engine.weights import unit_scale_model

ENGINE_CFG = EngineConfig(max_model_len=64, max_num_seqs=3, max_num_batched_tokens=16,
                          page_size=4)


def generate(model, cfg, prompts, params=None, engine_cfg: EngineConfig = ENGINE_CFG):
    """Greedy generations with log-probabilities: 8 tokens each, or per-prompt `params`."""
    engine = LLMEngine(cfg, model, None, engine_cfg)
    params = params or SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    return engine.generate(prompts, params)


def assert_same_generations(got, want, rtol: float) -> None:
    """Equal greedy tokens; float32 log-probabilities within rtol (atol 1e-5)."""
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        np.testing.assert_allclose([lp for lp, _ in g.outputs[0].logprobs],
                                   [lp for lp, _ in w.outputs[0].logprobs], rtol=rtol, atol=1e-5)


def assert_same_up_to_a_near_tie(got, want, rtol: float, tie: float) -> None:
    """Greedy tokens equal up to their first difference, which must be a near-tie: there the
    reference (`want`, logprobs >= 2) leads `got`'s token by less than `tie`. Float32
    log-probabilities of the shared prefix within rtol (atol 1e-5)."""
    for g, w in zip(got, want):
        a, b = g.output_ids, w.output_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if first < len(a):
            top = w.outputs[0].logprobs[first][1]  # the reference's top {id: logprob} there
            lead = top[b[first]] - top.get(a[first], -np.inf)
            assert lead < tie, (first, lead, a[:first + 1], b[:first + 1])
        np.testing.assert_allclose([lp for lp, _ in g.outputs[0].logprobs[:first]],
                                   [lp for lp, _ in w.outputs[0].logprobs[:first]],
                                   rtol=rtol, atol=1e-5)


def model_and_prompts(cfg, seed: int, fused: bool, lengths):
    """(cfg, unit-scale model, fused if asked, random prompts of `lengths` tokens)."""
    model = unit_scale_model(cfg, seed)
    if fused:
        cfg, model = fuse_projections(cfg, model)
    rng = np.random.default_rng(seed)
    return cfg, model, [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths]


def interpret_fused_kernels(monkeypatch):
    """Make the runners choose the kernels of rope_and_write_kv and rms_norm, interpreted, on
    the CPU."""
    import engine.runner
    import ops.rms_norm
    import ops.rope_kv
    from ops.kernel_choice import KernelBackends
    kernels = KernelBackends(kv_write="pallas_interpret", norm="pallas_interpret")
    monkeypatch.setattr(engine.runner, "device_kernels", lambda: kernels)
    monkeypatch.setattr(ops.rms_norm, "KERNEL_ROWS", (1, 1 << 30))
    calls = {"rope_kv": 0, "rms_norm": 0}
    for module, fn, key in ((ops.rope_kv, "_rope_kv_pallas", "rope_kv"),
                            (ops.rms_norm, "_rms_norm_pallas", "rms_norm")):
        inner = getattr(module, fn)

        def counted(*args, _inner=inner, _key=key, **kwargs):
            calls[_key] += 1
            return _inner(*args, **kwargs)
        monkeypatch.setattr(module, fn, counted)
    return calls


@pytest.mark.parametrize("fused", [False, True])
def test_greedy_tokens_equal_with_the_fused_kernels(monkeypatch, fused):
    cfg, model, prompts = model_and_prompts(  # the kernels' sizes
        TINY_LLAMA31.replace(num_heads=4, num_kv_heads=2, head_dim=16), 5, fused, (3, 21, 9))
    want = generate(model, cfg, prompts)
    calls = interpret_fused_kernels(monkeypatch)
    jax.clear_caches()  # the step programs traced above must be traced again
    got = generate(model, cfg, prompts)
    assert calls["rope_kv"] > 0 and calls["rms_norm"] > 0  # the kernels did run
    assert_same_generations(got, want, rtol=1e-6)  # the interpreted kernels: about 5e-7 off


def test_heads_96_wide_run_the_attention_and_rope_kernels(monkeypatch):
    """Phi-3's 96-wide heads, fused q/k/v: the attention and RoPE + KV-write kernels
    (interpreted) read and write rows of 128 columns, the last 32 masked, and give the greedy
    tokens of the jnp references."""
    import ops.ragged_attention
    import ops.rope_kv
    from configs.model import TINY_PHI3
    cfg, model, prompts = model_and_prompts(
        TINY_PHI3.replace(hidden_size=192, num_heads=2, num_kv_heads=2, head_dim=96), 3, True,
        (9, 3, 20))
    monkeypatch.setenv("PALLASITE_ATTENTION", "reference")
    want = generate(model, cfg, prompts)
    calls = []
    for module, fn in ((ops.ragged_attention, "_ragged_attention_pallas"),
                       (ops.rope_kv, "_rope_kv_pallas")):
        inner = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _inner=inner, _fn=fn, **kw: calls.append(
            _fn) or _inner(*a, **kw))
    monkeypatch.setenv("PALLASITE_ATTENTION", "pallas_interpret")
    jax.clear_caches()
    got = generate(model, cfg, prompts)
    assert set(calls) == {"_ragged_attention_pallas", "_rope_kv_pallas"}
    assert_same_generations(got, want, rtol=1e-5)
