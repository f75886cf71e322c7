"""The model runner over a device mesh: tensor parallelism and data parallelism in one step.

Data parallelism is one scheduler over a data-sharded batch, not dp engine replicas:
  * one jitted SPMD program per step drives every device (one launch, one compile cache), and
    with several processes every process runs the same engine loop on the same inputs, so JAX's
    multi-controller runtime is the only communication layer: no request router between
    replicas, and multi-host data and tensor parallelism are the same code;
  * the host side stays the one engine loop; the only data-parallel piece on the host is the
    page pool (engine/sharded_pool.py), which keeps each sequence inside one data shard;
  * the price: the data shards step in lockstep (padded to the largest shard's bucket), and a
    prefix is cached per shard.

Layout of one step (engine.step_batch.StepBatch in, global page ids): the sequences are grouped by the
data shard of their pages; each group is padded to a common bucket (N tokens, S sequences, W
pages wide) with its slots, block tables and query offsets local to its shard, and the groups
are laid end to end along the `data` axis: tokens [dp * N], block tables [dp * S, W], query
starts [dp * (S + 1)], ... They travel as one int32 [dp, L] array (each shard's inputs packed by
engine/step_inputs.py, row d on shard d) and are sliced apart in the step. Under the mesh the
attention and KV write run per shard (ops/sharded_attention.py); everything else is ordinary
jnp partitioned by XLA from the weights' shardings (models/sharding.py). Logits come back
replicated, in the batch's sequence order.

The step takes and returns explicitly sharded arrays (in_shardings / out_shardings) and donates
the cache, as the single-device runner does. Multi-step and mixed rounds run over the same
layout: their sampling and penalty rows go to the shard rows on the host, and their tokens come
back in the batch's order, gathered inside the program.
"""
from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs.model import ModelConfig
from engine.block_pool import BlockPool
from configs.mesh import DATA, mesh_shape
from engine.device_arrays import abstract_arrays, start_copies
from engine.runner import ModelRunner, gather_rows, model_dtype, verification_indices
from engine.step_programs import decode_loop, draw_tokens, input_tokens
from engine.step_batch import (MIN_PAGE_BUCKET, MIN_TOKEN_BUCKET, StepBatch, bucket, bucket_key,
                               padding_batch, table_widths)
from engine.sampling import SamplingArrays, pack_sampling
from engine.sharded_pool import ShardedBlockPool
from engine.sharding import init_sharded_kv_cache, kv_local_config, replicated
from engine.step_inputs import StepLayout, pack, unpack
from models.llama import AttentionMetadata, forward
from models.sharding import attention_plan, put, shard_state
from ops.backends import device_kernels
from ops.kv_quant import kv_cache_dtype


class InBatchOrder:
    """Device tokens in a sharded step's row order, read on the host in the batch's order
    (`np.asarray` gives tokens[rows]); `fetch_samples` and `start_copies` take it like an
    array."""

    def __init__(self, tokens: jax.Array, rows: np.ndarray):
        self.tokens, self.rows = tokens, rows

    def copy_to_host_async(self) -> None:
        self.tokens.copy_to_host_async()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.asarray(self.tokens)[self.rows]
        return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass
class ShardedStep:
    """One step's device inputs laid out per data shard, and where the results go back."""

    key: tuple[int, int, int, int, int]  # (N, S, W, max_q_len, max_prefill_seqs) per shard
    packed: jax.Array  # int32 [dp, L]: each shard's inputs packed (engine/step_inputs.py)
    seq_rows: np.ndarray  # [num_seqs]: row of each sequence in the step's [dp * S] logits
    token_rows: np.ndarray  # [num_tokens]: row of each token in the step's [dp * N] tokens


def _largest_shard(q_lens: np.ndarray, groups: list) -> tuple[int, int, int]:
    """(tokens, sequences, prefilling sequences) of the data shards' largest part each: what
    a sharded step's bucket must hold. q_lens [S_batch]; groups: each shard's sequences."""
    return (max(int(q_lens[g].sum()) for g in groups), max(len(g) for g in groups),
            max(int((q_lens[g] > 1).sum()) for g in groups))


class ShardedModelRunner(ModelRunner):
    """ModelRunner whose weights, cache and step are laid out over a (data, model) mesh.

    num_pages counts the pages of one data shard (the cache holds dp times as many). Its steps
    read their input tokens from the host or, with asynchronous scheduling, from the previous
    step's sampled tokens on the device (either the step's own argmax, in its shard row order,
    or the sampler's tokens, in batch order: `_previous_tokens` maps the engine's batch rows).
    """

    supports_async_scheduling = True

    def __init__(self, cfg: ModelConfig, model, num_pages: int, page_size: int, kv_dtype=None,
                 max_seqs: int = 1, max_width: int = 1, *, mesh, kernels=None):
        self.mesh = mesh
        self.tp, self.dp = mesh_shape(mesh)
        # as ModelRunner's, with the mesh: attention and the KV write run per shard
        self.kernels = (device_kernels(mesh_axes=tuple(mesh.shape.items())) if kernels is None
                        else kernels)
        self.model_cfg = cfg
        self.plan = attention_plan(cfg, self.tp)
        self.max_seqs, self.max_width = max_seqs, max_width
        self.min_width, self.prefill_width = table_widths(max_width, page_size,
                                                          self.kernels.platform)
        self.graphdef, state = nnx.split(model)
        self.state, self.cfg = shard_state(state, cfg, mesh)
        self.kv_dtype = kv_cache_dtype(kv_dtype, model_dtype(model))  # as ModelRunner's
        self.pages_per_shard = num_pages
        self.cache = init_sharded_kv_cache(self.cfg, num_pages, page_size, self.kv_dtype, mesh)
        self.page_size = page_size
        self.compiled_shapes: set[tuple] = set()
        self._per_shard = NamedSharding(mesh, P(DATA, None))  # [dp, ...]: row d on shard d
        self._replicated = replicated(mesh)
        # Weights as a flat tuple (jax flattens it in C++; an nnx.State through Python).
        self._weights, self._weights_def = jax.tree.flatten(self.state)
        self._weights = tuple(self._weights)
        # Sampled tokens come back padded to this many rows (replicated), so that a step can
        # read its input tokens from the previous step's without a new program per bucket.
        self.sample_rows = self.dp * bucket(max_seqs)
        self._no_samples = put(np.zeros(self.sample_rows, np.int32), self._replicated)
        self._penalty_counts = None  # replicated, made on first use (ModelRunner's)
        self._penalty_counts_made = threading.Lock()
        shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
        self._step = jax.jit(
            self._sharded_step, donate_argnums=(1,), static_argnums=(4, 5),
            in_shardings=(shardings(self._weights), shardings(self.cache), self._per_shard,
                          self._replicated),
            out_shardings=(self._replicated, self._replicated, shardings(self.cache)))
        self._take_rows = jax.jit(gather_rows, out_shardings=self._replicated)
        # Rounds (ModelRunner's, over the mesh): tokens, the last step's and the count table
        # replicated; they donate the cache and the count table (argument 6).
        rounds = dict(donate_argnums=(1, 6), static_argnames=("layout", "num_steps", "mode"),
                      out_shardings=(self._replicated, self._replicated, self._replicated,
                                     shardings(self.cache)))
        self._multi_step = jax.jit(self._sharded_multi_step, **rounds)
        self._mixed_round = jax.jit(self._sharded_mixed_round, **rounds)
        self.compiled_rounds: set[tuple] = set()  # as ModelRunner's

    def _forward(self, weights, cache, packed, prev_samples, layout: StepLayout,
                 all_logits: bool) -> tuple:
        """The model over packed int32 [dp, L] inputs (each shard's row packed by `pack` with
        the per-shard `layout`), laid end to end along the data axis: (logits, cache, the
        fields [dp * size] (block tables [dp * S, W]), the model). A token whose
        sample_index is >= 0 is prev_samples[sample_index] (int32 [sample_rows], replicated)
        instead of the host's id."""
        x = self._fields(packed, layout)
        tokens = input_tokens(x, prev_samples)
        model = self._model(weights)
        meta = AttentionMetadata(
            x["positions"], x["slot_mapping"], x["block_tables"], x["query_start_loc"],
            x["kv_lens"], max_q_len=layout.max_q_len, max_prefill_seqs=layout.max_prefill_seqs)
        logits, cache = forward(model, cache, tokens, meta, self.cfg,
                                None if all_logits else x["logits_indices"],
                                kernels=self.kernels)
        return logits, cache, x, model

    @staticmethod
    def _fields(packed, layout: StepLayout) -> dict:
        """The packed inputs' fields, each [dp, ...] with the shards end to end: [dp * size]
        (block tables [dp * S, W])."""
        return {name: a.reshape((-1,) + a.shape[2:]) for name, a in unpack(packed, layout).items()}

    def _model(self, weights):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))

    def _sharded_step(self, weights, cache, packed, prev_samples, layout: StepLayout,
                      all_logits: bool):
        """One step (`_forward`): (logits, their argmax int32 [max(rows, sample_rows)]
        zero-padded, cache), rows in the step's shard order."""
        logits, cache, _, _ = self._forward(weights, cache, packed, prev_samples, layout,
                                            all_logits)
        # XLA takes the argmax of the vocab-parallel logits per shard and gathers each shard's
        # (max, index) pair, [rows, tp]: tiny. (Asking for replicated logits first made it
        # gather the output weights instead.)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [rows]
        greedy = jnp.pad(greedy, (0, max(self.sample_rows - greedy.shape[0], 0)))
        return logits, greedy, cache

    def _sharded_multi_step(self, weights, cache, packed, floats, ints, prev_samples, counts,
                            penalty_rows, complete, order, layout: StepLayout, num_steps: int,
                            mode: str):
        """ModelRunner._multi_step_impl over the mesh: the rows (and floats, ints,
        penalty_rows) in the step's shard order [dp * S]; complete: None. Returns the tokens in
        the batch's order, int32 [num_steps, dp * S] (order [dp * S]: each batch row's shard
        row, the last one's repeated; the host reads the first S_batch), the last step's
        [sample_rows] zero-padded, the count table, cache."""
        x = self._fields(packed, layout)
        tokens, _, counts, cache = decode_loop(
            self._model(weights), self.cfg, self.kernels, self.page_size, self.sample_rows, cache,
            input_tokens(x, prev_samples), x["positions"], x["kv_lens"] > 0,
            x["block_tables"], floats, ints, counts, penalty_rows, num_steps, 0, mode, self.dp)
        return self._in_batch_order(tokens, order) + (counts, cache)

    def _sharded_mixed_round(self, weights, cache, packed, floats, ints, prev_samples, counts,
                             penalty_rows, complete, order, layout: StepLayout, num_steps: int,
                             mode: str):
        """ModelRunner._mixed_round_impl over the mesh, rows as in `_sharded_multi_step`;
        complete: int32 [dp * S], 1 where the row decodes on."""
        logits, cache, x, model = self._forward(weights, cache, packed, prev_samples, layout,
                                                False)
        first, counts = draw_tokens(logits, floats, ints, 0, mode, counts, penalty_rows)
        rest, _, counts, cache = decode_loop(
            model, self.cfg, self.kernels, self.page_size, self.sample_rows, cache, first,
            x["kv_lens"], complete > 0, x["block_tables"], floats, ints, counts, penalty_rows,
            num_steps - 1, 1, mode, self.dp)
        return self._in_batch_order(jnp.concatenate([first[None], rest]), order) + (counts,
                                                                                     cache)

    def _in_batch_order(self, tokens, order) -> tuple:
        """(tokens [steps, dp * S] in shard order -> the batch's order (`order`),
        the last step's zero-padded to sample_rows): what the engine reads, and what a next
        step's sample_index (batch rows) points into."""
        tokens = tokens[:, order]
        return tokens, jnp.pad(tokens[-1], (0, self.sample_rows - tokens.shape[1]))

    def warmup(self, q_lens, num_pages: int, verification: bool = False):
        """Compiles the program of a step whose sequences compute q_lens tokens each (and a
        verification step's gathers), ahead of time as ModelRunner.warmup does: lowered for the
        mesh from the shapes and shardings of the weights, the cache and a padding batch's
        packed inputs, not run. Returns the step (where `compiles_ahead` is off, runs it as
        ModelRunner.warmup does)."""
        if not self.compiles_ahead:
            return super().warmup(q_lens, num_pages, verification)
        dummy = padding_batch(q_lens, num_pages, verification)
        step = self._layout(dummy)
        args = abstract_arrays((self._weights, self.cache, step.packed, self._no_samples))
        with jax.set_mesh(self.mesh):
            compiled = self._step.lower(*args, StepLayout(*step.key), verification).compile()
        if verification:
            logits = compiled.out_info[0]
            self._take_rows.lower(self._replicated_shape(logits.shape, logits.dtype), *(
                self._replicated_shape(i.shape, i.dtype)
                for i in verification_indices(dummy.num_seqs, dummy.verify_len))).compile()
        return compiled

    def sampler_shapes(self) -> list[tuple[int, str]]:
        """ModelRunner's, and greedy for each row count: greedy rows that want logprobs take
        the sampler on a mesh (the step's own argmax is in shard order)."""
        shapes = super().sampler_shapes()
        return shapes + [(rows, "greedy") for rows, mode in shapes if mode == "plain"]

    # The samplers' inputs are replicated over the mesh (`sample_device` places them), which
    # lowering from host arrays would not reproduce: warm-up runs them.
    runs_samplers = True

    def warmup_sampler(self, rows: int, mode: str) -> None:
        """ModelRunner's (run: `runs_samplers`) and, with mode "plain", the gathers that put a
        step's logits rows in batch order for `rows` sequences (`_rows`), from each step logits
        row count that can hold them: lowered from replicated shapes, so no logits are
        allocated."""
        super().warmup_sampler(rows, mode)
        if mode != "plain":
            return
        placed = self._replicated_shape  # as the step's logits and `_rows`' rows
        for logits_rows in self.logits_row_counts():
            if logits_rows >= rows:
                self._take_rows.lower(placed((logits_rows, self.cfg.vocab_size), jnp.float32),
                                      placed((rows,), jnp.int32)).compile()

    def _replicated_shape(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def logits_row_counts(self) -> list[int]:
        """The row counts of a step's logits: dp shards of a power-of-two bucket of sequences
        (`bucket_key`), up to the bucket of max_seqs."""
        return [self.dp << i for i in range(bucket(self.max_seqs).bit_length())]

    # ---- layout ------------------------------------------------------------------------------

    def _shard_of_seqs(self, batch: StepBatch) -> np.ndarray:
        """Data shard of each sequence: that of its pages. Warm-up padding goes to the first
        shard, so that a padding batch of q_lens keys the program of every batch whose
        largest shard holds such q_lens (`padding_q_lens`): warm-up compiles each shard size
        up to max_seqs, however unevenly a run's sequences sit over the shards."""
        shard = batch.block_tables[:, 0] // self.pages_per_shard
        shard[batch.kv_lens == 0] = 0  # only warm-up batches have sequences without tokens
        return np.minimum(shard, self.dp - 1)

    def padding_q_lens(self, batch: StepBatch) -> list[int]:
        """The q_lens of a padding batch whose program runs `batch` (the same `step_key`): a
        decode step's largest shard's sequences; a step with prefill chunks keyed by its
        largest shard's tokens and prefilling sequences, as one prompt taking the tokens the
        other prefilling sequences' two each leave."""
        q_lens, _, groups, _ = self._grouped(batch)
        if q_lens.max(initial=1) <= 1 or batch.verify_len:
            return [int(q) for q in q_lens[max(groups, key=len)]]
        tokens, _, prefill = _largest_shard(q_lens, groups)
        return [tokens - 2 * (prefill - 1)] + [2] * (prefill - 1)

    def _bucket(self, q_lens, groups, width, batch: StepBatch) -> tuple[int, int, int, int, int]:
        """The single-device bucket of the largest shard, which fits every shard's part."""
        tokens, seqs, prefill = _largest_shard(q_lens, groups)
        max_q = int(q_lens.max(initial=1))
        max_seqs = max(self.max_seqs, batch.num_seqs)
        key = bucket_key(tokens, seqs, width, max_q, prefill, max_seqs,
                         max(self.prefill_width, width), batch.verify_len,
                         self.counts_prefill_seqs)
        n, s, w, q, p = key
        if n >= tokens and s >= seqs and w >= width and q >= max_q and p >= prefill:
            return key
        n = bucket(tokens, MIN_TOKEN_BUCKET)  # a safe bound if the bucket rules change
        return n, bucket(max_seqs), bucket(width, MIN_PAGE_BUCKET), n, bucket(prefill)

    def _grouped(self, batch: StepBatch) -> tuple:
        """(q_lens [S_batch], each sequence's data shard, the sequences of each shard, the
        step's bucket (`_bucket`))."""
        q_lens = np.diff(batch.query_start_loc)
        shard = self._shard_of_seqs(batch)  # [S_batch]
        groups = [np.flatnonzero(shard == d) for d in range(self.dp)]
        width = max(self.min_width, batch.block_tables.shape[1])
        return q_lens, shard, groups, self._bucket(q_lens, groups, width, batch)

    def step_key(self, batch: StepBatch) -> tuple[int, int, int, int, int]:
        """The per-shard bucket of the program that runs `batch` (`_bucket`)."""
        return self._grouped(batch)[3]

    def _layout(self, batch: StepBatch, sample_index: np.ndarray | None = None) -> ShardedStep:
        """The batch's sequences grouped by data shard (in batch order within a shard), each
        shard's inputs padded to one bucket, local to the shard's pages, packed as row d of an
        int32 [dp, L] array placed on the mesh (one transfer). Vectorized: no loop over
        sequences. sample_index [N_batch] (rows of the previous step's tokens, -1 for the
        host's ids) goes with each token to its place in the shards."""
        dp, pages, page_size = self.dp, self.pages_per_shard, self.page_size
        num_seqs, num_tokens = batch.num_seqs, len(batch.token_ids)
        q_lens, shard, groups, key = self._grouped(batch)
        n, s, w, _, _ = key
        # Each sequence's index j within its shard and first token t0 within its shard's tokens.
        j = np.zeros(num_seqs, np.int64)
        t0 = np.zeros(num_seqs, np.int64)
        for group in groups:
            j[group] = np.arange(len(group))
            t0[group] = np.cumsum(q_lens[group]) - q_lens[group]
        seq_of_token = np.repeat(np.arange(num_seqs), q_lens)  # [N_batch]
        d_tok = shard[seq_of_token]
        t_tok = t0[seq_of_token] + np.arange(num_tokens) - batch.query_start_loc[:-1][seq_of_token]
        offset = shard.astype(np.int64) * pages  # each sequence's first global page
        fields = {"tokens": np.zeros((dp, n), np.int32),
                  "positions": np.zeros((dp, n), np.int32),
                  "slot_mapping": np.full((dp, n), -1, np.int32),
                  "sample_index": np.full((dp, n), -1, np.int32)}
        fields["tokens"][d_tok, t_tok] = batch.token_ids
        fields["positions"][d_tok, t_tok] = batch.positions
        slot = batch.slot_mapping
        fields["slot_mapping"][d_tok, t_tok] = np.where(
            slot >= 0, slot - offset[seq_of_token] * page_size, -1)
        if sample_index is not None:
            fields["sample_index"][d_tok, t_tok] = sample_index
        tables = np.zeros((dp, s, w), np.int32)
        rows = batch.block_tables
        local = rows - offset[:, None]
        tables[shard, j, :rows.shape[1]] = np.where((local >= 0) & (local < pages), local, 0)
        fields["block_tables"] = tables.reshape(dp, s * w)
        q_by_slot = np.zeros((dp, s), np.int64)
        q_by_slot[shard, j] = q_lens
        starts = np.zeros((dp, s + 1), np.int64)
        np.cumsum(q_by_slot, axis=1, out=starts[:, 1:])
        fields["query_start_loc"] = starts
        fields["kv_lens"] = np.zeros((dp, s), np.int32)
        fields["kv_lens"][shard, j] = batch.kv_lens
        last = np.zeros((dp, s), np.int64)
        last[shard, j] = shard * n + t0 + q_lens - 1
        fields["logits_indices"] = np.maximum(last, 0)
        layout = StepLayout(*key)
        packed = np.stack([pack(layout, {f: a[d] for f, a in fields.items()})
                           for d in range(dp)])
        self.compiled_shapes.add(key)
        return ShardedStep(key, put(packed, self._per_shard), shard * s + j, d_tok * n + t_tok)

    def _run(self, step: ShardedStep, all_logits: bool,
             prev_samples: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(logits, greedy tokens) of the step, rows in shard order (see `_sharded_step`)."""
        prev = self._no_samples if prev_samples is None else prev_samples
        with jax.set_mesh(self.mesh):
            logits, tokens, self.cache = self._step(self._weights, self.cache, step.packed,
                                                    prev, StepLayout(*step.key), all_logits)
        return logits, tokens

    @staticmethod
    def _previous_tokens(prev_samples, sample_index: np.ndarray | None):
        """(device tokens, their row of each token's sample_index) of the previous step's
        results: the engine counts rows in its batch order, the step's own argmax
        (InBatchOrder) holds them in shard order, the sampler's tokens in batch order."""
        if sample_index is None or prev_samples is None:
            return None, None
        if isinstance(prev_samples, InBatchOrder):
            rows = prev_samples.rows[np.maximum(sample_index, 0)]
            return prev_samples.tokens, np.where(sample_index >= 0, rows, -1).astype(np.int32)
        return prev_samples, sample_index

    def _placed(self, host: np.ndarray) -> jax.Array:
        return put(host, self._replicated)  # as the step's logits

    def _rows(self, logits: jax.Array, rows: np.ndarray) -> jax.Array:
        """logits[rows] (rows: host ints), replicated: one program per (logits rows, len(rows)),
        compiled at warm-up (`warmup_sampler`)."""
        return self._take_rows(logits, put(rows.astype(np.int32), self._replicated))[0]

    # ---- rounds ------------------------------------------------------------------------------

    def _round_args(self, kind: str, batch: StepBatch, arrays: SamplingArrays, num_steps: int,
                    prev_samples, sample_index, complete: np.ndarray | None = None,
                    counts=None) -> tuple:
        """As ModelRunner._round_args, for `_sharded_multi_step` / `_sharded_mixed_round`: the
        batch laid out per shard (`_layout`), its sampling rows, penalties and `complete` moved
        to the step's shard rows (padding rows greedy, of no slot, not going on) and placed
        replicated, and `order`, the shard row of each batch row."""
        if arrays.num_logprobs:
            raise ValueError(f"a {kind.replace('_', '-')} round takes no logprobs")
        prev, index = self._previous_tokens(prev_samples, sample_index)
        step = self._layout(batch, index)
        key = (kind, step.key, num_steps, arrays.mode(), arrays.penalties is not None)
        self.compiled_shapes.add(key)
        num_seqs, rows = batch.num_seqs, self.dp * step.key[1]
        source = np.full(rows, num_seqs)  # the batch row of each shard row (num_seqs: padding)
        source[step.seq_rows] = np.arange(num_seqs)
        arrays = arrays.padded(num_seqs + 1).take(source)
        place = self._placed
        floats, ints = pack_sampling(arrays)
        penalty_rows = (None if arrays.penalties is None else
                        (place(arrays.penalties.packed()), place(arrays.penalties.strengths)))
        going_on = None
        if complete is not None:
            going_on = np.zeros(rows, np.int32)
            going_on[step.seq_rows] = complete
            going_on = place(going_on)
        order = step.seq_rows[np.minimum(np.arange(rows), num_seqs - 1)]  # one length a key
        return key, (self._weights, self.cache, step.packed, place(floats), place(ints),
                     self._no_samples if prev is None else prev,
                     None if penalty_rows is None else counts, penalty_rows, going_on,
                     place(order.astype(np.int32)), StepLayout(*step.key), num_steps, key[3])

    def _run_round(self, program, *args, **kwargs) -> tuple:
        """ModelRunner's, the program run under the mesh (only it: the count table's history
        writes before it run outside, as their warm-up compiled them)."""
        def on_mesh(*program_args):
            with jax.set_mesh(self.mesh):
                return program(*program_args)
        return super()._run_round(on_mesh, *args, **kwargs)

    def _warmup_round(self, *args, **kwargs):
        """ModelRunner's, under the mesh: lowered from the shapes and shardings of a padding
        batch's arguments."""
        with jax.set_mesh(self.mesh):
            return super()._warmup_round(*args, **kwargs)

    # ---- the ModelRunner interface -----------------------------------------------------------

    def execute(self, batch: StepBatch) -> jax.Array:
        """One step; each sequence's last-token logits, float32 [S, V], replicated."""
        return self.execute_padded(batch)[: batch.num_seqs]

    def execute_padded(self, batch: StepBatch, prev_samples=None,
                       sample_index: np.ndarray | None = None) -> jax.Array:
        """One step; the sequences' logits padded to [bucket(S), V] (padding rows repeat the
        last sequence's), replicated, in the batch's order. prev_samples / sample_index as in
        ModelRunner.execute_padded (prev_samples: the previous results' tokens)."""
        logits, _, rows = self._decode_step(batch, prev_samples, sample_index)
        return self._rows(logits, rows)

    def _decode_step(self, batch: StepBatch, prev_samples, sample_index) -> tuple:
        """(logits, greedy tokens, the step's row of each sequence padded to bucket(S) by
        repeating the last) of a step that samples each sequence's last token."""
        prev, index = self._previous_tokens(prev_samples, sample_index)
        step = self._layout(batch, index)
        logits, tokens = self._run(step, False, prev)
        s = batch.num_seqs
        return logits, tokens, step.seq_rows[np.minimum(np.arange(bucket(s)), s - 1)]

    def execute_and_sample(self, batch: StepBatch, arrays: SamplingArrays,
                           prev_samples=None, sample_index=None) -> tuple:
        """As ModelRunner.execute_and_sample. An all-greedy batch without penalties or
        logprobs takes the step's own argmax (one program; the host reads the tokens in batch
        order); otherwise the sampler runs on the step's logits as a second program."""
        logits, tokens, rows = self._decode_step(batch, prev_samples, sample_index)
        if (arrays.penalties is None and not arrays.num_logprobs
                and arrays.mode() == "greedy"):
            return start_copies((InBatchOrder(tokens, rows), None, None, None))
        return self.sample_device(self._rows(logits, rows), arrays)

    def execute_logits_at(self, batch: StepBatch, *token_indices: np.ndarray) -> tuple:
        """As ModelRunner.execute_logits_at, replicated: the indices, of the batch's tokens, are
        mapped to the step's rows of logits on the host, so one gather takes them."""
        step = self._layout(batch)
        logits = self._run(step, all_logits=True)[0]
        return self._take_rows(logits, *(put(step.token_rows[i].astype(np.int32),
                                             self._replicated) for i in token_indices))

    def sample_device(self, logits: jax.Array, arrays: SamplingArrays,
                      counts=None) -> tuple:
        """As ModelRunner.sample_device (logits [S, V] or padded), with the per-row parameters
        placed on the mesh (replicated); tokens are not padded past bucket(S)."""
        s = len(arrays.temperature)
        rows = bucket(s)
        if logits.shape[0] != rows:
            logits = self._rows(logits, np.minimum(np.arange(rows), s - 1))
        return self._sample_padded(logits, arrays.padded(rows), counts,
                                   place=lambda a: put(a, self._replicated))

def sharded_engine_parts(mesh, cfg: ModelConfig, engine_cfg, num_pages_for):
    """(pages per data shard, page pool, runner factory) of an LLMEngine sharded over `mesh`.

    num_pages_for(cfg) sizes the cache as the engine does; it gets a config with the KV heads one
    device stores, so a memory fraction counts each device's own share of a page.
    """
    _, dp = mesh_shape(mesh)
    num_pages = num_pages_for(kv_local_config(cfg, mesh))
    if dp == 1:
        pool = BlockPool(num_pages, engine_cfg.page_size, engine_cfg.enable_prefix_caching)
    else:
        pool = ShardedBlockPool(dp, num_pages, engine_cfg.page_size,
                                engine_cfg.enable_prefix_caching)
    return num_pages, pool, functools.partial(ShardedModelRunner, mesh=mesh)
