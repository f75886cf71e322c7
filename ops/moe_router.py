"""A mixture of experts' router: the post-attention RMSNorm, the router's logits, the top-k
experts and their weights; for a decode step's few rows, one Pallas Triton kernel.

Between the attention block and the expert products an MoE layer runs, for a few rows, a
handful of tiny XLA kernels: the norm (a reduction, then the scaling), the product
[N, hidden] @ [hidden, E], the top-k and the softmax of the chosen logits. Each reads almost
nothing and costs a kernel's start and drain, and in a CUDA graph a node to update. The kernel
here does it all in one program per row: it loads the row, computes its RMS scale and writes the
normed row (the experts' input), accumulates the logits over blocks of `hidden` (each block of
the normed row recomputed from x, so nothing is held but the scale), rounds them to the
activations' dtype as XLA's product does, and picks the k largest, the lower expert first among
equal logits (jax.lax.top_k's rule), with their weights.

    route       (weights, experts) of router logits: the top-k of the logits, then a softmax
                over the k (normalized, the family's norm_topk_prob) or exp(logit - logsumexp)
                (softmax's order is the logits', so this is softmax-then-top-k)
    route_rows  (normed rows, weights, experts) of a step's rows: the kernel where
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
TILE_ELEMENTS = 8192  # router elements per loop step of the kernel ([block_h, E] bf16: 16 KiB)


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


def _router_kernel(x_ref, nw_ref, r_ref, normed_ref, w_ref, e_ref, *, hidden: int,
                   width: int, experts: int, e_width: int, top_k: int, k_width: int,
                   block_h: int, eps: float, normalize: bool):
    # x_ref, normed_ref: [H] this row; nw_ref: [H] the norm's weight; r_ref: [H, E] the router;
    # w_ref [k] float32, e_ref [k] int32: this row's weights and experts
    dtype = normed_ref.dtype
    cols = jnp.arange(width, dtype=jnp.int32)  # the row, padded to a power of two
    ok = cols < hidden
    safe = jnp.where(ok, cols, 0)
    x = plgpu.load(x_ref.at[safe], mask=ok, other=0).astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.sum(x * x) / hidden + eps)
    w = plgpu.load(nw_ref.at[safe], mask=ok, other=0)
    plgpu.store(normed_ref.at[jnp.where(ok, cols, hidden)],
                normed_row(x, scale, w, dtype).astype(dtype), mask=ok)

    e_cols = jnp.arange(e_width, dtype=jnp.int32)
    e_ok = e_cols < experts
    e_safe = jnp.where(e_ok, e_cols, 0)
    tile_ok = jnp.broadcast_to(e_ok[None, :], (block_h, e_width))

    def body(b, acc):  # acc [E'] float32: the logits over the first b blocks of hidden
        rows = b * block_h + jnp.arange(block_h, dtype=jnp.int32)  # [BH]
        xb = plgpu.load(x_ref.at[rows]).astype(jnp.float32)
        nb = normed_row(xb, scale, plgpu.load(nw_ref.at[rows]), dtype)
        rb = plgpu.load(r_ref.at[rows[:, None], e_safe[None, :]], mask=tile_ok, other=0)
        return acc + jnp.sum(nb[:, None] * rb.astype(jnp.float32), axis=0)

    logits = jax.lax.fori_loop(0, hidden // block_h, body, jnp.zeros((e_width,), jnp.float32))
    # XLA's bf16 product writes its logits in bf16: round them the same way
    logits = jnp.where(e_ok, logits.astype(dtype).astype(jnp.float32), -jnp.inf)
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


@functools.partial(jax.jit, static_argnames=("eps", "top_k", "normalize", "interpret"))
def _route_rows_pallas(x, norm_weight, router, *, eps: float, top_k: int, normalize: bool,
                       interpret: bool):
    rows, hidden = x.shape
    experts = router.shape[1]
    e_width = max(16, tiles.next_pow2(experts))
    block_h = next(b for b in (128, 64, 32, 16)
                   if hidden % b == 0 and b * e_width <= TILE_ELEMENTS or b == 16)
    kernel = functools.partial(
        _router_kernel, hidden=hidden, width=tiles.next_pow2(hidden), experts=experts,
        e_width=e_width, top_k=top_k, k_width=max(16, tiles.next_pow2(top_k)),
        block_h=block_h, eps=eps, normalize=normalize)
    row = lambda n: pl.BlockSpec((None, n), lambda r: (r, 0))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(rows,),
        in_specs=[row(hidden), pl.BlockSpec((hidden,), lambda r: (0,)),
                  pl.BlockSpec((hidden, experts), lambda r: (0, 0))],
        out_specs=[row(hidden), row(top_k), row(top_k)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((rows, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((rows, top_k), jnp.int32)],
        # one program streams the whole router: many warps and stages keep its loads in flight
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=3),
        interpret=interpret, name="moe_router",
    )(x, norm_weight, router)


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
