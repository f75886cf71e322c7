"""The parts of the decode benchmark: models, caches, step batches, timers, floors.

Everything here runs the engine's own pieces: random weights of a preset's real shapes built on
the device (models.weights.random_model), the ModelRunner's jitted step (engine/runner.py) over a
paged KV cache whose pages hold random values, and step batches from engine.runner's
make_step_batch. Nothing here asserts a speed.

Words used below:
    context   the tokens a decode step attends to: the KV length after the step's own write
    bytes     what one decode step must read: every weight it multiplies by (the token embedding
              only for the rows it gathers, unless it doubles as the output head; of a mixture
              of experts only the experts the step's tokens touch, `touched_experts`) plus the
              K and V of every sequence's context
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.mesh import MODEL
from configs.model import ModelConfig
from models.kv_cache import kv_bytes_per_token
from ops.kv_quant import kv_cache_dtype
from engine.memory import device_memory, size
from engine.device_arrays import fetch_samples
from engine.runner import ModelRunner, model_dtype
from engine.step_batch import StepBatch, make_step_batch
from engine.sampling import SamplingArrays
from engine.sharded_runner import ShardedModelRunner
from models.sharding import tree_shardings
from models import weights
from models.llama import fuse_projections, transpose_for_gemv
from models.moe import expert_projections
from quant.model import QuantConfig, quantize_model, quantized_abstract_model
from scripts.bench.common import dispatch_hold, queued_seconds

QUANT_METHODS = {"none": None, "int8": "int8", "int4": "int4_rtn"}


# ---- model and cache ------------------------------------------------------------------------

def build_model(cfg: ModelConfig, dtype, seed: int, quant: str = "none", fused: bool = False,
                mesh=None, quant_lm_head: bool = False, gemv: bool = False):
    """(cfg, model): random weights of cfg's shapes made on the device (on the mesh's shards with
    a mesh), quantized with `quant` ('int8', 'int4': group 128; the untied output head too with
    `quant_lm_head`): on one device made as random codes (`random_weights`), on a mesh
    RTN-quantized on the device; then fused (models.llama.fuse_projections) when
    `fused`, and transposed for ops/gemv.py (models.llama.transpose_for_gemv) when `gemv`."""
    qcfg = (None if QUANT_METHODS[quant] is None else
            QuantConfig(QUANT_METHODS[quant], group_size=128, lm_head=quant_lm_head))
    if qcfg is not None and mesh is None:
        model = random_weights(cfg, seed, dtype, qcfg=qcfg)  # codes made as codes
    else:
        model = random_weights(cfg, seed, dtype, mesh)
        if qcfg is not None:
            quantize_model(cfg, model, qcfg, progress=False)
    if fused:
        if mesh is not None:
            raise ValueError("fused projections are for one device (no --tp)")
        cfg, model = fuse_projections(cfg, model)
    if gemv:
        cfg, model = transpose_for_gemv(cfg, model)
    return cfg, model


def random_weights(cfg: ModelConfig, seed: int, dtype, mesh=None,
                   qcfg: QuantConfig | None = None):
    """A model of cfg's shapes with normal(0, 0.02) weights (RMSNorm weights 1), made on the
    device by models.weights.random_like (on the mesh's shards by models/sharding.py's rules
    with a mesh), after checking that they fit. With `qcfg` (one device) the decoder linears
    are QuantizedWeights of random codes whose scales give the same spread, made as codes: a
    model whose float weights do not fit the device (qwen3-30b-a3b in bf16 on an 80 GB card)
    still runs quantized."""
    abstract_model = (quantized_abstract_model(cfg, qcfg, dtype) if qcfg is not None else
                      weights.abstract_model(cfg, dtype))
    state = nnx.state(abstract_model)
    shardings = None if mesh is None else jax.tree.leaves(tree_shardings(state, cfg, mesh))
    check_weights_fit(cfg, jax.tree.leaves(state), shardings, dtype)
    return weights.random_like(abstract_model, seed, shardings, qcfg.bits if qcfg else 16)


def check_weights_fit(cfg: ModelConfig, leaves: list, shardings: list | None, dtype) -> None:
    """ValueError, naming both sizes, when the weights' largest shard (per device) exceeds what
    the device has free (`check_free`)."""
    per_device = sum(
        int(np.prod(s.shard_shape(leaf.shape) if s is not None else leaf.shape))
        * jnp.dtype(leaf.dtype).itemsize
        for leaf, s in zip(leaves, shardings or [None] * len(leaves)))
    check_free(per_device, f"{cfg.name} in {jnp.dtype(dtype).name}: the weights take",
               "use a device with more memory, more devices (--tp / --ep) or "
               "XLA_CLIENT_MEM_FRACTION")


def check_free(per_device: int, what: str, advice: str) -> None:
    """ValueError '<what> N per device, more than the F free of T: <advice>' when per_device
    bytes exceed the device's free memory: said at once, rather than an allocator that waits
    for memory that never frees."""
    total, in_use = device_memory()
    if per_device > total - in_use:
        raise ValueError(f"{what} {size(per_device)} per device, more than the "
                         f"{size(total - in_use)} free of {size(total)}: {advice}")


def make_runner(cfg: ModelConfig, model, max_batch: int, max_context: int, page_size: int,
                mesh=None, kv_dtype=None, kernels=None, max_pages: int | None = None
                ) -> ModelRunner:
    """A runner for up to max_batch sequences of up to max_context tokens whose cache holds
    max_pages pages (None: max_batch x max_context tokens' worth) plus the padding page;
    kv_dtype: the cache's (ops.kv_quant.kv_cache_dtype: None / 'auto', 'bf16', 'int8', 'fp8');
    kernels: the kernel choice (None: this device's, ops.backends.device_kernels)."""
    width = -(-max_context // page_size)
    num_pages = (max_batch * width if max_pages is None else max_pages) + 1
    # each device of a mesh holds its data shard's pages (num_pages), the KV heads split over tp
    check_cache_fits(cfg, kv_cache_dtype(kv_dtype, model_dtype(model)), num_pages * page_size,
                     1 if mesh is None else mesh.shape.get(MODEL, 1))
    if mesh is None:
        return ModelRunner(cfg, model, num_pages, page_size, kv_dtype, max_seqs=max_batch,
                           max_width=width, kernels=kernels)
    return ShardedModelRunner(cfg, model, num_pages, page_size, kv_dtype, max_seqs=max_batch,
                              max_width=width, mesh=mesh)


def check_cache_fits(cfg: ModelConfig, kv_dtype, tokens: int, heads_split: int = 1) -> None:
    """ValueError naming the sizes when a device's cache of `tokens` tokens of kv_dtype (its
    KV heads split `heads_split` ways) is larger than its free memory (`check_free`)."""
    check_free(tokens * kv_bytes_per_token(cfg, kv_dtype) // heads_split,
               f"{cfg.name}: a KV cache of {tokens} tokens in {jnp.dtype(kv_dtype).name} takes",
               "ask for fewer --batch x --context tokens, a quantized --kv_cache_dtype or a "
               "device with more memory")


FILL_CHUNK_ELEMENTS = 1 << 26  # values drawn per loop step of fill_cache_random


def _random_pages(pages: jax.Array, key: jax.Array, scales: bool = False) -> jax.Array:
    """normal(0, 1) values of pages' shape and dtype (with `scales`, an int8 / fp8 cache's
    float32 scales: 0.01 + 0.02 |normal|), drawn chunk by chunk of pages into the (donated)
    buffer, so the temporaries stay at one chunk's size however large the cache."""
    num_pages = pages.shape[0]
    page_elements = int(np.prod(pages.shape[1:]))
    chunk = max(1, min(num_pages, FILL_CHUNK_ELEMENTS // page_elements))

    def fill_chunk(i, acc):
        start = jnp.minimum(i * chunk, num_pages - chunk)  # the last chunk may overlap
        values = jax.random.normal(jax.random.fold_in(key, i), (chunk,) + pages.shape[1:],
                                   jnp.float32)
        if pages.dtype == jnp.int8:  # codes of an int8 cache: spread over its range
            values = jnp.clip(jnp.round(values * 32), -127, 127)
        if scales:
            values = 0.01 + 0.02 * jnp.abs(values)
        values = values.astype(pages.dtype)
        return jax.lax.dynamic_update_slice_in_dim(acc, values, start, axis=0)

    return jax.lax.fori_loop(0, -(-num_pages // chunk), fill_chunk, pages)


def _random_layer(stacked: jax.Array, key: jax.Array, layer: jax.Array,
                  num_layers: int, scales: bool = False) -> jax.Array:
    """A stacked page array (models/kv_cache.py, every layer's pages along axis 1) with layer
    `layer`'s pages drawn as `_random_pages` draws a per-layer array's (the same values)."""
    per_layer = stacked.shape[1] // num_layers
    values = _random_pages(jnp.zeros((stacked.shape[0], per_layer) + stacked.shape[2:],
                                     stacked.dtype), key, scales)
    return jax.lax.dynamic_update_slice_in_dim(stacked, values, layer * per_layer, axis=1)


def fill_cache_random(runner: ModelRunner, seed: int) -> None:
    """Overwrites every K and V page of the runner's cache with normal(0, 1) values, in place
    (one small jitted program, donated page array by page array, drawing a bounded chunk of
    pages at a time: no second copy of the cache, even at 70 GB). An int8 / fp8 cache gets
    random codes and random positive scales (every leaf then also lies as the step's outputs
    do, so the timed steps run the warm-up's program). Layer i gets the same values whether the
    cache is stacked (a scanned runner) or not."""
    cache = runner.cache
    num_layers = cache.num_layers
    keys = iter(jax.random.split(jax.random.key(seed), 4 * num_layers))

    def fill_arrays(arrays: tuple, scales: bool) -> tuple:
        sharding = arrays[0].sharding
        if cache.stacked_layers:
            fill = jax.jit(_random_layer, donate_argnums=0,
                           static_argnames=("num_layers", "scales"), out_shardings=sharding)
            stacked = arrays[0]
            for i in range(num_layers):
                stacked = fill(stacked, next(keys), i, num_layers=num_layers, scales=scales)
            return (stacked,)
        fill = jax.jit(_random_pages, donate_argnums=0, static_argnames="scales",
                       out_shardings=sharding)
        return tuple(fill(a, next(keys), scales=scales) for a in arrays)

    runner.cache = dataclasses.replace(
        cache, k_pages=fill_arrays(cache.k_pages, False), v_pages=fill_arrays(cache.v_pages, False),
        k_scales=fill_arrays(cache.k_scales, True) if cache.k_scales else (),
        v_scales=fill_arrays(cache.v_scales, True) if cache.v_scales else ())
    jax.block_until_ready(runner.cache)


def page_tables(num_seqs: int, pages_per_seq: int, seed: int) -> np.ndarray:
    """int32 [num_seqs, pages_per_seq]: distinct pages, shuffled as after a long serving run."""
    order = np.random.default_rng(seed).permutation(num_seqs * pages_per_seq)
    return order.reshape(num_seqs, pages_per_seq).astype(np.int32)


def decode_batch(tokens: np.ndarray, first_positions, tables: np.ndarray,
                 page_size: int) -> StepBatch:
    """One decode token per sequence: token b at position first_positions[b] (its K/V is written
    there; it attends to positions 0 .. first_positions[b])."""
    rows = [([int(t)], int(p), table) for t, p, table in zip(tokens, first_positions, tables)]
    return make_step_batch(rows, page_size)


def prefill_batch(tokens: np.ndarray, table: np.ndarray, page_size: int) -> StepBatch:
    """One sequence computing its first len(tokens) tokens (a prompt from an empty cache)."""
    return make_step_batch([(tokens.tolist(), 0, table)], page_size)


# ---- floors -----------------------------------------------------------------------------------

def array_nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def touched_experts(cfg: ModelConfig, tokens: int) -> float:
    """Experts per layer that `tokens` tokens touch, expected when each token picks its
    num_experts_per_tok experts uniformly (as random weights route): E (1 - (1 - k / E)^B)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


def weight_bytes_per_step(cfg: ModelConfig, model, batch: int) -> int:
    """Weight bytes a decode step of `batch` sequences reads (see the module docstring)."""
    total = array_nbytes(nnx.state(model))
    if not cfg.tie_word_embeddings:  # the embedding is only gathered: `batch` rows of it
        table = model.embed_tokens.embedding.get_value()
        row = table.shape[1] * jnp.dtype(table.dtype).itemsize
        total -= table.shape[0] * row - batch * row
    if cfg.is_moe:  # the experts no token of the step chose are not read
        idle = 1.0 - touched_experts(cfg, batch) / cfg.num_experts
        experts = sum(array_nbytes(getattr(layer.mlp, name).kernel.get_value())
                      for layer in model.layers for name in expert_projections(layer.mlp))
        total -= int(idle * experts)
    return total


def kv_bytes_per_step(cfg: ModelConfig, kv_dtype, batch: int, context: int) -> int:
    """K and V bytes a decode step reads: every sequence's whole context in every layer."""
    return batch * context * kv_bytes_per_token(cfg, kv_dtype)


def prefill_flops(cfg: ModelConfig, num_tokens: int) -> float:
    """FLOPs of one sequence's causal prefill of num_tokens (projections, attention, one row of
    the output head)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    if cfg.is_moe:  # each token's k experts and the router
        mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
    else:
        mlp = 3 * h * i
    proj = 2 * cfg.num_layers * (h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + mlp)
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 4 * cfg.num_layers * cfg.num_heads * d * pairs
    return proj * num_tokens + attention + 2 * h * cfg.vocab_size


# ---- timing -----------------------------------------------------------------------------------

def compile_count(runner: ModelRunner) -> int:
    """Programs the runner's jitted step holds (jax's own count, not the runner's bucket keys)."""
    size = getattr(runner._step, "_cache_size", None)
    return int(size()) if size is not None else -1


def time_queued(runner: ModelRunner, batch: StepBatch, steps: int, runs: int) -> dict:
    """Seconds per step with `steps` steps queued and one sync, as the engine issues them
    (ModelRunner.execute_padded: host padding and dispatch included), median of `runs`; and
    how long one step's dispatch keeps the host (dispatch_hold); and the first call's seconds,
    which compile the step's program unless an earlier batch of its bucket did."""
    start = time.perf_counter()
    jax.block_until_ready(runner.execute_padded(batch))  # compile and warm
    first_call = time.perf_counter() - start
    before = compile_count(runner)
    samples = queued_seconds(lambda: runner.execute_padded(batch), steps, runs,
                                    warm=False)
    hold = dispatch_hold(lambda: runner.execute_padded(batch), max(runs, 5))
    return {"step_s": statistics.median(samples), "step_s_min": min(samples),
            "step_s_max": max(samples), "dispatch_s": hold, "first_call_s": first_call,
            "compiles_during_timing": compile_count(runner) - before}


def time_multi_step(runner: ModelRunner, batch: StepBatch, num_steps: int, rounds: int,
                    runs: int) -> dict:
    """Multi-step rounds of a decode batch (ModelRunner.execute_multi_step, greedy): seconds
    per model step with `rounds` rounds queued and one sync (median of `runs`), and how long
    one round's dispatch keeps the host. The batch's block tables must have room for
    num_steps more tokens per sequence."""
    arrays = SamplingArrays.defaults(batch.num_seqs)

    def run():
        return runner.execute_multi_step(batch, arrays, num_steps)

    jax.block_until_ready(run())  # compile and warm
    samples = queued_seconds(run, rounds, runs, warm=False)
    return {"multi_step_s": statistics.median(samples) / num_steps,
            "multi_step_dispatch_s": dispatch_hold(run, runs), "multi_steps": num_steps}


def greedy_loop(runner: ModelRunner, tokens: np.ndarray, first_position: int,
                tables: np.ndarray, steps: int, margins: bool = False):
    """The engine's decode loop without a scheduler: each step builds its StepBatch on the host,
    runs the engine's program for a greedy batch (`execute_and_sample`: the step and its argmax)
    and takes the tokens back to the host before the next step (one sync per step). Returns
    (tokens [batch, steps], seconds per step, after a first untimed step); with `margins`, also
    each token's lead over the runner-up, top-1 minus top-2 logprob [batch, steps] (how near a
    tie the choice was: the steps then also return logprobs, so time them without)."""
    arrays = SamplingArrays.defaults(len(tokens))
    arrays.num_logprobs = 2 if margins else 0
    out, gaps, start = [], [], None
    for i in range(steps + 1):
        positions = np.full(len(tokens), first_position + i, np.int32)
        batch = decode_batch(tokens, positions, tables, runner.page_size)
        tokens, _, _, top = fetch_samples(runner.execute_and_sample(batch, arrays), len(tokens))
        if i == 0:
            start = time.perf_counter()
        else:
            out.append(tokens)
            if margins:
                gaps.append(top[:, 0] - top[:, 1])
    seconds = (time.perf_counter() - start) / steps
    if margins:
        return np.stack(out, axis=1), seconds, np.stack(gaps, axis=1)
    return np.stack(out, axis=1), seconds
