"""Mixtures of experts: tiny Mixtral and Qwen3-MoE written by HF transformers (logits and greedy
tokens), the MoE layer and the grouped product against float64 numpy, and router ties.

Ties: jax.lax.top_k keeps the lower expert index first among equal probabilities. torch.topk
(what transformers' routers call) picks among exactly tied values by its partial sort, which
no index rule reproduces (tests/golden/topk_ties.json, recorded on the CPU): the chosen sets
agree wherever a tie does not straddle the k-th place, and differ where it does. Such a tie
needs bitwise-equal float32 probabilities; the goldens' greedy margins are clear of it.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.model import get_preset
from engine.memory import moe_reserve_bytes
from engine.perplexity import full_sequence_logits
from models.hf_loader import config_from_hf, load_hf_dir, stack_experts
from models.kv_cache import init_kv_cache
from models.llama import AttentionMetadata, forward
from models.moe import moe_mlp, record_routing
from models.prepare import prepare_for_device
from models.weights import abstract_model, random_model
from ops.moe_router import route
from ops.matmul import TransposedWeight
from ops.backends import select_kernels
from ops import moe_matmul
from ops.moe_matmul import grouped_matmul
from quant.loader import load_model
from quant.model import QuantConfig, quantize_model
from tests.conftest import GOLDEN_DIR
from tests.models.test_golden import greedy, relative_error
from tests.ops.conftest import h200_lowering  # noqa: F401  (the fixture)

FAMILIES = ("tiny-mixtral", "tiny-qwen3-moe")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_moe(request):
    directory = os.path.join(GOLDEN_DIR, request.param)
    return load_model(directory), dict(np.load(os.path.join(directory, "golden.npz")))


def test_config_read_from_transformers_directory(tiny_moe):
    loaded, _ = tiny_moe
    want = get_preset(loaded.cfg.name)
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "qk_norm"):
        assert getattr(loaded.cfg, field) == getattr(want, field), field


def test_logits_match_transformers(tiny_moe):
    loaded, golden = tiny_moe
    logits = full_sequence_logits(loaded.cfg, loaded.model, golden["input_ids"], page_size=4)
    assert relative_error(logits, golden["logits"]) < 1e-4  # float32 on both sides


def test_greedy_matches_transformers(tiny_moe):
    loaded, golden = tiny_moe
    prompts = [row.tolist() for row in golden["input_ids"]]
    assert greedy(loaded, prompts, golden["greedy_ids"].shape[1]) == golden["greedy_ids"].tolist()


def lowest_index_top_k(probs: np.ndarray, k: int) -> list[int]:
    return [int(i) for i in np.argsort(-probs, kind="stable")[:k]]


def test_router_ties_against_torch_topk():
    cases = json.load(open(os.path.join(GOLDEN_DIR, "topk_ties.json")))["cases"]
    straddling = 0
    for case in cases:
        probs, k = np.asarray(case["probs"], np.float32), case["k"]
        logits = jnp.log(jnp.asarray(probs))[None]
        _, experts = route(logits, k, normalize=False)
        ours = experts[0].tolist()
        assert ours == lowest_index_top_k(probs, k), case  # lower index first
        torch_set, kth = set(case["indices"]), np.sort(probs)[::-1][k - 1]
        tie_at_boundary = np.sum(probs == kth) > np.sum(np.sort(probs)[::-1][:k] == kth)
        if tie_at_boundary:
            straddling += 1
        else:  # no tie across the k-th place: the same experts (order inside is immaterial)
            assert set(ours) == torch_set, case
        assert sorted(probs[ours]) == sorted(probs[case["indices"]])  # equal probabilities
    assert straddling > 0


def reference_moe(x, router, gate, up, down, k, normalize):
    """float64 numpy: per token, its k experts of highest probability (lower index on ties)."""
    x, router, gate, up, down = (np.asarray(a, np.float64) for a in (x, router, gate, up, down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = lowest_index_top_k(probs[t], k)
        w = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for wj, e in zip(w, chosen):
            g = x[t] @ gate[e]
            out[t] += wj * ((g / (1 + np.exp(-g)) * (x[t] @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("n", [3, 11], ids=["decode", "sorted"])  # 6 pairs <= 6 experts: no sort
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_moe_layer_matches_float64(n, normalize, dtype, tol):
    rng = np.random.default_rng(7 + normalize + n)
    h, i, e, k = 32, 24, 6, 2
    x = rng.standard_normal((n, h)).astype(np.float32)
    router = rng.standard_normal((h, e)).astype(np.float32)
    gate, up = (0.2 * rng.standard_normal((e, h, i)).astype(np.float32) for _ in range(2))
    down = 0.2 * rng.standard_normal((e, i, h)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    # the reference reads the inputs as the layer stores them (rounded to dtype)
    want = reference_moe(*(np.asarray(cast(a), np.float64) for a in (x, router, gate, up, down)),
                         k, normalize)
    weights = {"gate_proj": cast(gate), "up_proj": cast(up), "down_proj": cast(down)}
    got = jax.jit(lambda x, r, w: moe_mlp(x, r, w, top_k=k, normalize=normalize,
                                          hidden_act="silu"))(cast(x), cast(router), weights)
    assert np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max() < tol


def test_record_routing_counts_each_experts_pairs():
    """record_routing: a sorted step's group sizes are each expert's count of the tokens that
    chose it (float64 numpy top-k); a decode step (pairs kept in token order) records nothing,
    and nothing is recorded outside the context."""
    rng = np.random.default_rng(5)
    h, i, e, k, n = 32, 16, 6, 2, 11
    x = rng.standard_normal((n, h)).astype(np.float32)
    router = rng.standard_normal((h, e)).astype(np.float32)
    weights = {name: jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)
               for name, shape in (("gate_proj", (e, h, i)), ("up_proj", (e, h, i)),
                                   ("down_proj", (e, i, h)))}
    layer = lambda x: moe_mlp(x, jnp.asarray(router), weights, top_k=k,  # noqa: E731
                              normalize=True, hidden_act="silu")
    with record_routing() as sizes:
        jax.block_until_ready(jax.jit(layer)(jnp.asarray(x)))
        jax.block_until_ready(jax.jit(layer)(jnp.asarray(x[:3])))  # 6 pairs: no sort
    logits = x.astype(np.float64) @ router
    chosen = [e_ for t in range(n) for e_ in lowest_index_top_k(logits[t], k)]
    assert len(sizes) == 1
    np.testing.assert_array_equal(sizes[0], np.bincount(chosen, minlength=e))
    jax.block_until_ready(jax.jit(lambda x: layer(x) + 1)(jnp.asarray(x)))
    assert len(sizes) == 1


@pytest.mark.parametrize("form,chunk_bytes",
                         [(form, 1 << 20) for form in moe_matmul.FORMS]
                         + [("tiles", 3 * 16 * 8 * 4)])  # 3 [16, 8] float32 experts
def test_grouped_matmul_empty_groups_and_spare_rows(monkeypatch, form, chunk_bytes):
    """Every form, and the tiles form in one product or in chunks of 3 of its 10 tiles (the
    last chunk padded)."""
    monkeypatch.setattr(moe_matmul, "TILE_ROWS", 2)  # groups of 3 and 4 rows: 2 tiles each
    monkeypatch.setattr(moe_matmul, "TILE_CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 16)).astype(np.float32)
    w = rng.standard_normal((5, 16, 8)).astype(np.float32)
    sizes = np.array([3, 0, 4, 0, 1], np.int32)  # 8 rows in groups, 2 spare rows
    starts = np.concatenate([[0], np.cumsum(sizes)])
    want = np.zeros((10, 8))
    for g in range(5):
        rows = slice(starts[g], starts[g + 1])
        want[rows] = x[rows].astype(np.float64) @ w[g]
    got = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), form))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes[:3]), form)


@pytest.mark.parametrize("model,tokens", [("qwen3-30b-a3b", 2048), ("mixtral-8x7b", 512)])
def test_the_activation_reserve_holds_a_mixture_steps_temporaries(model, tokens):
    """The XLA forms of a mixture layer at a prefill step of real shapes (compiled, not run)
    need no more temporary memory than the engine's reserve counts for it beyond a dense
    MLP's (engine.memory.moe_reserve_bytes): the tiles form gathers its experts in bounded
    chunks, not one expert per tile (qwen3-30b-a3b, 2048 tokens: 3.65 GiB unchunked)."""
    cfg = get_preset(model)
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shape = jax.ShapeDtypeStruct
    weights = {"gate_up_proj": shape((e, h, 2 * i), jnp.bfloat16),
               "down_proj": shape((e, i, h), jnp.bfloat16)}
    layer = jax.jit(lambda x, r, w: moe_mlp(x, r, w, top_k=cfg.num_experts_per_tok,
                                            normalize=True, hidden_act="silu"))
    compiled = layer.lower(shape((tokens, h), jnp.bfloat16), shape((h, e), jnp.bfloat16),
                           weights).compile()
    assert compiled.memory_analysis().temp_size_in_bytes <= moe_reserve_bytes(cfg, tokens)


@pytest.mark.parametrize("quant", [None, "int4_rtn"])
def test_prepare_for_a_gpu_fuses_attention_and_the_experts_gate_and_up(quant):
    """The fused model (q/k/v as one product, each layer's experts' gate and up as one
    [E, hidden, 2 I]) computes the unfused model's logits, float32 or INT4 experts; quantized
    and asked for (gemv_layers=True: auto leaves a mixture in [in, out]), its attention products
    are stored transposed for the one-token kernel and its experts keep their layout."""
    cfg = get_preset("tiny-qwen3-moe")
    model = random_model(cfg, seed=1)
    if quant:
        quantize_model(cfg, model, QuantConfig(quant, group_size=16), progress=False)
    ids = (np.arange(12)[None] * 37 + 5) % cfg.vocab_size
    unfused = np.asarray(full_sequence_logits(cfg, model, ids, page_size=4))
    prepared = prepare_for_device(cfg, model, platform="gpu", hopper=True,
                                  gemv_layers=True if quant else None)
    layer = prepared.model.layers[0]
    assert prepared.cfg.fused_projections and hasattr(layer.self_attn, "qkv_proj")
    assert not hasattr(layer.mlp, "gate_proj") and not hasattr(layer.mlp, "up_proj")
    fused = layer.mlp.gate_up_proj.kernel.get_value()
    assert (fused.shape if not quant else fused.scales.shape) == (
        (8, 64, 64) if not quant else (8, 64 // 16, 64))  # [E, hidden, 2 I]
    got = np.asarray(full_sequence_logits(prepared.cfg, prepared.model, ids, page_size=4))
    np.testing.assert_allclose(got, unfused, rtol=1e-5, atol=1e-5 * np.abs(unfused).max())
    assert prepared.cfg.gemv_layers == bool(quant)
    assert isinstance(layer.self_attn.o_proj.kernel.get_value(), TransposedWeight) == bool(quant)
    assert not isinstance(fused, TransposedWeight)


def test_hf_loader_reads_every_expert_layout():
    """Per-expert tensors (Mixtral's w1/w3/w2, Qwen3-MoE's *_proj) and transformers 5's stacked
    gate_up_proj / down_proj all stack to the same experts; dense layers among the experts are
    refused."""
    hf = load_hf_dir(os.path.join(GOLDEN_DIR, "tiny-qwen3-moe"), load_tokenizer=False)
    cfg, p = hf.config, "model.layers.1.mlp.experts."
    gate, up, down = (hf.tensors[p + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
    v5 = stack_experts(cfg, {p + "gate_up_proj": np.concatenate([gate, up], axis=1),
                             p + "down_proj": down})
    names = {"gate": "w1", "up": "w3", "down": "w2"}
    mixtral = stack_experts(cfg, {f"model.layers.1.block_sparse_moe.experts.{j}.{names[n]}"
                                  f".weight": w[j] for n, w in
                                  (("gate", gate), ("up", up), ("down", down))
                                  for j in range(cfg.num_experts)})
    for stacked in (v5, mixtral):
        for n, w in (("gate", gate), ("up", up), ("down", down)):
            np.testing.assert_array_equal(stacked[p + f"{n}_proj.weight"], w)
    raw = json.load(open(os.path.join(GOLDEN_DIR, "tiny-qwen3-moe", "config.json")))
    with pytest.raises(ValueError, match="every layer must be sparse"):
        config_from_hf({**raw, "mlp_only_layers": [0]}, "x")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("tokens,seqs", [(4, 4), (32, 32), (256, 2)],
                         ids=["decode", "batched decode", "prefill"])
def test_preset_lowers_for_the_gpu(h200_lowering, name, tokens, seqs):  # noqa: F811
    """Two layers of the real shapes, bf16, lowered for an H200 with the GPU kernels: the
    one-row kernel (ops/expert_gemv.py) for up to E pairs in token order, the grouped kernel
    (ops/expert_gemm.py) for the pairs sorted by expert of batched decode and prefill steps;
    no XLA expert product."""
    cfg = get_preset(name).replace(num_layers=2)
    graphdef, state = nnx.split(abstract_model(cfg, jnp.bfloat16))
    cache = jax.eval_shape(lambda: init_kv_cache(cfg, 64, 16, jnp.bfloat16))
    spec = jax.ShapeDtypeStruct
    meta = AttentionMetadata(
        positions=spec((tokens,), jnp.int32), slot_mapping=spec((tokens,), jnp.int32),
        block_tables=spec((seqs, 16), jnp.int32), query_start_loc=spec((seqs + 1,), jnp.int32),
        kv_lens=spec((seqs,), jnp.int32), max_q_len=tokens // seqs,
        max_prefill_seqs=0 if tokens == seqs else seqs)
    kernels = select_kernels("gpu", hopper=True)

    def step(state, cache, ids, meta):
        return forward(nnx.merge(graphdef, state), cache, ids, meta, cfg, kernels=kernels)
    text = jax.jit(step).trace(state, cache, spec((tokens,), jnp.int32), meta).lower(
        lowering_platforms=("cuda",)).as_text()
    assert h200_lowering  # the attention kernel lowered too
    assert "ragged_dot" not in text
    pairs = tokens * cfg.num_experts_per_tok
    one_row = pairs <= cfg.num_experts
    assert ('"expert_gemv"' in text) == one_row and ('"expert_gemm"' in text) != one_row
