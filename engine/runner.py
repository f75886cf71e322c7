"""The model runner: the only place that calls jax.jit, donates the cache and pads a step batch
(engine/step_batch.py) to its bucket, so that few programs are compiled."""
from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.kv_cache import KVCache, init_kv_cache
from engine.device_arrays import abstract_arrays, fetch_samples, start_copies
from engine.device_tables import DeviceTables, tables_on_device
from engine.request import MAX_LOGPROBS
from engine.penalty_counts import PenaltyCounts
from engine.sampling import (SAMPLED_MODES, PenaltyRows, SamplingArrays, first_rows,
                             logprobs_of, pack_sampling, sample_packed, sample_penalized,
                             sample_step, with_logprobs)
from engine.step_batch import (MIN_PAGE_BUCKET, StepBatch, bucket, bucket_key, pad_to,
                               padding_batch, table_widths)
from engine.step_inputs import StepLayout, pack
from engine.step_programs import decode_loop, draw_tokens, input_tokens, step_fields
from models.llama import AttentionMetadata, LlamaForCausalLM, forward
from models.layer_scan import scannable
from ops.backends import device_kernels
from ops.kernel_choice import KernelBackends
from ops.kv_quant import kv_cache_dtype
from ops.paged_attention import bounds_prefill_seqs


def model_dtype(model: LlamaForCausalLM):
    """The model's activation dtype (its embedding's), the KV cache's default dtype."""
    return model.embed_tokens.embedding.get_value().dtype


class ModelRunner:
    """Owns the weights and the KV cache on the device, and the jitted step and sampler."""

    supports_async_scheduling = True  # steps can read input tokens from the last step's samples
    # warm-up compiles its programs ahead of time, without running them (`warmup`)
    compiles_ahead = True
    layer_loop = "unrolled"  # set per runner: "scan" where kernels.layer_loop and the model allow
    tables: DeviceTables | None = None  # the block tables on the device, where a runner keeps them

    def __init__(self, cfg: ModelConfig, model: LlamaForCausalLM, num_pages: int,
                 page_size: int, kv_dtype=None, max_seqs: int = 1, max_width: int = 1,
                 kernels: KernelBackends | None = None):
        self.cfg = cfg
        # The kernel of every op family, chosen once for this device and the switches (None:
        # ops.backends.device_kernels) and passed to every traced step.
        self.kernels = device_kernels() if kernels is None else kernels
        self.max_seqs, self.max_width = max_seqs, max_width
        self.min_width, self.prefill_width = table_widths(max_width, page_size,
                                                          self.kernels.platform)
        # Where the kernels allow it, every step reads its rows of tables kept on the device:
        # one width, the longest context's (engine.device_tables.tables_on_device).
        self.tables = (DeviceTables(bucket(max_seqs), bucket(max_width, MIN_PAGE_BUCKET))
                       if tables_on_device(self.kernels, cfg.head_dim) else None)
        self.graphdef, self.state = nnx.split(model)
        # The pages' storage: the model's dtype, or int8 / fp8 pages with float32 scales.
        self.kv_dtype = kv_cache_dtype(kv_dtype, model_dtype(model))
        # The layer loop (kernels.layer_loop): a scanned step keeps every layer's pages in one
        # array (models/layer_scan.py); layers that cannot share one body run unrolled.
        self.layer_loop = ("scan" if self.kernels.layer_loop == "scan"
                           and scannable(cfg, model.layers, self.kernels) is None
                           else "unrolled")
        self.cache: KVCache = init_kv_cache(cfg, num_pages, page_size, self.kv_dtype,
                                            stacked=self.layer_loop == "scan")
        self.page_size = page_size
        self.compiled_shapes: set[tuple] = set()
        # Sampled tokens come back padded to this many rows, so that a step can read its input
        # tokens from the previous step's samples on the device (asynchronous scheduling).
        self.sample_rows = bucket(max_seqs)
        self._no_samples = jnp.zeros((self.sample_rows,), jnp.int32)
        # The penalties' token counts per input-batch slot, made when first needed (a draft
        # model's runner never needs them; engine/memory.py's activation reserve counts them).
        self._penalty_counts: PenaltyCounts | None = None
        self._penalty_counts_made = threading.Lock()  # a compile thread may make it too
        # The weights go to the jitted step as a flat tuple of arrays: jax flattens a tuple in
        # C++, an nnx.State through Python callbacks on every call.
        self._weights, self._weights_def = jax.tree.flatten(self.state)
        self._weights = tuple(self._weights)
        self._step = jax.jit(self._step_impl, donate_argnums=(1,),
                             static_argnames=("layout", "all_logits"))
        self._step_and_argmax = jax.jit(self._step_and_argmax_impl, donate_argnums=(1,),
                                        static_argnames=("layout", "out_rows"))
        # A round donates the cache and, with penalties, the count table (argument 7; not
        # the rows and strengths beside it, whose buffers no output could reuse).
        self._multi_step = jax.jit(self._multi_step_impl, donate_argnums=(1, 7),
                                   static_argnames=("layout", "num_steps", "mode"))
        self._mixed_round = jax.jit(self._mixed_round_impl, donate_argnums=(1, 7),
                                    static_argnames=("layout", "num_steps", "mode"))
        # Round keys (`round_key`) whose programs have compiled: a round of penalized rows
        # may wait for its program to compile off the serving path (engine/multi_step.py).
        self.compiled_rounds: set[tuple] = set()
        self._gather_rows = jax.jit(gather_rows)

    def _step_impl(self, weights, cache, tables, packed, prev_samples, layout: StepLayout,
                   all_logits=False):
        """One model step over the inputs packed by engine/step_inputs.py.

        A token whose sample_index is >= 0 is prev_samples[sample_index] instead of the host's
        id (a token the previous step sampled, whose id the host has not read yet).
        """
        x = step_fields(packed, layout, tables)
        tokens = input_tokens(x, prev_samples)
        meta = AttentionMetadata(
            positions=x["positions"], slot_mapping=x["slot_mapping"],
            block_tables=x["block_tables"], query_start_loc=x["query_start_loc"],
            kv_lens=x["kv_lens"], max_q_len=layout.max_q_len,
            max_prefill_seqs=layout.max_prefill_seqs)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        return forward(model, cache, tokens, meta, self.cfg,
                       None if all_logits else x["logits_indices"], kernels=self.kernels)

    def share_programs(self, other: "ModelRunner") -> None:
        """Runs this runner's steps with `other`'s jitted functions (and their compiled
        programs). They read only the model's structure and config from their runner, so two
        runners of one model can share them (tests build many engines of one model)."""
        self._step, self._step_and_argmax = other._step, other._step_and_argmax
        self._multi_step, self._mixed_round = other._multi_step, other._mixed_round

    def _step_and_argmax_impl(self, weights, cache, tables, packed, prev_samples,
                              layout: StepLayout, out_rows: int):
        """`_step_impl` and each row's greedy token in one program: (logits [S, V], greedy
        tokens int32 [out_rows] zero-padded, cache). The engine's every step runs it; batches
        with sampled rows or penalties sample its logits in a second, small program."""
        logits, cache = self._step_impl(weights, cache, tables, packed, prev_samples, layout)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return logits, jnp.pad(tokens, (0, out_rows - tokens.shape[0])), cache

    def _multi_step_impl(self, weights, cache, tables, packed, floats, ints, prev_samples,
                         counts, penalty_rows, layout: StepLayout, num_steps: int, mode: str):
        """`num_steps` decode steps of one token per sequence in one program (a device loop):
        each step's tokens are the previous step's samples, its positions, cache slots and
        lengths one further. floats / ints: the packed sampling rows (sampling.pack_sampling;
        each step draws with the step index + i). counts: None, or the count table that each
        step reads and counts its tokens in, penalty_rows its (rows, strengths) as
        engine.sampling.sample_penalized takes them.
        A first token whose sample_index is >= 0 is prev_samples[sample_index] (asynchronous
        scheduling, as in `_step_impl`).
        Returns (tokens int32 [num_steps, S], the last step's tokens int32 [sample_rows]
        zero-padded (what the next step reads its in-flight tokens from), the count table or
        None, cache).
        """
        x = step_fields(packed, layout, tables)
        first_tokens = input_tokens(x, prev_samples)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        return self._decode_loop(model, cache, first_tokens, x["positions"], x["kv_lens"] > 0,
                                 x["block_tables"], floats, ints, counts, penalty_rows,
                                 num_steps, 0, mode)

    def _decode_loop(self, model, cache, *args):
        """engine.step_programs.decode_loop with this runner's config, kernels and sizes."""
        return decode_loop(model, self.cfg, self.kernels, self.page_size, self.sample_rows,
                           cache, *args)

    def _mixed_round_impl(self, weights, cache, tables, packed, floats, ints, prev_samples,
                          counts, penalty_rows, layout: StepLayout, num_steps: int, mode: str):
        """A step of any kind (prefill chunks and decodes mixed, `_step_impl`) and then
        num_steps - 1 decode steps of its rows, in one program. packed: the step's inputs
        (step_inputs.pack) followed by one int32 per row, 1 where the row's step token is its
        request's next token (a prompt completed, or a decode), 0 for a prefill chunk short of
        the prompt's end or padding: only those rows decode on, from position kv_lens.
        counts, penalty_rows: as `_multi_step_impl`'s (rows count only where complete).
        Returns (tokens int32 [num_steps, S]: the step's samples, then each decode step's;
        the last step's tokens [sample_rows]; count table or None; cache)."""
        num_seqs = layout.num_seqs
        step_packed, complete = packed[:-num_seqs], packed[-num_seqs:] > 0
        logits, cache = self._step_impl(weights, cache, tables, step_packed, prev_samples,
                                        layout)
        first, counts = draw_tokens(logits, floats, ints, 0, mode, counts, penalty_rows)  # [S]
        x = step_fields(step_packed, layout, tables)
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        rest, last, counts, cache = self._decode_loop(
            model, cache, first, x["kv_lens"], complete, x["block_tables"], floats, ints, counts,
            penalty_rows, num_steps - 1, 1, mode)
        return jnp.concatenate([first[None], rest]), last, counts, cache

    def execute_multi_step(self, batch: StepBatch, arrays: SamplingArrays, num_steps: int,
                           prev_samples: jax.Array | None = None,
                           sample_index: np.ndarray | None = None) -> tuple:
        """Runs `num_steps` decode steps of a decode batch (one token per sequence, every
        sequence with room in its pages for num_steps tokens) as one program, without waiting.
        Returns device arrays: the sampled tokens int32 [num_steps, bucket(S)] (the host reads
        [:, :S]; their copy to the host has started) and the last step's tokens int32
        [sample_rows], from which a next step launched before the host reads these can take
        its input tokens (asynchronous scheduling; prev_samples and sample_index as in
        `execute_padded`). Penalties read and count in the count table; no logprobs."""
        if len(batch.token_ids) != batch.num_seqs:
            raise ValueError(f"multi-step decoding needs one token per sequence, got "
                             f"{len(batch.token_ids)} tokens for {batch.num_seqs} sequences")
        return self._run_round(self._multi_step, "multi_step", batch, arrays, num_steps,
                               prev_samples, sample_index)

    def execute_mixed_round(self, batch: StepBatch, complete: np.ndarray,
                            arrays: SamplingArrays, num_steps: int,
                            prev_samples: jax.Array | None = None,
                            sample_index: np.ndarray | None = None) -> tuple:
        """Runs a step of any kind and then num_steps - 1 decode steps of the rows where
        `complete` (bool [S]: the row's step token is its request's next token; every such row
        needs pages for num_steps - 1 more tokens) as one program, without waiting. Returns
        device arrays: tokens int32 [num_steps, bucket(S)] (row i's are meaningful where
        complete[i]; their copy to the host has started) and the last step's tokens
        [sample_rows] (as `execute_multi_step`). Penalties as there; no logprobs."""
        if len(complete) != batch.num_seqs:
            raise ValueError(f"complete has {len(complete)} rows for {batch.num_seqs} sequences")
        return self._run_round(self._mixed_round, "mixed_round", batch, arrays, num_steps,
                               prev_samples, sample_index, complete)

    def _run_round(self, program, kind: str, batch: StepBatch, arrays: SamplingArrays,
                   num_steps: int, prev_samples, sample_index,
                   complete: np.ndarray | None = None) -> tuple:
        """Pads and packs a round's batch (with `complete` appended, for a mixed round), runs
        the jitted `program` without waiting and starts its tokens' copy to the host; returns
        (tokens [num_steps, bucket(S)], last step's tokens [sample_rows])."""
        counts = None if arrays.penalties is None else self._penalty_table(arrays.penalties)
        key, args = self._round_args(kind, batch, arrays, num_steps, prev_samples, sample_index,
                                     complete, None if counts is None else counts.device)
        tokens, last, table, self.cache = program(*args)
        if counts is not None:
            counts.device = table
        self.compiled_rounds.add(key)
        tokens.copy_to_host_async()
        return tokens, last

    def round_key(self, kind: str, batch: StepBatch, arrays: SamplingArrays,
                  num_steps: int) -> tuple:
        """The key of the round program that runs `batch` with `arrays` (kind: "multi_step"
        or "mixed_round"): (kind, bucket, steps, sampler mode, penalized?)."""
        return (kind, self.step_key(batch), num_steps, arrays.mode(),
                arrays.penalties is not None)

    def _round_args(self, kind: str, batch: StepBatch, arrays: SamplingArrays, num_steps: int,
                    prev_samples, sample_index, complete: np.ndarray | None = None,
                    counts=None) -> tuple:
        """(`round_key`, every argument of the round's jitted program (`_run_round`), the
        static ones last); with penalties, counts is the count table's array (or its abstract
        form)."""
        if arrays.num_logprobs:
            raise ValueError(f"a {kind.replace('_', '-')} round takes no logprobs")
        key = self.round_key(kind, batch, arrays, num_steps)
        self.compiled_shapes.add(key)
        layout, packed = self._padded(batch, sample_index)
        if complete is not None:
            packed = np.concatenate([packed, pad_to(np.asarray(complete, np.int32),
                                                  (layout.num_seqs,), 0)])
        arrays = arrays.padded(layout.num_seqs)
        floats, ints = pack_sampling(arrays)
        penalty_rows = (None if arrays.penalties is None else
                        (arrays.penalties.packed(), arrays.penalties.strengths))
        return key, (self._weights, self.cache, self._device_tables(), packed, floats, ints,
                     self._no_samples if prev_samples is None else prev_samples,
                     None if penalty_rows is None else counts, penalty_rows, layout, num_steps,
                     key[3])

    @property
    def prefill_widens(self) -> bool:
        """Whether prefill tables widen with their context past prefill_width (the CPU's,
        engine.step_batch.table_widths), so that the warm-up lists those widths too."""
        return self.kernels.platform == "cpu" and self.tables is None

    @property
    def counts_prefill_seqs(self) -> bool:
        """Whether prefill programs are keyed by how many sequences prefill at once: only the
        jnp attention's prefill group is sized by it (ops.paged_attention.bounds_prefill_seqs)."""
        return bounds_prefill_seqs(self.kernels)

    @property
    def fixed_width(self) -> int | None:
        """The one table width of every step when the tables live on the device, else None."""
        return None if self.tables is None else self.tables.width

    def _device_tables(self):
        """The device's tables, the steps' argument (None when steps send their own)."""
        return None if self.tables is None else self.tables.device

    def step_key(self, batch: StepBatch) -> tuple[int, int, int, int, int]:
        """The bucket (N, S, W, max_q_len, max_prefill_seqs) of the program that runs `batch`
        (engine.step_batch.bucket_key)."""
        q_lens = np.diff(batch.query_start_loc)
        width = max(self.min_width, batch.block_tables.shape[1])
        prefill_width = max(self.prefill_width, width)
        if self.tables is not None:  # the device's width (a wider batch widens it: `_padded`)
            width = prefill_width = max(self.tables.width, width)
        return bucket_key(len(batch.token_ids), batch.num_seqs, width,
                          int(q_lens.max(initial=1)), int((q_lens > 1).sum()),
                          max(self.max_seqs, batch.num_seqs), prefill_width,
                          batch.verify_len, self.counts_prefill_seqs)

    def padding_q_lens(self, batch: StepBatch) -> list[int]:
        """The q_lens of a padding batch whose program runs `batch` (the same `step_key`):
        its own."""
        return np.diff(batch.query_start_loc).tolist()

    def _padded(self, batch: StepBatch, sample_index: np.ndarray | None = None):
        """(layout, packed int32 inputs) of the batch padded to its bucket; with resident
        tables, the batch's rows of them brought up to date on the device first."""
        key = self.step_key(batch)
        n, s, w, max_q, max_prefill = key
        self.compiled_shapes.add(key)
        start = np.full(s + 1, batch.query_start_loc[-1], np.int32)
        start[: batch.num_seqs + 1] = batch.query_start_loc
        layout = StepLayout(n, s, w, max_q, max_prefill, resident=self.tables is not None)
        if self.tables is None:
            tables = pad_to(batch.block_tables, (s, w), 0)
        else:
            tables = pad_to(self.tables.sync(batch.block_tables, batch.kv_lens, batch.slots,
                                             batch.table_versions), (s,), 0)
        packed = pack(layout, {
            "tokens": pad_to(batch.token_ids, (n,), 0),
            "positions": pad_to(batch.positions, (n,), 0),
            "slot_mapping": pad_to(batch.slot_mapping, (n,), -1),
            "block_tables": tables,
            "query_start_loc": start,
            "kv_lens": pad_to(batch.kv_lens, (s,), 0),
            "logits_indices": pad_to(batch.logits_indices, (s,), 0),
            "sample_index": pad_to(np.zeros(0, np.int32) if sample_index is None
                                 else sample_index, (n,), -1)})
        return layout, packed

    def execute(self, batch: StepBatch) -> jax.Array:
        """Runs one step; returns each sequence's last-token logits, float32 [S, V] (on device)."""
        return self.execute_padded(batch)[: batch.num_seqs]

    def _step_args(self, batch: StepBatch, prev_samples: jax.Array | None = None,
                   sample_index: np.ndarray | None = None) -> tuple:
        """Every argument of the jitted step for this batch: (weights, cache, device tables,
        packed inputs, prev_samples, layout)."""
        layout, packed = self._padded(batch, sample_index)
        return (self._weights, self.cache, self._device_tables(), packed,
                self._no_samples if prev_samples is None else prev_samples, layout)

    def execute_padded(self, batch: StepBatch, prev_samples: jax.Array | None = None,
                       sample_index: np.ndarray | None = None) -> jax.Array:
        """Like `execute`, but returns the logits of the padded batch, [bucket(S), V], without
        the slicing op (the engine's hot path samples padded rows and drops them on the host).

        prev_samples: the padded tokens [sample_rows] of the previous step's `sample_device`;
        sample_index int32 [N]: token t of the batch is prev_samples[sample_index[t]] where that
        is >= 0 (the host's token id there is a placeholder).
        """
        logits, self.cache = self._step(*self._step_args(batch, prev_samples, sample_index))
        return logits

    def execute_and_sample(self, batch: StepBatch, arrays: SamplingArrays,
                           prev_samples: jax.Array | None = None,
                           sample_index: np.ndarray | None = None) -> tuple:
        """One step and its tokens, without waiting: the results of `sample_device` for the
        batch's sequences. An all-greedy batch without penalties is one program (the step and
        its argmax: one dispatch, one transfer); otherwise the sampler runs on the step's logits
        as a second program, in the mode the host picks (engine.sampling.sampling_mode)."""
        logits, tokens, self.cache = self._step_and_argmax(
            *self._step_args(batch, prev_samples, sample_index), self.sample_rows)
        if arrays.penalties is None and arrays.mode() == "greedy":
            return start_copies(with_logprobs(logits, tokens, arrays.num_logprobs))
        return self.sample_device(logits, arrays)

    def execute_logits_at(self, batch: StepBatch, *token_indices: np.ndarray) -> tuple:
        """Runs one step; for each host int32 array of flat token indices, the logits of those
        tokens, float32 [*index.shape, V] (on the device). One gather program per step program
        and index shapes: a verification step's (`verification_indices`) compile at warm-up."""
        logits, self.cache = self._step(*self._step_args(batch), all_logits=True)
        return self._gather_rows(logits, *token_indices)

    def execute_all_logits(self, batch: StepBatch) -> jax.Array:
        """Runs one step; returns the logits of every token, float32 [N, V] (on the device)."""
        return self.execute_logits_at(batch, np.arange(len(batch.token_ids), dtype=np.int32))[0]

    def warmup(self, q_lens, num_pages: int, verification: bool = False,
               last_logits: bool = False):
        """Compiles the program of a step whose sequences compute q_lens tokens each (with
        `verification`, the step of every token's logits and the gathers of
        `verification_indices`; with `last_logits`, the step of `execute_padded`, a draft
        model's, whatever `verification` says of its shape): ahead of time (lowered and
        compiled for a padding step's argument shapes, not run: a large prefill program would
        take seconds to run; the weights and cache are not touched, so this may run in a thread
        beside the engine's steps), or where `compiles_ahead` is off by running it on padding
        (nothing is written). Returns the compiled step when compiled ahead (its
        memory_analysis() tells the step's temporary bytes), else None."""
        dummy = padding_batch(q_lens, num_pages, verification)
        num_seqs = dummy.num_seqs
        indices = verification_indices(num_seqs, dummy.verify_len) if verification else ()
        if self.compiles_ahead:
            args = abstract_arrays(self._step_args(dummy))
            if last_logits:
                return self._step.lower(*args).compile()
            if not verification:
                return self._step_and_argmax.lower(*args, self.sample_rows).compile()
            step = self._step.lower(*args, all_logits=True).compile()
            logits = step.out_info[0]
            self._gather_rows.lower(jax.ShapeDtypeStruct(logits.shape, logits.dtype),
                                    *indices).compile()
            return step
        if last_logits:
            self.execute_padded(dummy).block_until_ready()
        elif verification:
            jax.block_until_ready(self.execute_logits_at(dummy, *indices))
        else:  # the program the engine runs: the step and its argmax
            fetch_samples(self.execute_and_sample(dummy, SamplingArrays.defaults(num_seqs)),
                          num_seqs)

    def warmup_multi_step(self, num_seqs: int, num_pages: int, num_steps: int,
                          mode: str = "greedy", penalized: bool = False):
        """Compiles the multi-step program of a decode batch whose rows sample in `mode`
        (engine.sampling.sampling_mode), with penalties or not, as `warmup` does, and returns
        the same."""
        dummy = padding_batch([1] * num_seqs, num_pages)
        return self._warmup_round("multi_step", dummy, None, num_steps, mode, penalized)

    def warmup_mixed_round(self, q_lens, num_pages: int, num_steps: int,
                           mode: str = "greedy", penalized: bool = False) -> None:
        """Compiles the mixed-round program of a step whose sequences compute q_lens tokens
        each and sample in `mode`, with penalties or not (as `warmup`)."""
        dummy = padding_batch(q_lens, num_pages)
        self._warmup_round("mixed_round", dummy, np.zeros(dummy.num_seqs, np.bool_), num_steps,
                           mode, penalized)

    def _warmup_round(self, kind: str, dummy: StepBatch, complete, num_steps: int, mode: str,
                      penalized: bool):
        """Compiles a round program for a padding batch: ahead of time from shapes (a
        penalized one against the count table's abstract form, never its array, which a step
        may be donating), or by running it (penalties on a scratch table)."""
        arrays = SamplingArrays.of_mode(dummy.num_seqs, mode)
        if penalized:
            arrays.penalties = PenaltyRows.unslotted(dummy.num_seqs)
        program = self._multi_step if kind == "multi_step" else self._mixed_round
        if self.compiles_ahead:
            counts = self.penalty_counts.abstract if penalized else None
            key, args = self._round_args(kind, dummy, arrays, num_steps, None, None, complete,
                                         counts)
            compiled = program.lower(*abstract_arrays(args)).compile()
            self.compiled_rounds.add(key)
            return compiled
        counts = (PenaltyCounts(self.penalty_counts.rows, self.cfg.vocab_size, self._placed)
                  if penalized else None)
        key, args = self._round_args(kind, dummy, arrays, num_steps, None, None, complete,
                                     None if counts is None else counts.device)
        tokens, _, _, self.cache = program(*args)
        np.asarray(tokens)
        self.compiled_rounds.add(key)

    def sampler_shapes(self) -> list[tuple[int, str]]:
        """(rows, mode) of the sampler programs that steps with sampled rows reach: every
        power-of-two row count up to the step's, without and with top-k / top-p / min-p cuts."""
        rows = [1 << i for i in range(bucket(self.max_seqs).bit_length())]
        return [(r, mode) for r in rows for mode in SAMPLED_MODES]

    def penalty_sampler_shapes(self) -> list[tuple[int, str]]:
        """(rows, mode) of the sampler programs that steps with penalties reach:
        `sampler_shapes`' row counts, in every mode, greedy too."""
        rows = sorted({r for r, _ in self.sampler_shapes()})
        return [(r, mode) for r in rows for mode in ("greedy",) + SAMPLED_MODES]

    @property
    def runs_samplers(self) -> bool:
        """Whether warm-up compiles the sampler programs by running them on zero logits
        (`_placed`) rather than ahead of time from shapes: where steps do not compile ahead."""
        return not self.compiles_ahead

    def _compile_sampler(self, arrays: SamplingArrays, logits_rows: int) -> None:
        """Compiles the sampler program that `sample_device` runs for `arrays` on logits of
        `logits_rows` rows (with their penalties and logprobs, if any): by running it
        (`runs_samplers`; penalties on a scratch count table, since a step may be donating
        the engine's), else ahead of time (only the sampler itself)."""
        vocab = self.cfg.vocab_size
        if self.runs_samplers:
            logits = self._placed(np.zeros((logits_rows, vocab), np.float32))
            counts = (None if arrays.penalties is None else
                      PenaltyCounts(self.penalty_counts.rows, vocab, self._placed))
            fetch_samples(self.sample_device(logits, arrays, counts), len(arrays.temperature))
            return
        floats, ints = pack_sampling(arrays)
        logits = jax.ShapeDtypeStruct((logits_rows, vocab), jnp.float32)
        if arrays.penalties is None:
            sample_packed.lower(logits, floats, ints, out_rows=self.sample_rows,
                                mode=arrays.mode()).compile()
            return
        counts = self.penalty_counts.abstract
        sample_penalized.lower(logits, floats, ints, counts, arrays.penalties.packed(),
                               arrays.penalties.strengths, out_rows=self.sample_rows,
                               mode=arrays.mode()).compile()

    def warmup_penalty_sampler(self, rows: int, mode: str) -> None:
        """Compiles a `penalty_sampler_shapes` program (`_compile_sampler`) and, ahead of time,
        the count table's history write."""
        arrays = SamplingArrays.of_mode(rows, mode)
        arrays.penalties = PenaltyRows.unslotted(rows)
        self._compile_sampler(arrays, rows)
        self.penalty_counts.compile()

    @property
    def penalty_counts(self) -> PenaltyCounts:
        """The count table (engine/penalty_counts.py), a row per sequence, placed as the step's
        logits; made zero on first use."""
        with self._penalty_counts_made:
            if self._penalty_counts is None:
                self._penalty_counts = PenaltyCounts(self.sample_rows, self.cfg.vocab_size,
                                                     self._placed)
        return self._penalty_counts

    def _penalty_table(self, rows: PenaltyRows) -> PenaltyCounts:
        """The engine's count table, with the histories of the requests new to their slots
        (rows.histories) written first."""
        counts = self.penalty_counts
        for slot, prompt, output in rows.histories:
            counts.write(slot, prompt, output)
        rows.histories.clear()
        return counts

    def warmup_sampler(self, rows: int, mode: str) -> None:
        """Compiles the sampler program of `rows` logits rows in `mode`; with cuts, the cut of
        a step's sample_rows padded rows down to `rows` (`sample_device`); and once per row
        count (with mode "plain") the logprobs of `rows` rows: ahead of time (from shapes
        alone, so it may run on a compile thread), or by running them (`runs_samplers`)."""
        if self.runs_samplers:
            return self.run_sampler(rows, mode)
        cut = mode == "cuts" and rows < self.sample_rows
        vocab = self.cfg.vocab_size
        self._compile_sampler(SamplingArrays.of_mode(rows, mode), rows)
        if cut:
            first_rows.lower(jax.ShapeDtypeStruct((self.sample_rows, vocab), jnp.float32),
                             rows, rows=rows).compile()
        if mode == "plain":
            # positional, as with_logprobs calls it: jit keys a keyword apart
            logprobs_of.lower(jax.ShapeDtypeStruct((rows, vocab), jnp.float32),
                              jax.ShapeDtypeStruct((self.sample_rows,), jnp.int32),
                              MAX_LOGPROBS).compile()

    def run_sampler(self, rows: int, mode: str) -> None:
        """Runs `warmup_sampler`'s programs on zero logits placed as a step places its logits
        (`_placed`), which compiles them as a run reaches them; greedy and plain rows with
        logprobs, so that their logprobs program compiles too."""
        arrays = SamplingArrays.of_mode(rows, mode)
        if mode != "cuts":
            arrays.num_logprobs = MAX_LOGPROBS
        cut = mode == "cuts" and rows < self.sample_rows
        for logits_rows in (rows, self.sample_rows) if cut else (rows,):
            self._compile_sampler(arrays, logits_rows)

    def _placed(self, host: np.ndarray) -> jax.Array:
        """A host array where the step puts its logits (the sampler's programs are keyed by
        their inputs' placement)."""
        return jnp.asarray(host)

    def sample_device(self, logits: jax.Array, arrays: SamplingArrays,
                      counts: PenaltyCounts | None = None) -> tuple:
        """Samples one token per row of `logits` [S, V] (or of the padded logits of
        `execute_padded`), without waiting for the device; penalties read `counts` (default:
        the engine's table, `_sample_padded`).

        Returns device arrays (token ids [sample_rows] zero-padded, chosen logprobs, top ids,
        top logprobs), the last three None unless arrays.num_logprobs > 0; their copy to the
        host has started. `fetch_samples` reads them.
        """
        s = len(arrays.temperature)
        rows = logits.shape[0]
        # Padded logits (a power of two of rows) are sampled whole, padding rows greedy: no
        # slicing op. Only the sort of the "cuts" mode is worth cutting them down to bucket(S).
        if rows != bucket(rows) or (rows > bucket(s) and arrays.mode() == "cuts"):
            rows = bucket(s)
            logits = first_rows(logits, s, rows=rows)
        return start_copies(self._sample_padded(logits, arrays.padded(rows), counts))

    def _sample_padded(self, logits: jax.Array, arrays: SamplingArrays,
                       counts: PenaltyCounts | None = None, place=None) -> tuple:
        """`sample_step` of arrays padded to the logits' rows, with penalties read from and
        counted in `counts` (default: the engine's table, where the histories of requests new
        to their slots are written first)."""
        if arrays.penalties is not None and counts is None:
            counts = self._penalty_table(arrays.penalties)
        return sample_step(logits, arrays, out_rows=self.sample_rows, place=place,
                           counts=counts)

    def sample(self, logits: jax.Array, arrays: SamplingArrays):
        """`sample_device`, then waits: host numpy (token ids [S], chosen logprobs [S], top ids
        [S, K], top logprobs [S, K]), only the first len(arrays.temperature) rows."""
        return fetch_samples(self.sample_device(logits, arrays), len(arrays.temperature))


def gather_rows(logits: jax.Array, *indices: jax.Array) -> tuple:
    """logits[index] for each index array: [*index.shape, V] each, of logits [N, V]."""
    return tuple(logits[index] for index in indices)


def verification_indices(num_seqs: int, verify_len: int) -> tuple[np.ndarray, np.ndarray]:
    """The shapes of the token indices a verification step's logits are gathered at (zeros):
    int32 [s, verify_len] (each row's window: its last token and the proposals before it) and
    int32 [s] (each row's last token), s = bucket(num_seqs) (engine/spec_rounds.py)."""
    s = bucket(num_seqs)
    return np.zeros((s, verify_len), np.int32), np.zeros(s, np.int32)
