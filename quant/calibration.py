"""Calibration: text to token batches, and running the model one decoder layer at a time.

GPTQ and AWQ need the inputs of every linear layer on real text, and they need them layer by
layer: layer i must see the outputs of layers 0..i-1 *as already quantized* (GPTQ) or scaled
(AWQ). `LayerwiseRunner` therefore keeps the hidden states of the whole calibration batch and
advances them one layer at a time with the engine's own code: `DecoderLayer.__call__` of
models/llama.py over a fresh paged KV cache of that one layer, so attention is the same paged
attention the engine serves with. `record_inputs` captures the input of chosen linear layers while
a layer runs (the Linear modules of a copy of the layer are wrapped inside the jitted program, and
the inputs they see are returned as outputs).

The default calibration text is held apart from the default evaluation text of
engine/perplexity.py (CPython's pydoc topics): the Debian license texts in
/usr/share/common-licenses (GPL-3, Apache-2.0, MPL-2.0, ...), or, where those are missing, the
docstrings of a fixed list of CPython standard-library modules.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from configs.model import ModelConfig
from models.llama import AttentionMetadata, embed, layer_attention

LICENSE_DIR = "/usr/share/common-licenses"
LICENSE_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic",
                 "CC0-1.0", "BSD")
STDLIB_MODULES = ("argparse", "asyncio", "collections", "contextlib", "dataclasses", "decimal",
                  "email", "functools", "itertools", "json", "logging", "os", "pathlib",
                  "pickle", "re", "shutil", "socket", "sqlite3", "subprocess", "threading",
                  "typing", "unittest", "urllib", "zipfile")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def default_calibration_text() -> tuple[str, str]:
    """(text, description) of the built-in calibration text (see the module docstring)."""
    present = [n for n in LICENSE_FILES if os.path.isfile(os.path.join(LICENSE_DIR, n))]
    if present:
        texts = []
        for name in present:
            with open(os.path.join(LICENSE_DIR, name), encoding="utf-8") as f:
                texts.append(f.read())
        return "\n\n".join(texts), f"{LICENSE_DIR}/{{{','.join(present)}}}"
    docs = []
    for name in STDLIB_MODULES:
        doc = importlib.import_module(name).__doc__
        if doc:
            docs.append(doc)
    return "\n\n".join(docs), "docstrings of CPython stdlib modules " + ",".join(STDLIB_MODULES)


def calibration_batch(token_ids: list[int], num_tokens: int, seq_len: int = 512) -> np.ndarray:
    """The first `num_tokens` ids cut into rows of `seq_len`: int32 [num_tokens // seq_len, seq_len]."""
    seq_len = min(seq_len, num_tokens)
    rows = num_tokens // seq_len
    if rows < 1 or len(token_ids) < rows * seq_len:
        raise ValueError(f"calibration text has {len(token_ids)} tokens, fewer than the "
                         f"{num_tokens} asked for (lower --calib_tokens or give a longer text)")
    return np.asarray(token_ids[: rows * seq_len], np.int32).reshape(rows, seq_len)


def linear_modules(layer) -> dict:
    """The seven Linear modules of a decoder layer by name (q_proj ... down_proj)."""
    mods = {n: getattr(layer.self_attn, n) for n in ATTENTION_PROJECTIONS}
    mods.update({n: getattr(layer.mlp, n) for n in MLP_PROJECTIONS})
    return mods


def _parent(layer, name: str):
    return layer.self_attn if name in ATTENTION_PROJECTIONS else layer.mlp


class _RecordInput:
    """Stands in for a Linear while a layer runs: keeps its input, then calls it."""

    def __init__(self, linear, sink: list):
        self.linear, self.sink = linear, sink

    def __call__(self, x, kernels=None):
        self.sink.append(x)
        return self.linear(x, kernels)


@contextlib.contextmanager
def record_inputs(layer, names):
    """Within the block, the inputs of the named Linear modules of `layer` are appended to lists.

    Yields {name: list of input arrays [tokens, in]}; the modules are restored on exit.
    """
    sinks = {name: [] for name in names}
    originals = {name: getattr(_parent(layer, name), name) for name in names}
    try:
        for name in names:
            setattr(_parent(layer, name), name, _RecordInput(originals[name], sinks[name]))
        yield sinks
    finally:
        for name in names:
            setattr(_parent(layer, name), name, originals[name])


def prefill_metadata(num_seqs: int, seq_len: int, page_size: int) -> AttentionMetadata:
    """Metadata of one prefill of `num_seqs` rows of `seq_len` tokens into a fresh cache.

    Row r owns pages r * pages_per_row ...; its tokens are flat indices r * seq_len ....
    """
    pages_per_row = -(-seq_len // page_size)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), num_seqs)  # [N]
    tables = np.arange(num_seqs * pages_per_row, dtype=np.int32).reshape(num_seqs, pages_per_row)
    rows = np.repeat(np.arange(num_seqs), seq_len)
    slots = tables[rows, positions // page_size] * page_size + positions % page_size
    return AttentionMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables),
        query_start_loc=jnp.arange(0, num_seqs * seq_len + 1, seq_len, dtype=jnp.int32),
        kv_lens=jnp.full((num_seqs,), seq_len, jnp.int32), max_q_len=seq_len,
        max_prefill_seqs=num_seqs)


class LayerwiseRunner:
    """Advances a calibration batch [B, T] through the model one decoder layer at a time.

    Hidden states are flat, [B * T, hidden], as in the engine's forward. Layers run over chunks
    of `chunk_seqs` rows to bound the memory of attention.
    """

    def __init__(self, cfg: ModelConfig, model, token_ids: np.ndarray, page_size: int = 16,
                 chunk_seqs: int = 8):
        self.cfg, self.model = cfg, model
        self.token_ids = np.asarray(token_ids, np.int32)
        self.num_seqs, self.seq_len = self.token_ids.shape
        self.page_size = page_size
        self.chunk_seqs = max(1, min(chunk_seqs, self.num_seqs))
        self.dtype = model.embed_tokens.embedding.get_value().dtype
        self._layer_jit = jax.jit(self._layer_program,
                                  static_argnames=("graphdef", "record", "index"))
        self._attention_jit = nnx.jit(self._attention_program, static_argnames=("index",))

    def _attention_program(self, attn, x, k_pages, v_pages, meta, index):
        """The attention block of layer `index` on one chunk, inside jit."""
        inv_freq, window = layer_attention(self.cfg, index)
        return attn(x, k_pages, v_pages, meta, self.cfg, inv_freq, window=window)[0]

    def _layer_program(self, state, x, k_pages, v_pages, meta, *, graphdef, record, index):
        """One layer on one chunk, inside jit; the recorded inputs are returned as outputs."""
        layer = nnx.merge(graphdef, state)  # a copy private to this trace: safe to wrap
        inv_freq, window = layer_attention(self.cfg, index)
        with record_inputs(layer, record) as sinks:
            y, _, _ = layer(x, k_pages, v_pages, meta, self.cfg, inv_freq, window=window)
        return y, {name: inputs[0] for name, inputs in sinks.items()}

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.seq_len

    def embed(self) -> jax.Array:
        """Token embeddings of the whole batch, [B * T, hidden]."""
        return embed(self.model, jnp.asarray(self.token_ids.reshape(-1)), self.cfg)

    def _chunks(self, x: jax.Array, num_seqs: int | None = None):
        """(meta, x chunk) over row chunks of the first `num_seqs` rows (default: all)."""
        num_seqs = num_seqs or self.num_seqs
        for start in range(0, num_seqs, self.chunk_seqs):
            rows = min(self.chunk_seqs, num_seqs - start)
            meta = prefill_metadata(rows, self.seq_len, self.page_size)
            yield meta, x[start * self.seq_len:(start + rows) * self.seq_len]

    def _fresh_pages(self, rows: int):
        cfg = self.cfg
        shape = (cfg.num_kv_heads, rows * -(-self.seq_len // self.page_size), self.page_size,
                 cfg.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)

    def run_layer(self, index: int, x: jax.Array, record=(), num_seqs: int | None = None):
        """Runs decoder layer `index` on x [N, hidden]; returns (y [N, hidden], recorded inputs).

        record: names of Linear modules whose inputs to capture ({name: [N, in]}).
        num_seqs: only run the first this-many rows of the batch.
        """
        graphdef, state = nnx.split(self.model.layers[index])
        outputs, recorded = [], {name: [] for name in record}
        for meta, xc in self._chunks(x, num_seqs):
            k_pages, v_pages = self._fresh_pages(meta.kv_lens.shape[0])
            y, inputs = self._layer_jit(state, xc, k_pages, v_pages, meta, graphdef=graphdef,
                                        record=tuple(record), index=index)
            outputs.append(y)
            for name in record:
                recorded[name].append(inputs[name])
        return (jnp.concatenate(outputs),
                {name: jnp.concatenate(chunks) for name, chunks in recorded.items()})

    def run_attention(self, index: int, x_normed: jax.Array, num_seqs: int | None = None):
        """The attention block of layer `index` (projections included) on normed inputs."""
        attn = self.model.layers[index].self_attn
        outputs = []
        for meta, xc in self._chunks(x_normed, num_seqs):
            k_pages, v_pages = self._fresh_pages(meta.kv_lens.shape[0])
            outputs.append(self._attention_jit(attn, xc, k_pages, v_pages, meta, index=index))
        return jnp.concatenate(outputs)

    def layers(self, desc: str):
        """range(num_layers) with a progress bar."""
        return tqdm(range(self.cfg.num_layers), desc=desc, unit="layer")


def calibration_ids(tokenizer, text_file: str | None, num_tokens: int,
                    seq_len: int = 512) -> tuple[np.ndarray, str]:
    """(token rows int32 [B, T], description of the text) for calibration.

    text_file None: the built-in text (default_calibration_text). The text is tokenized without
    special tokens and its first `num_tokens` tokens cut into rows of `seq_len`.
    """
    if tokenizer is None:
        raise ValueError("this model has no tokenizer to encode calibration text with")
    if text_file:
        with open(text_file, encoding="utf-8") as f:
            text, description = f.read(), text_file
    else:
        text, description = default_calibration_text()
    ids = calibration_batch(tokenizer.encode(text), num_tokens, seq_len)
    return ids, description
