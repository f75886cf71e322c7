"""The Llama family and its relatives (Llama 2/3/3.1, SmolLM2, Qwen2/3, Mistral, Gemma 2, Gemma 3
text) in Flax NNX, over a paged KV cache; ModelConfig's fields switch the variants (q/k norms,
sliding windows, soft caps, GeGLU, Gemma's extra norms, embedding scale and local RoPE base).

The module tree only holds weights. Running it is a pure function (`forward` below): weights,
cache and step metadata in, logits and the new cache out; nothing is stored on the modules.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.kv_cache import KVCache
from models.layer_scan import LayerChoice, scan_layers
from models.longrope import longrope_and_write_kv
from models.moe import ExpertLinear, SparseMoE
from ops import gemv as gemv_ops
from ops.backends import device_kernels
from ops.kernel_choice import KernelBackends
from ops.matmul import TransposedWeight, device_k_order, linear, reorder_k
from ops.moe_matmul import ACTIVATIONS
from ops.paged_attention import step_attention
from ops.rms_norm import rms_norm
from ops.rope_kv import rope_and_write_kv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's N flat tokens sit in their S sequences and in the cache (int32 arrays).

    positions        [N]      position of each token in its sequence
    slot_mapping     [N]      flat cache slot to write each token's K/V to (-1: padding)
    block_tables     [S, W]   physical page of each logical page of each sequence
    query_start_loc  [S + 1]  sequence s owns tokens [query_start_loc[s], query_start_loc[s+1])
    kv_lens          [S]      cached tokens of each sequence once this step's tokens are written
    max_q_len, max_prefill_seqs (static): bounds of the query tokens of one sequence and of the
      number of sequences with more than one (see ops.paged_attention.ragged_attention_by_groups)
    """

    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    query_start_loc: jax.Array
    kv_lens: jax.Array
    max_q_len: int = dataclasses.field(default=1, metadata=dict(static=True))
    max_prefill_seqs: int = dataclasses.field(default=0, metadata=dict(static=True))


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2], float32, with the configured scaling
    (Llama 3.1's, or linear); LongRoPE's are [2, head_dim // 2], the short and the long
    factors' (see longrope_and_write_kv). local: those of the sliding-window layers, which have
    their own base and no scaling where cfg.rope_local_theta is set (Gemma 3)."""
    local = local and cfg.rope_local_theta is not None
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / cfg.head_dim
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "longrope":
        factors = np.asarray([s.short_factor, s.long_factor], np.float32)  # [2, D / 2]
        if factors.shape[1] != cfg.head_dim // 2:
            raise ValueError(f"longrope factors have {factors.shape[1]} entries, expected "
                             f"head_dim / 2 = {cfg.head_dim // 2}")
        powers = np.float32(theta) ** exponents
        return (1.0 / (factors * powers)).astype(np.float32)
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, kernels: KernelBackends | None = None) -> jax.Array:
        # one kernel on GPU (ops/rms_norm.py)
        return rms_norm(x, self.weight[...], self.eps, kernels=kernels)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias). The kernel [in, out] may be a quantized weight (see ops/matmul.py).

    `weights=(kernel, bias or None)` builds the layer from existing arrays instead of drawing
    random ones (din, dout, rngs and dtype are then unused): fuse_projections uses it.
    """

    def __init__(self, din: int, dout: int, rngs: nnx.Rngs | None, dtype, bias: bool = False,
                 *, weights: tuple | None = None):
        if weights is not None:
            self.kernel = nnx.Param(weights[0])
            self.bias = None if weights[1] is None else nnx.Param(weights[1])
            return
        init = nnx.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (din, dout), dtype))
        self.bias = nnx.Param(init(rngs.params(), (dout,), dtype)) if bias else None

    def __call__(self, x: jax.Array, kernels: KernelBackends | None = None) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        kernel = self.kernel.get_value()
        if isinstance(kernel, LayerChoice):  # in a scanned layer body (models/layer_scan.py)
            return kernel.apply(lambda w: linear(x, w, bias, kernels))
        return linear(x, kernel, bias, kernels)


def _linear(cfg: ModelConfig, din: int, dout: int, rngs: nnx.Rngs, dtype, bias=False):
    return Linear(din, dout, rngs, dtype, bias)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        h, d = cfg.hidden_size, cfg.head_dim
        if cfg.qk_norm:  # one [head_dim] scale shared by every query head, one by every key head
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        if cfg.fused_projections:  # columns: q (H * D), then k (KVH * D), then v (KVH * D)
            self.qkv_proj = _linear(cfg, h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, rngs,
                                    dtype, cfg.attention_bias)
        else:
            self.q_proj = _linear(cfg, h, cfg.num_heads * d, rngs, dtype, cfg.attention_bias)
            self.k_proj = _linear(cfg, h, cfg.num_kv_heads * d, rngs, dtype, cfg.attention_bias)
            self.v_proj = _linear(cfg, h, cfg.num_kv_heads * d, rngs, dtype, cfg.attention_bias)
        self.o_proj = _linear(cfg, cfg.num_heads * d, h, rngs, dtype)

    def project_qkv(self, x: jax.Array, kernels: KernelBackends | None = None):
        """The fused projection [N, (H + 2 KVH) * D] of x [N, hidden], or the three projections
        (q [N, H * D], k [N, KVH * D], v [N, KVH * D])."""
        if hasattr(self, "qkv_proj"):
            return self.qkv_proj(x, kernels)
        return self.q_proj(x, kernels), self.k_proj(x, kernels), self.v_proj(x, kernels)

    def __call__(self, x, k_pages, v_pages, meta: AttentionMetadata, cfg: ModelConfig,
                 inv_freq: np.ndarray, kernels: KernelBackends | None = None,
                 window: int | None = None):
        """Attention of normed hidden states x [N, hidden]: project_qkv, then `attend`."""
        return self.attend(self.project_qkv(x, kernels), k_pages, v_pages, meta, cfg, inv_freq,
                           kernels, window)

    def attend(self, qkv, k_pages, v_pages, meta: AttentionMetadata, cfg: ModelConfig,
               inv_freq: np.ndarray, kernels: KernelBackends | None = None,
               window: int | None = None):
        """Attention of projected tokens (project_qkv's output) over the cache, with this step's
        K/V written; returns (o_proj's output [N, hidden], k_pages, v_pages). window: this
        layer's sliding window (ModelConfig.layer_window), None for full attention."""
        heads, k_pages, v_pages = self.attention_heads(qkv, k_pages, v_pages, meta, cfg,
                                                       inv_freq, kernels, window)
        return self.o_proj(heads, kernels), k_pages, v_pages

    def attention_heads(self, qkv, k_pages, v_pages, meta: AttentionMetadata, cfg: ModelConfig,
                        inv_freq: np.ndarray, kernels: KernelBackends | None = None,
                        window: int | None = None):
        """`attend` before o_proj: (the heads' outputs [N, H * D], k_pages, v_pages)."""
        num_tokens = meta.positions.shape[0]
        # q/k norms (Qwen3, Gemma 3: one [head_dim] scale shared by every query head, one by
        # every key head), RoPE on q and k and the K/V cache write, in one kernel on GPU
        # (ops/rope_kv.py).
        qk_norm = ((self.q_norm.weight[...], self.k_norm.weight[...], cfg.rms_norm_eps)
                   if cfg.qk_norm else None)
        if np.ndim(inv_freq) == 2:  # LongRoPE: the short and the long factors' frequencies
            q, k_pages, v_pages = longrope_and_write_kv(
                qkv, meta, inv_freq, k_pages, v_pages, cfg.rope_scaling, cfg.num_heads, kernels,
                qk_norm=qk_norm)
        else:
            q, k_pages, v_pages = rope_and_write_kv(
                qkv, meta.positions, inv_freq, k_pages, v_pages, meta.slot_mapping,
                num_heads=cfg.num_heads, qk_norm=qk_norm, kernels=kernels)  # q [N, H, D]
        out = step_attention(
            q, k_pages, v_pages, meta.block_tables, meta.query_start_loc, meta.kv_lens,
            max_q_len=meta.max_q_len, max_prefill_seqs=meta.max_prefill_seqs,
            scale=cfg.attention_scale, soft_cap=cfg.attn_logit_softcap, sliding_window=window,
            kernels=kernels)  # [N, H, D]
        return out.reshape(num_tokens, cfg.num_heads * cfg.head_dim), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.hidden_act = cfg.hidden_act
        if cfg.fused_projections:  # columns: gate (I), then up (I)
            self.gate_up_proj = _linear(cfg, h, 2 * i, rngs, dtype)
        else:
            self.gate_proj = _linear(cfg, h, i, rngs, dtype)
            self.up_proj = _linear(cfg, h, i, rngs, dtype)
        self.down_proj = _linear(cfg, i, h, rngs, dtype)

    def project_gate_up(self, x, kernels: KernelBackends | None = None):
        """The fused gate/up projection [N, 2 I] of x, or (gate [N, I], up [N, I])."""
        if hasattr(self, "gate_up_proj"):
            return self.gate_up_proj(x, kernels)
        return self.gate_proj(x, kernels), self.up_proj(x, kernels)

    def __call__(self, x, kernels: KernelBackends | None = None):
        return self.down(self.project_gate_up(x, kernels), kernels)

    def down(self, gate_up, kernels: KernelBackends | None = None):
        """down_proj(act(gate) x up) of project_gate_up's output."""
        return self.down_proj(gated_activation(gate_up, self.hidden_act), kernels)


def gated_activation(gate_up, hidden_act: str = "silu"):
    """act(gate) x up [N, I] of (gate [N, I], up [N, I]) or of the fused [N, 2 I]; act is SiLU
    or the tanh-approximate GELU (hidden_act "gelu_tanh": GeGLU)."""
    if isinstance(gate_up, tuple):
        gate, up = gate_up
    else:
        i = gate_up.shape[-1] // 2
        gate, up = gate_up[:, :i], gate_up[:, i:]
    return ACTIVATIONS[hidden_act](gate) * up


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, rngs, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention output
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SparseMoE(cfg, rngs, dtype) if cfg.is_moe else MLP(cfg, rngs, dtype)

    def __call__(self, x, k_pages, v_pages, meta: AttentionMetadata, cfg: ModelConfig,
                 inv_freq: np.ndarray, kernels: KernelBackends | None = None,
                 window: int | None = None):
        """Pre-norm attention then MLP, each with a residual (with sandwich_norms their outputs
        are normed too); returns (x, k_pages, v_pages). window: ModelConfig.layer_window."""
        if cfg.gemv_layers and x.shape[0] <= gemv_ops.MAX_ROWS:
            return self.gemv_call(x, k_pages, v_pages, meta, cfg, inv_freq, kernels, window)
        qkv = self.self_attn.project_qkv(self.input_layernorm(x, kernels), kernels)
        attn_out, k_pages, v_pages = self.self_attn.attend(qkv, k_pages, v_pages, meta, cfg,
                                                           inv_freq, kernels, window)
        if cfg.sandwich_norms:
            x = x + self.post_attention_layernorm(attn_out, kernels)
            mlp_out = self.mlp(self.pre_feedforward_layernorm(x, kernels), kernels)
            return x + self.post_feedforward_layernorm(mlp_out, kernels), k_pages, v_pages
        x = x + attn_out
        return x + self.normed_mlp(x, kernels), k_pages, v_pages

    def normed_mlp(self, x, kernels: KernelBackends | None = None):
        """mlp(post_attention_layernorm(x)); a mixture of experts norms x itself, with its
        router (one kernel on a GPU's decode rows)."""
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(x, kernels, norm=(norm.weight[...], norm.eps))
        return self.mlp(norm(x, kernels), kernels)

    def gemv_call(self, x, k_pages, v_pages, meta: AttentionMetadata, cfg: ModelConfig,
                  inv_freq: np.ndarray, kernels: KernelBackends | None = None,
                  window: int | None = None):
        """`__call__` of a transposed layer (ModelConfig.gemv_layers) for a step of at most
        ops.gemv.MAX_ROWS tokens: four fused_gemv kernels (ops/gemv.py), the norms, SiLU x up
        and residuals inside them, around RoPE + KV write and attention; gate/up, o and down
        apart where ops.gemv.runs_apart says the Hopper kernel is faster (INT4 gate/up and
        down). A mixture of experts' layer runs q/k/v and o so, then its MoE MLP."""
        attn, mlp = self.self_attn, self.mlp
        def product(x, layer, **kw):  # layer's TransposedWeight: [out, in] (+ code scales)
            w = layer.kernel.get_value()
            return gemv_ops.fused_gemv(x, w.w_t, scales=w.scales, offsets=w.offsets,
                                       group_size=w.group_size or None, k_order=w.k_order,
                                       kernels=kernels, **kw)

        qkv = product(x, attn.qkv_proj, norm_weight=self.input_layernorm.weight[...],
                      eps=cfg.rms_norm_eps,
                      bias=None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[...])
        heads, k_pages, v_pages = attn.attention_heads(qkv, k_pages, v_pages, meta, cfg,
                                                       inv_freq, kernels, window)
        apart = functools.partial(gemv_ops.runs_apart, rows=x.shape[0], kernels=kernels,
                                  x_dtype=x.dtype)

        def plus_residual(h, layer, kind):  # x + h @ layer, fused or apart (XLA adds x)
            if apart(layer.kernel.get_value(), product=kind):
                return x + layer(h, kernels)
            return product(h, layer, residual=x)

        x = plus_residual(heads, attn.o_proj, "o")
        if cfg.is_moe:
            return x + self.normed_mlp(x, kernels), k_pages, v_pages
        if apart(mlp.gate_up_proj.kernel.get_value(), product="gated"):
            # INT4 on a Hopper GPU: norm, the Hopper kernel (via linear), SiLU x up apart
            act = gated_activation(mlp.gate_up_proj(self.post_attention_layernorm(x, kernels),
                                                    kernels))
        else:
            act = product(x, mlp.gate_up_proj, gated=True, eps=cfg.rms_norm_eps,
                          norm_weight=self.post_attention_layernorm.weight[...])  # SiLU(g) x up
        return plus_residual(act, mlp.down_proj, "down"), k_pages, v_pages


class LlamaForCausalLM(nnx.Module):
    """Weights of a Llama-family decoder; run it with `forward`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.float32):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(stddev=0.02))
        self.layers = nnx.List([DecoderLayer(cfg, rngs, dtype) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs, dtype)


def embed(model: LlamaForCausalLM, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The input embeddings [N, hidden] of tokens [N] (times sqrt(hidden) where configured)."""
    x = model.embed_tokens(tokens)
    if cfg.embed_scale:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    return x


def layer_attention(cfg: ModelConfig, layer: int) -> tuple[np.ndarray, int | None]:
    """(inverse RoPE frequencies, sliding window or None) of decoder layer `layer`."""
    window = cfg.layer_window(layer)
    return rope_inv_freq(cfg, local=window is not None), window


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg", "kernels", "window"))
def _layer_program(graphdef, state, x, k_pages, v_pages, meta, *, cfg, kernels, window):
    inv_freq = rope_inv_freq(cfg, local=window is not None)  # a constant of the program
    return nnx.merge(graphdef, state)(x, k_pages, v_pages, meta, cfg, inv_freq, kernels, window)


def run_layer(layer: DecoderLayer, x, k_pages, v_pages, meta: AttentionMetadata,
              cfg: ModelConfig, kernels: KernelBackends | None, window: int | None):
    """layer(x, k_pages, v_pages, meta, cfg, its RoPE frequencies, kernels, window) -> (x,
    k_pages, v_pages), as a jitted function of the layer's weights: unrolled layers of one
    structure share one trace and one lowering (XLA inlines the calls, so the compiled step
    is the same), where calling each layer would trace and lower it again, Python work that a
    start-up's compile threads take turns at."""
    graphdef, state = nnx.split(layer)
    return _layer_program(graphdef, state, x, k_pages, v_pages, meta, cfg=cfg, kernels=kernels,
                          window=window)


def forward(model: LlamaForCausalLM, cache: KVCache, tokens: jax.Array, meta: AttentionMetadata,
            cfg: ModelConfig, logits_indices: jax.Array | None = None,
            kernels: KernelBackends | None = None) -> tuple[jax.Array, KVCache]:
    """Runs the decoder over this step's flat tokens and returns (logits, new cache).

    tokens: int32 [N]. With `logits_indices` (int32 [S]) only the hidden states at those token
    indices go through the output head: logits [S, V]; otherwise logits [N, V]. Logits are
    float32. kernels (static, hashable): the implementation of every op family, chosen once
    by the runner (ops.backends.select_kernels); None runs the jnp / XLA references. A stacked
    cache (KVCache.stacked_layers: the runner's choice, kernels.layer_loop "scan") runs the
    layers as one scanned body (models/layer_scan.py), a per-layer cache unrolled.
    """
    x = embed(model, tokens, cfg)  # [N, hidden]
    if cache.stacked_layers:  # one traced layer body (models/layer_scan.py)
        x, cache = scan_layers(model.layers, x, cache, meta, cfg, kernels,
                               functools.partial(layer_attention, cfg))
    else:
        # per layer: float pages, or QuantizedPages of an int8 / fp8 cache (models/kv_cache.py)
        k_all, v_all = map(list, zip(*(cache.layer(i) for i in range(len(model.layers)))))
        for i, layer in enumerate(model.layers):
            x, k_all[i], v_all[i] = run_layer(layer, x, k_all[i], v_all[i], meta, cfg, kernels,
                                              cfg.layer_window(i))
        cache = KVCache.from_layers(k_all, v_all)
    if logits_indices is not None:
        x = x[logits_indices]  # [S, hidden] (the norm is per row: gather first)
    x = model.norm(x, kernels)
    logits = (tied_logits(model.embed_tokens, x) if cfg.tie_word_embeddings
              else model.lm_head(x, kernels))
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = cap * jnp.tanh(logits / cap)
    return logits, cache


def tied_logits(embed: nnx.Embed, x: jax.Array) -> jax.Array:
    """x [N, hidden] against every row of the tied embedding table [V, hidden] -> [N, V]: what
    nnx.Embed.attend computes, as one dot_general contracting hidden on both sides. Written as
    x @ table.T, XLA's CPU backend fused the transpose into a naive loop every step (28 of
    SmolLM2's 62 ms a decode step); GPUs lower both forms to the same product."""
    x, table = embed.promote_dtype((x, embed.embedding[...]), dtype=embed.dtype)
    return jax.lax.dot_general(x, table, (((x.ndim - 1,), (1,)), ((), ())))


def _check_fusable(kernels: list) -> None:
    """Raises ValueError unless the kernels can be concatenated column-wise (_concat_kernels)."""
    first = kernels[0]
    if all(isinstance(k, jax.Array | np.ndarray) for k in kernels):
        return
    fields = ("bits", "group_size", "layout")
    if any(isinstance(k, jax.Array | np.ndarray) for k in kernels) or any(
            getattr(k, "perm", None) is not None for k in kernels) or any(
            tuple(getattr(k, f) for f in fields) != tuple(getattr(first, f) for f in fields)
            for k in kernels):
        raise ValueError("fuse_projections: quantized kernels must share bits, group size and "
                         "layout and have no act-order permutation")


def _concat_kernels(kernels: list):
    """Concatenates [K, n_i] (or experts' [E, K, n_i]) kernels along the output axis: float
    arrays, or quantized weights (quant/qtensor.py) of one format, whose columns are
    independent (own scales and offsets)."""
    first = kernels[0]
    _check_fusable(kernels)
    if isinstance(first, jax.Array | np.ndarray):
        return jnp.concatenate(kernels, axis=-1)
    cat = lambda name: (None if getattr(first, name) is None  # noqa: E731
                        else jnp.concatenate([getattr(k, name) for k in kernels], axis=-1))
    return dataclasses.replace(first, packed=cat("packed"), scales=cat("scales"),
                               offsets=cat("offsets"))


def _fused_linear(parent, names: tuple[str, ...]) -> Linear:
    """One Linear whose columns are those of parent's `names` layers, which are removed."""
    layers = [getattr(parent, n) for n in names]
    kernel = _concat_kernels([m.kernel.get_value() for m in layers])
    biases = [None if m.bias is None else m.bias.get_value() for m in layers]
    bias = None if biases[0] is None else jnp.concatenate(biases)
    for n in names:
        delattr(parent, n)  # frees each old kernel once nothing else holds it
    return Linear(0, 0, None, None, weights=(kernel, bias))


def _fused_experts(mlp: SparseMoE) -> ExpertLinear:
    """One ExpertLinear whose columns are mlp's gate then up experts' (which are removed)."""
    kernel = _concat_kernels([getattr(mlp, n).kernel.get_value() for n in _GATE_UP])
    for n in _GATE_UP:
        delattr(mlp, n)
    return ExpertLinear(0, 0, 0, None, None, kernel=kernel)


_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def _free_as_replaced() -> None:
    """Collects the reference cycles that building a model leaves: nnx's split and merge leave
    garbage that holds every Variable of the model until the cyclic collector runs, so a layer's
    kernels replaced in place would stay in device memory until then (qwen3-30b-a3b's experts,
    fused in bf16: 38 GB more than the model). Once collected, each replaced kernel frees as it
    is dropped, and rewriting a model needs one layer's kernels more, not the model's."""
    gc.collect()


def fuse_projections(cfg: ModelConfig, model: LlamaForCausalLM
                     ) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Fuses each layer's q/k/v and gate/up kernels into one kernel each, in place.

    Returns (cfg with fused_projections=True, the same model object). The fused model computes
    the same function: its products are the unfused ones side by side. Layer by layer, so peak
    memory grows by one layer's kernels. Quantize before fusing (quant/model.py names the
    unfused layers); quantized kernels are concatenated column-wise. A mixture's experts fuse
    their gate and up kernels into one [E, hidden, 2 I] (models.moe.FUSED_PROJECTIONS).
    Sharding rules (models/sharding.py) know only the unfused names: fused weights are for one
    device.
    """
    if cfg.fused_projections:
        raise ValueError("fuse_projections: the model is already fused")
    for layer in model.layers:  # every layer checked first: an error leaves the model as it was
        for parent, names in ((layer.self_attn, _QKV), (layer.mlp, _GATE_UP)):
            _check_fusable([getattr(parent, n).kernel.get_value() for n in names])
    _free_as_replaced()
    for layer in model.layers:
        layer.self_attn.qkv_proj = _fused_linear(layer.self_attn, _QKV)
        if cfg.is_moe:
            layer.mlp.gate_up_proj = _fused_experts(layer.mlp)
        else:
            layer.mlp.gate_up_proj = _fused_linear(layer.mlp, _GATE_UP)
    return cfg.replace(fused_projections=True), model


def transpose_for_gemv(cfg: ModelConfig, model: LlamaForCausalLM, k_order: str | None = None,
                       kernels: KernelBackends | None = None
                       ) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Stores each layer's q/k/v, o, gate/up and down kernels transposed, [out, in]
    (ops.matmul.TransposedWeight), in place, for ops/gemv.py's fused decode kernel (a mixture
    of experts' layers: q/k/v and o; the experts keep their layout).

    Codes are stored along `in` in `k_order` (TransposedWeight.k_order): None picks the order
    of `kernels` per weight (ops.matmul.device_k_order: "wgmma" with the Hopper kernel, which
    then reads x without a gather; "natural" elsewhere); kernels None: this device's choice
    (ops.backends.device_kernels).

    Returns (cfg with gemv_layers=True, the same model object). Needs fused projections
    (fuse_projections first) and float or quantized kernels (QuantizedWeight.transposed: INT8
    or INT4 codes [out, in] with their scales; act-order INT4 is refused); one device, like
    fusion. The model computes the same function; layer by layer, so peak memory grows by one
    layer's kernels. An untied output head of codes (QuantConfig.lm_head) is stored transposed
    too, for the same kernels as the layers' products (on the H200 only then is a quantized
    head faster than the bf16 one); a float head keeps its layout (XLA's product reads it at
    the copy rate).
    """
    if cfg.gemv_layers:
        raise ValueError("transpose_for_gemv: the model is already transposed")
    if not cfg.fused_projections:
        raise ValueError("transpose_for_gemv: fuse the projections first (fuse_projections)")
    plain = {"sandwich_norms": cfg.sandwich_norms,
             "hidden_act": cfg.hidden_act != "silu" and not cfg.is_moe}
    if any(plain.values()):
        raise ValueError(f"transpose_for_gemv: the fused decode layer has no "
                         f"{next(k for k, v in plain.items() if v)} (ModelConfig)")
    linears = _transposed_linears(cfg, model)
    if k_order is None and kernels is None:
        kernels = device_kernels()
    for lin in linears:  # every kernel checked first: an error leaves the model as it was
        kernel = lin.kernel.get_value()
        if isinstance(kernel, jax.Array | np.ndarray):
            continue
        if not hasattr(kernel, "transposed"):
            raise ValueError(f"transpose_for_gemv: {type(kernel).__name__} kernels cannot be "
                             "stored transposed")
        try:
            jax.eval_shape(lambda: reorder_k(kernel.transposed(), k_order or "natural"))
        except ValueError as e:
            raise ValueError(f"transpose_for_gemv: {e}") from None
    _free_as_replaced()
    for lin in linears:
        kernel = lin.kernel.get_value()
        if isinstance(kernel, jax.Array | np.ndarray):
            lin.kernel = nnx.Param(TransposedWeight(jnp.asarray(kernel).T))
            continue
        weight = kernel.transposed()
        lin.kernel = nnx.Param(reorder_k(weight, k_order or device_k_order(weight, kernels)))
    return cfg.replace(gemv_layers=True), model


def has_quantized_layers(model: LlamaForCausalLM) -> bool:
    """Whether the layers' products hold quantized codes (INT8 / INT4 weights of quant/), not
    float arrays (read from o_proj and down_proj, which fusion leaves as they are)."""
    return any(not isinstance(lin.kernel.get_value(), jax.Array | np.ndarray)
               for layer in model.layers for lin in (layer.self_attn.o_proj, layer.mlp.down_proj))


def _gemv_linears(layer: DecoderLayer) -> tuple[Linear, ...]:
    """A layer's products for ops/gemv.py: q/k/v, o, and the MLP's gate/up and down (a mixture
    of experts' expert products keep their layout, for ops/expert_gemv.py)."""
    attention = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    if isinstance(layer.mlp, SparseMoE):
        return attention
    return attention + (layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _transposed_linears(cfg: ModelConfig, model: LlamaForCausalLM) -> list[Linear]:
    """What transpose_for_gemv stores transposed: each layer's four products, then an untied
    output head of codes (a float head keeps its layout)."""
    out = [lin for layer in model.layers for lin in _gemv_linears(layer)]
    if not cfg.tie_word_embeddings and not isinstance(model.lm_head.kernel.get_value(),
                                                      jax.Array | np.ndarray):
        out.append(model.lm_head)
    return out
