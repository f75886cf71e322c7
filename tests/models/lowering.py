"""A model's ragged step traced from shapes alone and lowered for an H200 (CUDA), for tests that
check which kernels a configuration's step reaches without a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.kv_cache import init_kv_cache
from models.llama import AttentionMetadata, LlamaForCausalLM, forward, fuse_projections
from models.weights import abstract_model


def lowered_step_text(cfg, kernels, *, num_pages: int, page_size: int, tokens: int, seqs: int,
                      width: int, stacked: bool = False, fused: bool = False,
                      build=None) -> str:
    """The StableHLO text of forward(...) for `tokens` tokens of `seqs` sequences (block tables
    [seqs, width], up to tokens / 2 a sequence, two of them prefills), bf16 weights and pages
    (with `fused`, as models.llama.fuse_projections leaves them; given `build`, the model and
    config that build(cfg, bf16 model) returns, traced from shapes), with `kernels`, lowered for
    CUDA (the caller holds the h200_lowering fixture)."""
    if build is not None:
        built = {}

        def make():
            built["cfg"], model = build(cfg, LlamaForCausalLM(cfg, nnx.Rngs(0), jnp.bfloat16))
            return model
        model = nnx.eval_shape(make)
        cfg = built["cfg"]
    elif fused:
        cfg, model = cfg.replace(fused_projections=True), nnx.eval_shape(
            lambda: fuse_projections(cfg, LlamaForCausalLM(cfg, nnx.Rngs(0), jnp.bfloat16))[1])
    else:
        model = abstract_model(cfg, jnp.bfloat16)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size, jnp.bfloat16,
                                                 stacked=stacked))
    spec = jax.ShapeDtypeStruct
    meta = AttentionMetadata(
        positions=spec((tokens,), jnp.int32), slot_mapping=spec((tokens,), jnp.int32),
        block_tables=spec((seqs, width), jnp.int32),
        query_start_loc=spec((seqs + 1,), jnp.int32), kv_lens=spec((seqs,), jnp.int32),
        max_q_len=tokens // 2, max_prefill_seqs=2)

    def step(state, cache, tokens, meta):
        return forward(nnx.merge(graphdef, state), cache, tokens, meta, cfg, kernels=kernels)

    return jax.jit(step).trace(state, cache, spec((tokens,), jnp.int32), meta).lower(
        lowering_platforms=("cuda",)).as_text()
