"""The int8 KV cache under speculative rollback and preemption: the engine's speculative tests'
models and requests (tests/engine/test_speculative.py), with int8 pages in the target's and the
draft's caches."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from engine.request import SamplingParams
from tests.engine.test_speculative import (  # noqa: F401 (fixtures)
    TINY_POOL, check_all_free, make_engine, repetitive_prompts, small_draft, target)

# 5 pages of 16 tokens: the requests preempt one another.
INT8_POOL = dataclasses.replace(TINY_POOL, kv_cache_dtype="int8")


def test_int8_speculation_under_preemption_equals_plain_int8_greedy(make_engine):
    """Rejected proposals' rows are overwritten (values and scale) by later steps, so the
    draft-model speculation gives the plain int8 engine's greedy tokens, preempting (three
    requests of 3 pages each in a pool of 5)."""
    prompts = repetitive_prompts(0, [15, 12, 14])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = make_engine(INT8_POOL).generate(prompts, params)
    engine = make_engine(INT8_POOL, "draft-small")
    outputs = engine.generate(prompts, params)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert engine.runner.cache.dtype == jnp.int8 and engine.draft.runner.cache.dtype == jnp.int8
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()
    assert engine.scheduler.num_preemptions > 0
    check_all_free(engine)
