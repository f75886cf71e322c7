"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): router, top-k, grouped expert products,
weighted combine; on a mesh with its experts split over the `expert` axis.

One token's MLP output is sum_j w_j * down_e(act(gate_e(x)) * up_e(x)) over the k experts e_j
of highest router probability (softmax of x @ router over all experts, in float32), w_j those
probabilities, divided by their sum when ModelConfig.norm_topk_prob (Mixtral always,
Qwen3-MoE by its config): the same as HF transformers' routers.

Top-k ties: `jax.lax.top_k` keeps the lower expert index first among equal probabilities.
torch.topk (what transformers' routers call) picks among exact ties by its partial sort, which
no index rule reproduces; the chosen experts agree wherever a tie does not straddle the k-th
place (tests/models/test_moe.py, against torch's choices recorded by make_golden.py). The
router is ops/moe_router.py's: given the layer's RMSNorm (`norm`), a GPU's decode rows run the
norm, the router's logits and the top-k in one kernel.

Dropless: every one of the N * k (token, expert) pairs is computed, with no capacity. Steps of
at most E pairs (decode) keep the pairs in token order and gather each pair's expert; larger
steps sort the pairs by expert and the grouped products take each expert's run of rows: on a
GPU up to ops.expert_gemm.MAX_ROWS pairs (batched decode and prefill) the grouped kernel of
ops/expert_gemm.py, else ops/moe_matmul.py's tiles or jax.lax.ragged_dot. Weights per expert
are [in, out] like Linear's: gate_proj and up_proj [E, hidden, I], down_proj [E, I, hidden]
(on one GPU fused into gate_up_proj [E, hidden, 2 I]: one product, one kernel); float, or the
expert-stacked QuantizedWeight of quant/ (arrays with a leading expert axis, read by field).

On a mesh (kernels.mesh has the `expert` axis) the layer runs per shard under shard_map:
    expert  each shard holds E / ep experts; every shard sees all of its data shard's tokens
    model   each expert's I columns (gate/up) and rows (down) split over tp when tp divides I
    data    each data shard its own tokens
and tokens reach their experts in one of two ways (`dispatch_mode`, by the step's tokens):
    all_gather  every expert shard computes its own experts' pairs of all tokens, and one
                psum over (expert, model) combines them: no token moves before the products
    all_to_all  each expert shard takes 1/ep of the tokens, sends each pair to the shard of its
                expert (all_to_all, dropless: room for every pair), and receives the products
                back; the tokens are then all-gathered over `expert`
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs.mesh import DATA, EXPERT, MODEL
from configs.model import ModelConfig
from ops.expert_gemm import grouped_rows_coded_matmul, grouped_rows_matmul
from ops.expert_gemm import kernel_runs as grouped_kernel_runs
from ops.expert_gemv import (MAX_ROWS_PER_EXPERT, expert_rows_coded_matmul, expert_rows_matmul,
                             kernel_runs)
from ops.kernel_choice import KernelBackends, or_reference
from ops.moe_matmul import (SEARCH, GatedRows, IndexedRows, as_partials,
                            grouped_coded_matmul, grouped_matmul, input_rows, product_form)
from ops.moe_router import route, route_rows
from ops.rms_norm import rms_norm

# Steps of more tokens per data shard than this dispatch by all-to-all; the rest (decode
# batches) by all-gather. One place: `dispatch_mode`.
ALL_TO_ALL_MIN_TOKENS = 1024
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# after models.llama.fuse_projections (one device): gate and up as one [E, hidden, 2 I] product
FUSED_PROJECTIONS = ("gate_up_proj", "down_proj")
# record_routing's list while it is active, else None
_routing_records: list | None = None


@contextlib.contextmanager
def record_routing():
    """Yields a list that receives, while active, each sorted step's group sizes (numpy int32
    [E], the pairs per expert) from every mixture layer, in call order: how evenly a step
    spreads its pairs over the experts. A host callback joins the programs traced inside, so
    wrap a program's first call (a cached program records nothing)."""
    global _routing_records
    previous, records = _routing_records, []
    _routing_records = records
    try:
        yield records
    finally:
        _routing_records = previous


class ExpertLinear(nnx.Module):
    """The stacked [E, in, out] kernels of one projection of every expert (float, or codes);
    `kernel` given: that one (fused projections), no initializer."""

    def __init__(self, num_experts: int, din: int, dout: int, rngs: nnx.Rngs | None, dtype,
                 kernel=None):
        if kernel is None:
            init = nnx.initializers.normal(stddev=0.02)
            kernel = init(rngs.params(), (num_experts, din, dout), dtype)
        self.kernel = nnx.Param(kernel)


def expert_projections(mlp: "SparseMoE") -> tuple[str, ...]:
    """The names of a mixture's expert products: PROJECTIONS, or FUSED_PROJECTIONS once fused."""
    return FUSED_PROJECTIONS if hasattr(mlp, "gate_up_proj") else PROJECTIONS


class Router(nnx.Module):
    """The router's kernel [hidden, E]: x @ kernel are the experts' logits."""

    def __init__(self, din: int, num_experts: int, rngs: nnx.Rngs, dtype):
        init = nnx.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (din, num_experts), dtype))


class SparseMoE(nnx.Module):
    """A layer's MLP as a mixture of experts; call it as MLP is called: x [N, hidden] ->
    [N, hidden]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.hidden_act = cfg.hidden_act
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Router(h, e, rngs, dtype)
        self.gate_proj = ExpertLinear(e, h, i, rngs, dtype)
        self.up_proj = ExpertLinear(e, h, i, rngs, dtype)
        self.down_proj = ExpertLinear(e, i, h, rngs, dtype)

    def __call__(self, x: jax.Array, kernels: KernelBackends | None = None,
                 norm: tuple[jax.Array, float] | None = None) -> jax.Array:
        """x [N, hidden] -> [N, hidden]. norm: (weight [hidden], eps) of the RMSNorm before the
        MLP, applied here to x (on a GPU's decode rows in one kernel with the router,
        ops/moe_router.py), or None when x is normed already."""
        weights = {n: getattr(self, n).kernel.get_value() for n in expert_projections(self)}
        router = self.router.kernel.get_value()
        settings = dict(top_k=self.top_k, normalize=self.norm_topk_prob,
                        hidden_act=self.hidden_act)
        mesh = or_reference(kernels).mesh_shape
        if mesh:
            x = x if norm is None else rms_norm(x, *norm, kernels=kernels)
            return sharded_moe_mlp(mesh, x, router, weights, settings)
        return moe_mlp(x, router, weights, **settings, kernels=kernels, norm=norm).astype(
            x.dtype)


def expert_product(x, weight, group_sizes: jax.Array | None = None,
                   expert: jax.Array | None = None, kernels: KernelBackends | None = None,
                   partials: bool = False) -> jax.Array:
    """x [M, in] (or IndexedRows, GatedRows) times each row's expert of `weight` (a float
    array [E, in, out] or stacked codes: QuantizedWeight with a leading expert axis) ->
    [M, out], or with `partials` float32 [S, M, out] to be summed over S. Rows in any order
    with each row's `expert` [M] (no group_sizes): the one-row kernel of ops/expert_gemv.py
    where `kernels` choose it and it takes the operands, else the gathered form. Rows sorted
    by expert with `group_sizes` [E]: the grouped kernel of ops/expert_gemm.py where it runs,
    else the one-row kernel when `expert` is also given and it runs, else XLA's grouped
    products."""
    if getattr(weight, "perm", None) is not None:
        raise ValueError("MoE experts: act-order codes are not supported")
    if isinstance(weight, jax.Array):
        if group_sizes is not None and grouped_kernel_runs(x, weight, group_sizes, kernels):
            return grouped_rows_matmul(x, weight, group_sizes, kernels=kernels,
                                       partials=partials)
        if expert is not None and (group_sizes is None
                                   or kernel_runs(x, weight, expert, kernels)):
            return expert_rows_matmul(x, weight, expert, kernels=kernels, partials=partials)
        y = grouped_matmul(input_rows(x), weight, group_sizes)
        return as_partials(y, partials)
    codes = (weight.packed, weight.scales, weight.offsets)
    coded = dict(bits=weight.bits, group_size=weight.group_size, kernels=kernels,
                 partials=partials)
    if group_sizes is not None and grouped_kernel_runs(
            x, weight.packed, group_sizes, kernels, weight.scales, weight.offsets,
            weight.group_size):
        return grouped_rows_coded_matmul(x, *codes, group_sizes, **coded)
    if expert is not None and (group_sizes is None or kernel_runs(
            x, weight.packed, expert, kernels, weight.scales, weight.offsets,
            weight.group_size)):
        return expert_rows_coded_matmul(x, *codes, expert, **coded)
    y = grouped_coded_matmul(input_rows(x), *codes, group_sizes, bits=weight.bits,
                             group_size=weight.group_size)
    return as_partials(y, partials)


def experts_mlp(xs, weights: dict, hidden_act: str,
                kernels: KernelBackends | None = None, **rows) -> jax.Array:
    """down(act(gate(xs)) * up(xs)) of rows [M, hidden] (or IndexedRows: each pair's token,
    read in place where the kernel runs) as float32 partials [S, M, hidden] (their sum over S
    is the output); rows: group_sizes= (sorted rows, with expert= too where the kernel may take
    them) or expert= (each row's expert), as expert_product takes them.
    Fused weights (a "gate_up_proj" [E, hidden, 2 I]) take gate and up in one product, one
    read of each row's x and one kernel. The gate-up partials go to the down product as
    GatedRows: where the kernel runs, it sums and activates them as it loads them."""
    if "gate_up_proj" in weights:
        gate_up = expert_product(xs, weights["gate_up_proj"], kernels=kernels, partials=True,
                                 **rows)  # [S, M, 2 I]
    else:
        gate = expert_product(xs, weights["gate_proj"], kernels=kernels, partials=True, **rows)
        up = expert_product(xs, weights["up_proj"], kernels=kernels, partials=True, **rows)
        gate_up = jnp.concatenate([jnp.sum(gate, 0), jnp.sum(up, 0)], axis=-1)[None]
    return expert_product(GatedRows(gate_up, hidden_act, xs.dtype), weights["down_proj"],
                          kernels=kernels, partials=True, **rows)


def sorted_pairs(experts: jax.Array, num_groups: int, first: int | jax.Array = 0):
    """The (token, expert) pairs of experts [N, k] sorted by expert, keeping only experts
    [first, first + num_groups): (order [N*k]: flat pair index of each sorted row, kept
    [N*k]: whether that row's expert is kept (the others sort last), group_sizes [groups])."""
    local = experts.reshape(-1) - first  # [N*k]
    kept = (local >= 0) & (local < num_groups)
    key = jnp.where(kept, local, num_groups)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_groups + 1,), jnp.int32).at[key].add(1)[:num_groups]
    return order, kept[order], group_sizes


def combine(y: jax.Array, order: jax.Array, kept: jax.Array, weights: jax.Array,
            num_tokens: int, top_k: int) -> jax.Array:
    """sum over each token's pairs of weight * row: y float32 partials [S, N*k, hidden] of
    sorted rows -> float32 [N, hidden] (rows not kept count zero). The rows go back to pair
    order by a gather, and each token's k rows are summed in a fixed order (no scatter-add:
    the same sums on every run)."""
    pairs = order.shape[0]
    where = jnp.zeros_like(order).at[order].set(jnp.arange(pairs, dtype=order.dtype))
    return token_sums(y[:, where], kept[where], weights, num_tokens, top_k)


def token_sums(y: jax.Array, kept: jax.Array, weights: jax.Array, num_tokens: int,
               top_k: int) -> jax.Array:
    """sum over each token's k rows of weight * row: y float32 partials [S, N*k, hidden] in
    pair order, kept [N*k], weights [N, k] -> float32 [N, hidden] (rows not kept count zero),
    in a fixed order; one reduction over the partials and the k rows together."""
    w = jnp.where(kept, weights.reshape(-1), 0.0)  # [N*k]
    rows = jnp.where(kept[None, :, None], y.astype(jnp.float32), 0.0) * w[None, :, None]
    return jnp.sum(rows.reshape(y.shape[0], num_tokens, top_k, -1), axis=(0, 2))


def moe_mlp(x: jax.Array, router: jax.Array, weights: dict, *, top_k: int, normalize: bool,
            hidden_act: str, first_expert: int | jax.Array = 0,
            kernels: KernelBackends | None = None,
            norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """The MoE MLP of x [N, hidden] over the experts `weights` holds (all of them, or on an
    expert shard those from first_expert on): float32 [N, hidden], the shard's part. norm:
    (weight, eps) of an RMSNorm applied to x first, with the router (ops.moe_router.route_rows).

    Steps whose N * k pairs take the gathered product (ops.moe_matmul.product_form: decode)
    keep the pairs in token order, each with its expert: no sort, and the combine is a sum over
    each token's k rows; their products take the kernel of ops/expert_gemv.py where `kernels`
    choose it. Larger steps sort the pairs by expert first and take the grouped kernel of
    ops/expert_gemm.py where it runs (up to MAX_ROWS_PER_EXPERT pairs per expert, the one-row
    kernel where only it does)."""
    n = x.shape[0]
    if norm is None:
        probs, experts = route(jnp.dot(x, router.astype(x.dtype)), top_k, normalize)
    else:
        x, probs, experts = route_rows(x, *norm, router, top_k=top_k, normalize=normalize,
                                       kernels=kernels)
    num_groups = jax.tree.leaves(weights["down_proj"])[0].shape[0]
    # Sorting a decode step's pairs for the grouped kernel, which reads a shared expert once,
    # measured slower end to end: qwen3-30b-a3b INT4 batch 16 (128 pairs) took 19.7 ms a step
    # sorted against 13.6 ms in token order (H100, 2026-12-06).
    if product_form(n * top_k, num_groups) == "gathered":
        local = experts.reshape(-1) - first_expert  # [N*k] in pair order
        kept = (local >= 0) & (local < num_groups)
        every_expert = (isinstance(first_expert, int) and first_expert == 0
                        and num_groups == router.shape[1])  # ids in range: no clip
        tokens = jnp.arange(n * top_k, dtype=jnp.int32) // top_k  # [N*k] each pair's token
        y = experts_mlp(IndexedRows(x, tokens), weights, hidden_act, kernels,
                        expert=local if every_expert else jnp.clip(local, 0, num_groups - 1))
        return token_sums(y, kept, probs, n, top_k)
    order, kept, group_sizes = sorted_pairs(experts, num_groups, first_expert)
    if _routing_records is not None:
        jax.debug.callback(lambda sizes, out=_routing_records: out.append(np.asarray(sizes)),
                           group_sizes, ordered=True)
    sorted_expert = None  # each sorted row's expert, for the kernel
    if n * top_k <= MAX_ROWS_PER_EXPERT * num_groups:
        sorted_expert = jnp.clip(experts.reshape(-1)[order] - first_expert, 0, num_groups - 1)
    y = experts_mlp(IndexedRows(x, order // top_k), weights, hidden_act, kernels,
                    group_sizes=group_sizes, expert=sorted_expert)
    return combine(y, order, kept, probs, n, top_k)


def dispatch_mode(tokens_per_shard: int) -> str:
    """How tokens reach their experts over the `expert` axis: "all_gather" for decode-sized
    steps, "all_to_all" above ALL_TO_ALL_MIN_TOKENS tokens per data shard."""
    return "all_to_all" if tokens_per_shard > ALL_TO_ALL_MIN_TOKENS else "all_gather"


def expert_partition_spec(name: str, shape: tuple[int, ...], mesh: dict[str, int]) -> P:
    """The partition spec of an array [E, ., .] of expert projection `name` (a float kernel, or
    the codes, scales or offsets of a quantized one): experts over `expert`, gate/up columns
    and down rows over `model`; an axis whose dimension does not divide stays whole."""
    if len(shape) != 3:
        return P()
    axes = (EXPERT, None, MODEL) if name in ("gate_proj", "up_proj") else (EXPERT, MODEL, None)
    return P(*(a if a is not None and mesh.get(a, 1) > 1 and shape[i] % mesh[a] == 0 else None
               for i, a in enumerate(axes)))


def check_expert_mesh(num_experts: int, mesh: dict[str, int]) -> None:
    """ValueError unless the experts split over `expert` (ep divides them)."""
    ep = mesh.get(EXPERT, 1)
    if num_experts % ep:
        raise ValueError(f"MoE: {num_experts} experts do not split over ep={ep} (ep must "
                         "divide the number of experts)")


def sharded_moe_mlp(mesh: dict[str, int], x: jax.Array, router: jax.Array, weights: dict,
                    settings: dict) -> jax.Array:
    """moe_mlp per shard of the (data, expert, model) mesh (see the module docstring)."""
    ep, dp = mesh.get(EXPERT, 1), mesh.get(DATA, 1)
    num_experts = router.shape[1]
    check_expert_mesh(num_experts, mesh)
    specs = {name: jax.tree.map(lambda a, n=name: expert_partition_spec(n, a.shape, mesh), w)
             for name, w in weights.items()}
    down_spec = jax.tree.leaves(specs["down_proj"], is_leaf=lambda s: isinstance(s, P))[0]
    split_model = down_spec[1] == MODEL  # each model shard holds part of every expert's I
    local = num_experts // ep
    model_axes = (MODEL,) if split_model else ()
    mode = dispatch_mode(x.shape[0] // dp) if ep > 1 else "all_gather"

    def all_gather_form(x, router, weights):  # x [N_d, hidden]: the data shard's tokens
        first = jax.lax.axis_index(EXPERT) * local
        y = moe_mlp(x, router, weights, **settings, first_expert=first)
        return jax.lax.psum(y, (EXPERT,) + model_axes).astype(x.dtype)

    def all_to_all_form(x, router, weights):
        return all_to_all_moe(x, router, weights, settings, ep, local, model_axes)

    body = all_gather_form if mode == "all_gather" else all_to_all_form
    return jax.shard_map(body, check_vma=False,
                         in_specs=(P(DATA, None), P(), specs),
                         out_specs=P(DATA, None))(x, router, weights)


def all_to_all_moe(x: jax.Array, router: jax.Array, weights: dict, settings: dict, ep: int,
                   local: int, model_axes: tuple[str, ...]) -> jax.Array:
    """The MoE MLP of one data shard's tokens x [N, hidden] on an expert shard, the pairs sent
    to their experts' shards by all_to_all (see the module docstring); [N, hidden] in x's
    dtype, the same on every expert shard."""
    top_k = settings["top_k"]
    n, hidden = x.shape
    per = -(-n // ep)  # this shard's tokens: [rank * per, (rank + 1) * per), padded
    rank = jax.lax.axis_index(EXPERT)
    xp = jnp.pad(x, ((0, per * ep - n), (0, 0)))
    mine = jax.lax.dynamic_slice_in_dim(xp, rank * per, per)  # [per, hidden]
    probs, experts = route(jnp.dot(mine, router.astype(x.dtype)), top_k, settings["normalize"])
    pairs = per * top_k
    order = jnp.argsort(experts.reshape(-1), stable=True).astype(jnp.int32)  # by expert
    sorted_experts = experts.reshape(-1)[order]
    dest = sorted_experts // local  # [pairs] the shard of each sorted pair's expert
    start = jnp.searchsorted(dest, jnp.arange(ep, dtype=jnp.int32), side="left",
                             method=SEARCH)  # [ep]
    slot = jnp.arange(pairs, dtype=jnp.int32) - start[dest]  # place in its shard's block
    # room for every pair in every block: dropless whatever the routing
    send_x = jnp.zeros((ep, pairs, hidden), x.dtype).at[dest, slot].set(mine[order // top_k])
    send_e = jnp.full((ep, pairs), local, jnp.int32).at[dest, slot].set(
        sorted_experts - dest * local)
    recv_x = jax.lax.all_to_all(send_x, EXPERT, 0, 0, tiled=False)  # [ep (source), pairs, h]
    recv_e = jax.lax.all_to_all(send_e, EXPERT, 0, 0, tiled=False)
    rows_e = recv_e.reshape(-1)  # [ep * pairs] local expert, or `local` for an empty slot
    r_order, r_kept, group_sizes = sorted_pairs(rows_e[:, None], local)
    y = experts_mlp(recv_x.reshape(-1, hidden)[r_order], weights, settings["hidden_act"],
                    group_sizes=group_sizes)
    y = jnp.where(r_kept[:, None], jnp.sum(y, axis=0), 0).astype(x.dtype)  # sent as x's dtype
    back = jnp.zeros_like(y).at[r_order].set(y).reshape(ep, pairs, hidden)
    back = jax.lax.all_to_all(back, EXPERT, 0, 0, tiled=False)  # [ep (expert shard), pairs, h]
    y_pairs = back[dest, slot]  # [pairs, hidden] in sorted order
    out = combine(y_pairs[None], order, jnp.ones((pairs,), bool), probs, per, top_k)
    if model_axes:
        out = jax.lax.psum(out, model_axes)
    out = jax.lax.all_gather(out.astype(x.dtype), EXPERT, tiled=True)  # [ep * per, hidden]
    return out[:n]
