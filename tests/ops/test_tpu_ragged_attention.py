"""ops.tpu_ragged_attention in TPU interpret mode on the CPU (compiled on a TPU), against an
independent float64 numpy attention and jax's own reference (`ref_ragged_paged_attention`), and
lowered for TPU.

Cases are engine steps with hypothesis-drawn ragged lengths (prefill chunks after cached tokens,
decodes, padding sequences and padding tokens) over shuffled pages whose unused entries, and the
block table entries past each sequence, hold large garbage. Shapes are fixed per KV dtype so the
interpreted kernel is traced once per dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from ops.tpu_attention_tiles import TpuAttentionBlocks, tpu_attention_blocks
from ops.tpu_chips import tpu_lowering
from ops.tpu_ragged_attention import tpu_ragged_paged_attention
from tests.ops.paged_cases import GARBAGE, NP_DTYPES, attention_np, make_paged_case, rel_err

INTERPRET = jax.default_backend() != "tpu"  # on a TPU the same cases run compiled
NUM_SEQS, MAX_Q, MAX_KV, NUM_TOKENS = 4, 7, 40, 32
PAGE, HEADS, KV_HEADS, HEAD_DIM = 8, 4, 2, 32
NUM_PAGES, WIDTH = 28, 7  # fixed shapes: one trace per dtype
BLOCKS = TpuAttentionBlocks(block_q=4, pages_per_block=2)  # several q and key blocks per case
# rel_err tolerance against float64 numpy over the values the cache holds, per (q, KV) dtype:
# float32 math throughout except bf16's rounded probabilities (interpreted kernel measured:
# float32 ~3.5e-7, bf16 ~2.7e-3, int8 / fp8 pages with float32 q ~3.4e-7).
TOL = {("float32", "float32"): 2e-6, ("bfloat16", "bfloat16"): 1.5e-2,
       ("float32", "int8"): 2e-6, ("float32", "float8_e4m3fn"): 2e-6}
OPTIONS = [{}, {"soft_cap": 4.0}, {"sliding_window": 5}, {"soft_cap": 4.0, "sliding_window": 9}]


def steps():
    """(kv_len, q_len) per sequence: q_len <= kv_len; (0, 0) pads; tokens fit NUM_TOKENS."""
    seq = st.tuples(st.integers(1, MAX_KV), st.integers(1, MAX_Q)).map(
        lambda s: (s[0], min(s[0], s[1])))
    return st.lists(st.one_of(seq, st.just((0, 0))), min_size=NUM_SEQS, max_size=NUM_SEQS)


def make_step(rng, sequences, q_dtype, kv_dtype):
    """Arguments of one step at the fixed shapes: pages padded to NUM_PAGES with garbage pages,
    block tables to WIDTH with garbage entries."""
    case = make_paged_case(rng, [n for n, _ in sequences], page_size=PAGE,
                           num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, kv_dtype=kv_dtype,
                           extra_width=0, spare_pages=1)

    def pad_pages(pages, scales):
        extra = NUM_PAGES - pages.shape[1]
        junk = rng.uniform(-GARBAGE, GARBAGE, (KV_HEADS, extra) + pages.shape[2:])
        pages = np.concatenate([pages, junk.astype(pages.dtype)], axis=1)
        if scales is not None:
            junk = rng.uniform(0, 1, (KV_HEADS, extra, PAGE)).astype(np.float32)
            scales = np.concatenate([scales, junk], axis=1)
        return pages, scales

    k_pages, k_scales = pad_pages(case.k_pages, case.k_scales)
    v_pages, v_scales = pad_pages(case.v_pages, case.v_scales)
    tables = rng.integers(0, NUM_PAGES, (NUM_SEQS, WIDTH)).astype(np.int32)
    tables[:, :case.block_tables.shape[1]] = case.block_tables
    q_lens = [t for _, t in sequences]
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((NUM_TOKENS, HEADS, HEAD_DIM)).astype(NP_DTYPES[q_dtype])
    args = dict(q=jnp.asarray(q), k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages),
                block_tables=jnp.asarray(tables), query_start_loc=jnp.asarray(starts),
                kv_lens=jnp.asarray(case.kv_lens))
    if k_scales is not None:
        args.update(k_scales=jnp.asarray(k_scales), v_scales=jnp.asarray(v_scales))
    return args, case, starts


@pytest.mark.parametrize("q_dtype,kv_dtype", list(TOL))
@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequences=steps(), options=st.sampled_from(OPTIONS), seed=st.integers(0, 2**16))
def test_matches_float64_reference(q_dtype, kv_dtype, sequences, options, seed):
    args, case, starts = make_step(np.random.default_rng(seed), sequences, q_dtype, kv_dtype)
    out = tpu_ragged_paged_attention(**args, max_q_len=MAX_Q, blocks=BLOCKS, interpret=INTERPRET,
                                     **options)
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    out = np.asarray(out.astype(jnp.float32))
    q = np.asarray(args["q"].astype(jnp.float32))
    for s, (n, t) in enumerate(sequences):
        if t == 0:
            continue
        rows = slice(starts[s], starts[s + 1])
        want = attention_np(q[rows], case.keys[s], case.values[s], np.arange(n - t, n),
                            **options)
        assert rel_err(out[rows], want) < TOL[q_dtype, kv_dtype], f"sequence {s} ({n}, {t})"
    assert np.all(out[starts[-1]:] == 0), "rows of no sequence must be 0"


def test_matches_jax_ref_ragged_paged_attention():
    """jax's reference takes K and V interleaved in one [P, S, 2 * KVH, D] page array."""
    sequences = [(23, 7), (9, 1), (40, 5), (1, 1)]
    args, _, starts = make_step(np.random.default_rng(1), sequences, "float32", "float32")
    options = dict(soft_cap=6.0, sliding_window=11)
    out = tpu_ragged_paged_attention(**args, max_q_len=MAX_Q, blocks=BLOCKS, interpret=INTERPRET,
                                     scale=0.3, **options)
    kv = jnp.stack([args["k_pages"], args["v_pages"]], axis=3)  # [KVH, P, S, 2, D]
    kv = kv.transpose(1, 2, 0, 3, 4).reshape(NUM_PAGES, PAGE, 2 * KV_HEADS, HEAD_DIM)
    want = ref_ragged_paged_attention(
        args["q"], kv, args["kv_lens"], args["block_tables"], args["query_start_loc"],
        jnp.array([NUM_SEQS], jnp.int32), sm_scale=0.3, **options)
    total = int(starts[-1])
    assert rel_err(out[:total], want[:total]) < 2e-6


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("kv_dtype,max_q_len", [("bfloat16", 64), ("bfloat16", 1),
                                                 ("int8", 64), ("float8_e4m3fn", 1)])
def test_lowers_for_tpu(generation, kv_dtype, max_q_len):
    """Llama-3.1-8B's attention shapes (head_dim 128, GQA 4) lower to one Mosaic kernel."""
    tokens, seqs, width, pages = 128, 16, 32, 512
    quantized = kv_dtype != "bfloat16"
    spec = jax.ShapeDtypeStruct
    q = spec((tokens, 32, 128), jnp.bfloat16)
    kv = spec((8, pages, 16, 128), jnp.dtype(kv_dtype))
    scales = spec((8, pages, 16), jnp.float32)
    ints = [spec((seqs, width), jnp.int32), spec((seqs + 1,), jnp.int32),
            spec((seqs,), jnp.int32)]

    def attend(q, k, v, tables, starts, lens, ks, vs):
        return tpu_ragged_paged_attention(
            q, k, v, tables, starts, lens, max_q_len=max_q_len, soft_cap=50.0,
            sliding_window=4096, generation=generation,
            k_scales=ks if quantized else None, v_scales=vs if quantized else None)

    with tpu_lowering(generation):
        text = jax.jit(attend).trace(q, kv, kv, *ints, scales, scales).lower(
            lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1
    assert "tpu_ragged_paged_attention" in text


def test_blocks_table_and_validation():
    assert tpu_attention_blocks("v6e", 1, 4, 16, 128) == TpuAttentionBlocks(1, 32)
    assert tpu_attention_blocks("v5e", 512, 4, 16, 128) == TpuAttentionBlocks(32, 16)
    assert tpu_attention_blocks("v6e", 512, 4, 16, 8).pages_per_block == 8
    with pytest.raises(ValueError, match="generation"):
        tpu_attention_blocks("v9", 1, 4, 16, 8)
    args, _, _ = make_step(np.random.default_rng(2), [(3, 3)] * NUM_SEQS, "float32", "float32")
    with pytest.raises(ValueError, match="head_dim"):
        tpu_ragged_paged_attention(**{**args, "q": args["q"][..., :16]}, max_q_len=3)
    with pytest.raises(ValueError, match="kv_lens"):
        tpu_ragged_paged_attention(**{**args, "kv_lens": args["kv_lens"][:2]}, max_q_len=3)
    with pytest.raises(ValueError, match="sliding_window"):
        tpu_ragged_paged_attention(**args, max_q_len=3, sliding_window=0)


def test_no_dma_races_on_two_cores():
    """The interpreter's happens-before race detector (DMAs run when issued, so a buffer read
    before its DMA's wait is a race: removing the block table's wait fails here), with two cores
    taking the kv heads in a random order and scratch memory starting as NaN: no race, the same
    results."""
    sequences = [(37, 7), (5, 1), (0, 0), (19, 6)]
    args, case, starts = make_step(np.random.default_rng(4), sequences, "float32", "int8")
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2,
                                   dma_execution_mode="eager", uninitialized_memory="nan",
                                   random_seed=3)
    out = np.asarray(tpu_ragged_paged_attention(**args, max_q_len=MAX_Q, blocks=BLOCKS,
                                                interpret=params, sliding_window=9))
    assert not interpret_pallas_call.races.races_found
    q = np.asarray(args["q"])
    for s, (n, t) in enumerate(sequences):
        rows = slice(starts[s], starts[s + 1])
        if t:
            want = attention_np(q[rows], case.keys[s], case.values[s], np.arange(n - t, n),
                                sliding_window=9)
            assert rel_err(out[rows], want) < TOL["float32", "int8"]
