"""A mixture of experts' router: the post-attention RMSNorm, the router's logits, the top-k
experts and their weights; for a decode step's few rows, two Pallas Triton kernels.

Between the attention block and the expert products an MoE layer runs, for a few rows, a
handful of tiny XLA kernels: the norm (a reduction, then the scaling), the product
[N, hidden] @ [hidden, E], the top-k and the softmax of the chosen logits. Each reads almost
nothing and costs a kernel's start and drain, and in a CUDA graph a node to update. Two Pallas
kernels do it all here:
- the logits kernel, one program per (row, block of hidden): the row's RMS scale, that block of
  the normed row (the experts' input) and its partial logits [E] in float32. Spreading the
  router's bytes over many programs matters: one program per row streaming the whole router
  ran at about 2 GB/s (215 us a layer for qwen3-30b-a3b's 512 KiB on an H100);
- the top-k kernel, one program per row: the partial logits summed and rounded to the
  activations' dtype as XLA's product does, the k largest picked, the lower expert first among
  equal logits (jax.lax.top_k's rule), and their weights.

    route       (weights, experts) of router logits: the top-k of the logits, then a softmax
                over the k (normalized, the family's norm_topk_prob) or exp(logit - logsumexp)
                (softmax's order is the logits', so this is softmax-then-top-k)
    route_rows  (normed rows, weights, experts) of a step's rows: the kernels where
                KernelBackends.moe says so and `kernel_refusal` finds nothing, else
                ops.rms_norm's reference, the product and `route`
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention_tiles as tiles
from ops.kernel_choice import KernelBackends, choose_impl, or_reference
from ops.rms_norm import normed_row, rms_norm_reference

MAX_ROWS = 64  # rows (tokens) the kernel takes: a decode step's; prefill steps run XLA's
TILE_ELEMENTS = 8192  # router elements per logits program ([block_h, E] bf16: 16 KiB)


def route(logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [N, k], experts int32 [N, k]) of router logits [N, E]: the k highest
    softmax probabilities (ties: the lower expert first), divided by their sum if `normalize`.
    The top-k is taken of the logits (softmax keeps their order), so normalized weights are a
    softmax over k values and unnormalized ones exp(logit - logsumexp): no softmax over all E."""
    logits = logits.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, top_k)  # [N, k]
    if normalize:
        weights = jax.nn.softmax(top, axis=-1)
    else:
        weights = jnp.exp(top - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    return weights, experts.astype(jnp.int32)


def route_rows_reference(x, norm_weight, eps: float, router, top_k: int, normalize: bool):
    """The unfused ops: (normed rows [N, H] in x's dtype, weights float32 [N, k], experts
    int32 [N, k])."""
    normed = rms_norm_reference(x, norm_weight, eps)
    return (normed, *route(jnp.dot(normed, router.astype(x.dtype)), top_k, normalize))


def kernel_refusal(x, norm_weight, router, top_k: int) -> str | None:
    """Why the kernel cannot take these operands (None: it can): bf16 rows, norm weight and
    router; at most MAX_ROWS rows; hidden a multiple of 16; k <= E <= 1024. Raises ValueError
    for shapes that do not fit."""
    if (x.ndim != 2 or norm_weight.shape != x.shape[1:] or router.ndim != 2
            or router.shape[0] != x.shape[1] or not 0 < top_k <= router.shape[1]):
        raise ValueError(f"route_rows: x {x.shape}, norm weight {norm_weight.shape}, router "
                         f"{router.shape} and top_k={top_k} do not fit ([N, H], [H], [H, E], "
                         f"0 < k <= E)")
    if any(a.dtype != jnp.bfloat16 for a in (x, norm_weight, router)):
        return "route_rows: the kernel takes bf16 rows, norm weight and router"
    if x.shape[0] > MAX_ROWS or x.shape[1] % 16 or router.shape[1] > 1024:
        return (f"route_rows: the kernel takes at most {MAX_ROWS} rows, hidden a multiple of 16"
                f" and at most 1024 experts, not {x.shape} and {router.shape}")
    return None


def _logits_kernel(x_ref, nw_ref, r_ref, normed_ref, part_ref, *, hidden: int, width: int,
                   experts: int, e_width: int, block_h: int, eps: float):
    # x_ref: [H] this row; nw_ref, normed_ref: [BH] this program's block of hidden;
    # r_ref: [BH, E] the router's rows of that block; part_ref: [E] float32 partial logits
    dtype = normed_ref.dtype
    cols = jnp.arange(width, dtype=jnp.int32)  # the row, padded to a power of two
    ok = cols < hidden
    x = plgpu.load(x_ref.at[jnp.where(ok, cols, 0)], mask=ok, other=0).astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.sum(x * x) / hidden + eps)  # every block needs the whole row's
    rows = jnp.arange(block_h, dtype=jnp.int32)  # [BH]
    start = pl.program_id(1) * block_h
    xb = plgpu.load(x_ref.at[start + rows]).astype(jnp.float32)
    nb = normed_row(xb, scale, plgpu.load(nw_ref.at[rows]), dtype)  # [BH]
    plgpu.store(normed_ref.at[rows], nb.astype(dtype))
    e_cols = jnp.arange(e_width, dtype=jnp.int32)
    e_ok = e_cols < experts
    tile_ok = jnp.broadcast_to(e_ok[None, :], (block_h, e_width))
    rb = plgpu.load(r_ref.at[rows[:, None], jnp.where(e_ok, e_cols, 0)[None, :]],
                    mask=tile_ok, other=0)  # [BH, E']
    plgpu.store(part_ref.at[jnp.where(e_ok, e_cols, experts)],
                jnp.sum(nb[:, None] * rb.astype(jnp.float32), axis=0), mask=e_ok)


def _top_k_kernel(part_ref, w_ref, e_ref, *, splits: int, s_width: int, experts: int,
                  e_width: int, top_k: int, k_width: int, dtype, normalize: bool):
    # part_ref: [S, E] float32 this row's partial logits; w_ref [k] float32, e_ref [k] int32:
    # this row's weights and experts
    s_cols = jnp.arange(s_width, dtype=jnp.int32)
    e_cols = jnp.arange(e_width, dtype=jnp.int32)
    ok = (s_cols[:, None] < splits) & (e_cols[None, :] < experts)  # [S', E']
    parts = plgpu.load(part_ref.at[jnp.where(s_cols < splits, s_cols, 0)[:, None],
                                   jnp.where(e_cols < experts, e_cols, 0)[None, :]],
                       mask=ok, other=0)
    # XLA's bf16 product writes its logits in bf16: round them the same way
    logits = jnp.where(e_cols < experts,
                       jnp.sum(parts, axis=0).astype(dtype).astype(jnp.float32), -jnp.inf)
    slots = jnp.arange(k_width, dtype=jnp.int32)
    tops = jnp.full((k_width,), -jnp.inf, jnp.float32)
    chosen = jnp.zeros((k_width,), jnp.int32)
    rest = logits
    for j in range(top_k):  # the largest left, the lower expert among equals
        best = jnp.max(rest)
        expert = jnp.min(jnp.where(rest == best, e_cols, e_width))
        tops = jnp.where(slots == j, best, tops)
        chosen = jnp.where(slots == j, expert, chosen)
        rest = jnp.where(e_cols == expert, -jnp.inf, rest)
    if normalize:  # tops[0] is the largest
        exps = jnp.exp(tops - jnp.max(tops))
        weights = exps / jnp.sum(exps)
    else:
        top = jnp.max(logits)
        weights = jnp.exp(tops - (top + jnp.log(jnp.sum(jnp.exp(logits - top)))))
    k_ok = slots < top_k
    out = jnp.where(k_ok, slots, top_k)  # padding slots are written past the end (dropped)
    plgpu.store(w_ref.at[out], weights, mask=k_ok)
    plgpu.store(e_ref.at[out], chosen, mask=k_ok)


def hidden_block(hidden: int, experts: int) -> int:
    """Rows of hidden per program of the logits kernel: the largest power of two from 16 to
    128 that divides hidden with a [block, E] router tile of at most TILE_ELEMENTS."""
    e_width = max(16, tiles.next_pow2(experts))
    return next(b for b in (128, 64, 32, 16)
                if hidden % b == 0 and b * e_width <= TILE_ELEMENTS or b == 16)


@functools.partial(jax.jit, static_argnames=("eps", "top_k", "normalize", "interpret"))
def _route_rows_pallas(x, norm_weight, router, *, eps: float, top_k: int, normalize: bool,
                       interpret: bool):
    rows, hidden = x.shape
    experts = router.shape[1]
    e_width = max(16, tiles.next_pow2(experts))
    block_h = hidden_block(hidden, experts)
    splits = hidden // block_h
    logits_kernel = functools.partial(
        _logits_kernel, hidden=hidden, width=tiles.next_pow2(hidden), experts=experts,
        e_width=e_width, block_h=block_h, eps=eps)
    normed, partials = pl.pallas_call(  # [N, H], float32 [N, S, E]
        logits_kernel, grid=(rows, splits),
        in_specs=[pl.BlockSpec((None, hidden), lambda r, s: (r, 0)),
                  pl.BlockSpec((block_h,), lambda r, s: (s,)),
                  pl.BlockSpec((block_h, experts), lambda r, s: (s, 0))],
        out_specs=[pl.BlockSpec((None, block_h), lambda r, s: (r, s)),
                   pl.BlockSpec((None, None, experts), lambda r, s: (r, s, 0))],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((rows, splits, experts), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_router_logits",
    )(x, norm_weight, router)
    top_k_kernel = functools.partial(
        _top_k_kernel, splits=splits, s_width=tiles.next_pow2(splits), experts=experts,
        e_width=e_width, top_k=top_k, k_width=max(16, tiles.next_pow2(top_k)), dtype=x.dtype,
        normalize=normalize)
    row = lambda n: pl.BlockSpec((None, n), lambda r: (r, 0))  # noqa: E731
    weights, chosen = pl.pallas_call(
        top_k_kernel, grid=(rows,),
        in_specs=[pl.BlockSpec((None, splits, experts), lambda r: (r, 0, 0))],
        out_specs=[row(top_k), row(top_k)],
        out_shape=[jax.ShapeDtypeStruct((rows, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((rows, top_k), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_router_top_k",
    )(partials)
    return normed, weights, chosen


def route_rows(x, norm_weight, eps: float, router, *, top_k: int, normalize: bool,
               impl: str | None = None, kernels: KernelBackends | None = None):
    """(normed rows [N, H] in x's dtype, weights float32 [N, k], experts int32 [N, k]) of a
    step's rows x [N, H]: RMSNorm with norm_weight [H], the router's logits (router [H, E]),
    their top k (`route`). impl: None (kernels.moe where `kernel_refusal` finds nothing, the
    reference otherwise; kernels None: the reference), 'pallas', 'pallas_interpret' (CPU
    tests) or 'reference'."""
    refusal = kernel_refusal(x, norm_weight, router, top_k)
    if impl is None:
        impl = "reference" if refusal else or_reference(kernels).moe
    impl = choose_impl("route_rows", impl, "reference")
    if impl == "reference" or x.shape[0] == 0:
        return route_rows_reference(x, norm_weight, eps, router, top_k, normalize)
    if refusal:
        raise ValueError(refusal)
    return _route_rows_pallas(x, norm_weight, router, eps=float(eps), top_k=top_k,
                              normalize=normalize, interpret=tiles.interpret_or_gpu(impl))
