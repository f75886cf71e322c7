"""AWQ: activation-aware scaling and clipping before group-wise round-to-nearest.

A few input channels of each linear layer carry much larger activations than the rest; the
rounding error of the weights they multiply matters most. AWQ scales those weight rows up by s
(per input channel) before quantizing, and divides the op that produces the input by s, so the
float model computes exactly the same function:

    y = (x / s) @ (diag(s) W)       with 1 / s folded into the preceding op

Per decoder layer, four such pairs (preceding op -> scaled linears, and the block whose output
error is measured):
    input_layernorm          -> q, k, v      attention block output
    v_proj (output columns)  -> o_proj       o_proj output (GQA: one scale per KV channel,
                                             repeated over the query heads that read it)
    post_attention_layernorm -> gate, up     MLP output
    up_proj (output columns) -> down_proj    down_proj output
The scale is s = mean|x|^alpha (normalized to geometric mean 1 over its extremes), with alpha
chosen on a grid in [0, 1) to minimize the block's output error with the weights
quantized-then-dequantized (alpha = 0 is plain RTN, so the search never does worse than RTN on the
calibration inputs). Then, for every linear but q and k (whose errors the softmax amplifies), the
largest weights of each group are clipped to a fraction of the group's max |w|, chosen per group
and output column to minimize that group's share of the output error. Finally the scaled, clipped
weights are quantized group-wise with RTN (quant/rtn.py).
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from quant.calibration import LayerwiseRunner, linear_modules
from quant.rtn import fake_quantize, resolve_group_size

SCALE_GRID = 20
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(10))  # 1.0 ... 0.55


@contextlib.contextmanager
def substituted_kernels(modules: dict, kernels: dict):
    """Temporarily gives the named Linear modules other kernels (float arrays)."""
    originals = {name: modules[name].kernel.get_value() for name in kernels}
    try:
        for name, kernel in kernels.items():
            modules[name].kernel.set_value(kernel)
        yield
    finally:
        for name, kernel in originals.items():
            modules[name].kernel.set_value(kernel)


def scale_candidate(x_mean: jnp.ndarray, alpha: float) -> jnp.ndarray:
    s = jnp.maximum(x_mean ** alpha, 1e-4)
    return s / jnp.sqrt(s.max() * s.min())


def search_scale(x_mean, kernels: dict, block_fn, reference, bits: int, group_size: int,
                 symmetric: bool, expand=lambda s: s, grid: int = SCALE_GRID):
    """(best scale [C], best alpha, losses per alpha) for the linears `kernels` ({name: [K, N]}).

    x_mean [C]: mean |activation| per channel of the preceding op's output; expand maps a scale
    [C] to the kernels' input rows [K]. block_fn({name: kernel}) -> block output, compared with
    `reference` (the float output) by mean squared error.
    """
    losses = []
    best = (np.inf, None, None)
    for i in range(grid):
        alpha = i / grid
        s = scale_candidate(x_mean, alpha)
        rows = expand(s)[:, None]  # [K, 1]
        fake = {name: fake_quantize(w * rows, bits, group_size, symmetric) / rows
                for name, w in kernels.items()}
        loss = float(jnp.mean((block_fn(fake).astype(jnp.float32) - reference) ** 2))
        losses.append(loss)
        if loss < best[0]:
            best = (loss, s, alpha)
    return best[1], best[2], losses


def clip_weights(w: jnp.ndarray, ratios: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """Clamps each group of rows of w [K, N] to +-ratio * its max |w| (ratios [G, N])."""
    k = w.shape[0]
    limit = jnp.max(jnp.abs(_grouped_rows(w, group_size)), axis=1) * ratios  # [G, N]
    limit = jnp.repeat(limit, group_size, axis=0)[:k]  # [K, N]
    return jnp.clip(w, -limit, limit)


def _grouped_rows(w, group_size):
    k, n = w.shape
    g = -(-k // group_size)
    return jnp.pad(w, ((0, g * group_size - k), (0, 0)), mode="edge").reshape(g, group_size, n)


def search_clip(w, x, bits: int, group_size: int, symmetric: bool,
                ratios=CLIP_RATIOS, column_chunk: int = 512) -> jnp.ndarray:
    """Per group and output column, the clip ratio minimizing the group's output error.

    w [K, N], x [T, K] (a sample of calibration inputs). Returns ratios [G, N].
    """
    k, n = w.shape
    g = -(-k // group_size)
    xg = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, g * group_size - k)))
    xg = xg.reshape(-1, g, group_size)  # [T, G, gs]; padded rows see zero inputs
    best_ratio = []
    for c0 in range(0, n, column_chunk):
        wc = w[:, c0:c0 + column_chunk].astype(jnp.float32)
        reference = jnp.einsum("tgk,gkn->tgn", xg, _grouped_rows(wc, group_size))
        best_err = jnp.full((g, wc.shape[1]), jnp.inf)
        best = jnp.ones((g, wc.shape[1]))
        for r in ratios:
            err = _clip_error(wc, xg, reference, r, bits, group_size, symmetric)  # [G, n]
            best = jnp.where(err < best_err, r, best)
            best_err = jnp.minimum(err, best_err)
        best_ratio.append(best)
    return jnp.concatenate(best_ratio, axis=1)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "symmetric"))
def _clip_error(w, xg, reference, ratio, bits, group_size, symmetric):
    """Mean squared output error per group and column [G, N] with w clipped at `ratio`."""
    ratios = jnp.full((xg.shape[1], w.shape[1]), ratio)
    q = fake_quantize(clip_weights(w, ratios, group_size), bits, group_size, symmetric)
    out = jnp.einsum("tgk,gkn->tgn", xg, _grouped_rows(q, group_size))
    return jnp.mean((out - reference) ** 2, axis=0)


def kv_channel_scale_expander(num_heads: int, num_kv_heads: int, head_dim: int):
    """Maps a scale over v_proj's output channels [KVH * D] to o_proj's inputs [H * D]."""
    group = num_heads // num_kv_heads

    def expand(s):
        return jnp.repeat(s.reshape(num_kv_heads, 1, head_dim), group, axis=1).reshape(-1)

    return expand


def kv_channel_mean(x_o_mean, num_heads: int, num_kv_heads: int, head_dim: int):
    """mean |x| of o_proj's inputs [H * D] averaged over the query heads of each KV head."""
    group = num_heads // num_kv_heads
    return x_o_mean.reshape(num_kv_heads, group, head_dim).mean(axis=1).reshape(-1)


def apply_scales(layer, cfg, scales: dict) -> None:
    """Folds AWQ scales into a decoder layer in place; the float layer computes the same function.

    scales: any of "qkv" [hidden], "vo" [KVH * D], "mlp" [hidden], "down" [intermediate].
    """
    mods = linear_modules(layer)

    def scale_rows(name, s):
        w = mods[name].kernel.get_value()
        mods[name].kernel.set_value((w * s[:, None].astype(w.dtype)))

    def divide_columns(name, s):
        w = mods[name].kernel.get_value()
        mods[name].kernel.set_value(w / s[None, :].astype(w.dtype))
        if mods[name].bias is not None:
            mods[name].bias.set_value(mods[name].bias.get_value() / s.astype(w.dtype))

    def divide_norm(norm, s):
        norm.weight.set_value(norm.weight.get_value() / s.astype(norm.weight.get_value().dtype))

    if "qkv" in scales:
        divide_norm(layer.input_layernorm, scales["qkv"])
        for name in ("q_proj", "k_proj", "v_proj"):
            scale_rows(name, scales["qkv"])
    if "vo" in scales:
        divide_columns("v_proj", scales["vo"])
        expand = kv_channel_scale_expander(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        scale_rows("o_proj", expand(scales["vo"]))
    if "mlp" in scales:
        divide_norm(layer.pre_feedforward_layernorm if cfg.sandwich_norms  # Gemma's MLP input
                    else layer.post_attention_layernorm, scales["mlp"])
        for name in ("gate_proj", "up_proj"):
            scale_rows(name, scales["mlp"])
    if "down" in scales:
        divide_columns("up_proj", scales["down"])
        scale_rows("down_proj", scales["down"])


def awq_layer(runner: LayerwiseRunner, index: int, x, bits: int, group_size: int | None,
              symmetric: bool, search_seqs: int = 8, clip_tokens: int = 2048) -> dict:
    """Searches and applies AWQ scales and clipping to decoder layer `index` (in float).

    x: the layer's calibration inputs [N, hidden]. The block-output searches use the first
    `search_seqs` calibration rows; the clipping search `clip_tokens` evenly spaced tokens.
    Returns the chosen alphas by pair (for logging).
    """
    cfg = runner.cfg
    layer = runner.model.layers[index]
    mods = linear_modules(layer)
    kernels = {n: m.kernel.get_value().astype(jnp.float32) for n, m in mods.items()}
    search_seqs = min(search_seqs, runner.num_seqs)
    n_search = search_seqs * runner.seq_len
    _, rec = runner.run_layer(index, x, record=("q_proj", "o_proj", "gate_proj", "down_proj"))
    gs = {n: resolve_group_size(group_size, w.shape[0]) for n, w in kernels.items()}
    qargs = lambda name: (bits, gs[name], symmetric)  # noqa: E731
    mean_abs = {n: jnp.mean(jnp.abs(r.astype(jnp.float32)), axis=0) for n, r in rec.items()}
    scales, alphas = {}, {}

    # input_layernorm -> q, k, v: the attention block's output.
    x_attn = rec["q_proj"][:n_search]
    reference = runner.run_attention(index, x_attn, search_seqs).astype(jnp.float32)

    def attention_block(fake):
        with substituted_kernels(mods, fake):
            return runner.run_attention(index, x_attn, search_seqs)

    qkv = {n: kernels[n] for n in ("q_proj", "k_proj", "v_proj")}
    scales["qkv"], alphas["qkv"], _ = search_scale(
        mean_abs["q_proj"], qkv, attention_block, reference, *qargs("q_proj"))

    # v_proj -> o_proj: o_proj's output, one scale per KV channel.
    x_o = rec["o_proj"][:n_search].astype(jnp.float32)
    expand = kv_channel_scale_expander(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    scales["vo"], alphas["vo"], _ = search_scale(
        kv_channel_mean(mean_abs["o_proj"], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        {"o_proj": kernels["o_proj"]}, lambda fake: x_o @ fake["o_proj"],
        x_o @ kernels["o_proj"], *qargs("o_proj"), expand=expand)

    # post_attention_layernorm -> gate, up: the MLP's output.
    x_mlp = rec["gate_proj"][:n_search]
    run_mlp = nnx.jit(lambda mlp, x: mlp(x))
    reference = run_mlp(layer.mlp, x_mlp).astype(jnp.float32)

    def mlp_block(fake):
        with substituted_kernels(mods, fake):
            return run_mlp(layer.mlp, x_mlp)

    gate_up = {n: kernels[n] for n in ("gate_proj", "up_proj")}
    scales["mlp"], alphas["mlp"], _ = search_scale(
        mean_abs["gate_proj"], gate_up, mlp_block, reference, *qargs("gate_proj"))

    # up_proj -> down_proj: down_proj's output.
    x_down = rec["down_proj"][:n_search].astype(jnp.float32)
    scales["down"], alphas["down"], _ = search_scale(
        mean_abs["down_proj"], {"down_proj": kernels["down_proj"]},
        lambda fake: x_down @ fake["down_proj"], x_down @ kernels["down_proj"],
        *qargs("down_proj"))

    apply_scales(layer, cfg, scales)

    # Clipping, on the scaled weights with their (now scaled) inputs.
    stride = max(1, rec["q_proj"].shape[0] // clip_tokens)
    inputs = {"v_proj": rec["q_proj"] / scales["qkv"], "o_proj": rec["o_proj"] / expand(
        scales["vo"]), "gate_proj": rec["gate_proj"] / scales["mlp"],
        "down_proj": rec["down_proj"] / scales["down"]}
    inputs["up_proj"] = inputs["gate_proj"]
    for name, x_in in inputs.items():
        w = mods[name].kernel.get_value()
        ratios = search_clip(w, x_in[::stride], *qargs(name))
        mods[name].kernel.set_value(clip_weights(w, ratios, gs[name]).astype(w.dtype))
    return alphas
