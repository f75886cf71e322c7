"""Batched token sampling: penalties, greedy, temperature, top-k, top-p, min-p, logprobs.

Each row's randomness comes only from its own (seed, step) pair, so a seeded request draws the
same tokens whatever else is in the batch. Everything is one jitted function over [S, V] logits;
per-request parameters are arrays of S rows (`SamplingArrays` builds them on the host).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.request import MAX_LOGPROBS


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """Temperature-scaled logits with the top-k, top-p and min-p cuts applied (-inf outside).

    logits [B, V] float32; temperature [B] (> 0); top_k int32 [B] (0 = off); top_p [B] in (0, 1];
    min_p [B] in [0, 1] (keep tokens at least min_p times as likely as the most likely one).
    Rows keep at least their most likely token.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)  # [B]
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    # Nucleus: keep the smallest prefix of the sorted tokens whose mass reaches top_p.
    sorted_top_k = jnp.where(sorted_desc >= kth_value, sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_top_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    # top_p >= 1 is no cut: in float32 the mass before a far tail token rounds to 1.0.
    keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    num_keep = jnp.maximum(keep_sorted.sum(-1), 1)  # [B]
    pth_value = jnp.take_along_axis(sorted_top_k, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, pth_value)  # [B, 1]
    if min_p is not None:  # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        threshold = jnp.maximum(threshold, sorted_desc[:, :1] + jnp.log(min_p)[:, None])
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


# A count-table entry (engine/penalty_counts.py): the output count of a token, plus PROMPT_FLAG
# where the request's prompt holds it (no request reaches 2**24 output tokens).
PROMPT_FLAG = 1 << 24
# The count-table slot of a padding row: its gather reads zeros and its count is dropped.
NO_SLOT = 1 << 30


def apply_penalties(logits: jax.Array, counts: jax.Array, repetition: jax.Array,
                    presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """Repetition (HF style: divide positive, multiply negative logits of every token seen in the
    prompt or output), presence and frequency penalties (OpenAI style: subtract per output token).

    logits [S, V]; counts int32 [S, V]: each row's count-table row (output count, plus
    PROMPT_FLAG for a prompt token); penalties [S].
    """
    output_counts = (counts & (PROMPT_FLAG - 1)).astype(jnp.float32)  # [S, V]
    penalized = jnp.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = jnp.where(counts > 0, penalized, logits)
    return (logits - frequency[:, None] * output_counts
            - presence[:, None] * (output_counts > 0).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("num_logprobs",))
def logprobs_of(logits: jax.Array, tokens: jax.Array, num_logprobs: int):
    """Log-probabilities of the model (raw logits [S, V]) for the chosen tokens (the first S
    of tokens [>= S], which may be padded) and the top-k.

    Returns (chosen [S], top ids int32 [S, k], top logprobs [S, k]).
    """
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    tokens = tokens[: logits.shape[0]]
    chosen = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(log_probs, num_logprobs)
    return chosen, top_ids.astype(jnp.int32), top_values


def _sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           seeds: jax.Array, steps: jax.Array, min_p: jax.Array | None = None,
           penalties: tuple | None = None, out_rows: int | None = None,
           mode: str = "cuts") -> jax.Array:
    """Picks one token per row.

    logits [B, V] float32; temperature float32 [B] (0 = greedy); top_k int32 [B]; top_p float32
    [B]; seeds uint32 [B]; steps int32 [B] (the index of the token being sampled in its request);
    min_p float32 [B] or None; penalties None or the arguments of `apply_penalties` after the
    logits (applied before greedy and sampling alike; `sample_penalized` gathers them). Returns
    int32 [B].

    mode (static; `sampling_mode` picks it on the host): "greedy" when no row samples (argmax
    only), "plain" when no sampling row has a top-k / top-p / min-p cut (no sort over the
    vocabulary), "cuts" otherwise (always correct). A row draws the same token in every mode that
    fits its batch. The host chooses, not a `lax.cond` on the device: a device-side cond
    measured slower per call on the H200, and it could not skip the sort for rows without cuts.
    """
    if mode not in ("greedy", "plain", "cuts"):
        raise ValueError(f"sampling mode must be greedy, plain or cuts, got {mode!r}")
    if penalties is not None:
        logits = apply_penalties(logits, *penalties)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode != "greedy":
        safe_temperature = jnp.where(temperature > 0, temperature, 1.0)
        cut = (filtered_logits(logits, safe_temperature, top_k, top_p, min_p) if mode == "cuts"
               else logits / safe_temperature[:, None])

        def draw(seed, step, row):
            key = jax.random.fold_in(jax.random.key(seed), step)
            return jax.random.categorical(key, row).astype(jnp.int32)

        tokens = jnp.where(temperature > 0, jax.vmap(draw)(seeds, steps, cut), tokens)
    if out_rows is not None and out_rows > tokens.shape[0]:
        tokens = jnp.pad(tokens, (0, out_rows - tokens.shape[0]))
    return tokens


# The sampler modes of batches where some row samples: without and with top-k / top-p / min-p cuts.
SAMPLED_MODES = ("plain", "cuts")


def sampling_mode(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray) -> str:
    """The cheapest `_sample` mode that draws every row of these host arrays correctly."""
    sampled = np.asarray(temperature) > 0
    if not sampled.any():
        return "greedy"
    cuts = (np.asarray(top_k) > 0) | (np.asarray(top_p) < 1.0) | (np.asarray(min_p) > 0)
    return "cuts" if (cuts & sampled).any() else "plain"


sample = jax.jit(_sample, static_argnames=("out_rows", "mode"))


def sample_from_packed(logits: jax.Array, floats: jax.Array, ints: jax.Array,
                       penalties: tuple | None = None, out_rows: int | None = None,
                       mode: str = "cuts") -> jax.Array:
    """`sample` with its per-row parameters packed in two arrays (two host-to-device transfers
    instead of six; see engine/step_inputs.py and `pack_sampling`): floats float32 [3, B] =
    (temperature, top_p, min_p); ints uint32 [3, B] = (top_k, seeds, steps)."""
    return _sample(logits, floats[0], ints[0].astype(jnp.int32), floats[1], ints[1],
                   ints[2].astype(jnp.int32), floats[2], penalties, out_rows, mode)


sample_packed = jax.jit(sample_from_packed, static_argnames=("out_rows", "mode"))


def sample_from_counts(logits: jax.Array, floats: jax.Array, ints: jax.Array, counts: jax.Array,
                      rows: jax.Array, strengths: jax.Array, out_rows: int | None = None,
                      mode: str = "cuts") -> tuple[jax.Array, jax.Array]:
    """`sample_from_packed` with penalties read from the count table, and each drawn token
    counted there in the same program.

    counts int32 [R, V] (engine/penalty_counts.py; donated); rows int32 [2, B]: each row's slot
    in it (NO_SLOT: none) and 1 where its token is counted (its request's next token);
    strengths float32 [3, B]: repetition, presence, frequency. Returns (tokens int32 [B], or
    [out_rows] zero-padded; the updated counts).
    """
    slots, counted = rows[0], rows[1]
    seen = jnp.take(counts, slots, axis=0, mode="fill", fill_value=0)  # [B, V]
    tokens = sample_from_packed(logits, floats, ints, (seen, *strengths), mode=mode)  # [B]
    counts = counts.at[slots, tokens].add(counted, mode="drop")
    if out_rows is not None and out_rows > tokens.shape[0]:
        tokens = jnp.pad(tokens, (0, out_rows - tokens.shape[0]))
    return tokens, counts


sample_penalized = jax.jit(sample_from_counts, donate_argnums=3,
                           static_argnames=("out_rows", "mode"))


def pack_sampling(arrays: "SamplingArrays") -> tuple[np.ndarray, np.ndarray]:
    """(floats float32 [3, S], ints uint32 [3, S]) of host sampling arrays (see
    `sample_from_packed`)."""
    floats = np.stack([arrays.temperature, arrays.top_p, arrays.min_p]).astype(np.float32)
    ints = np.stack([arrays.top_k.astype(np.uint32), arrays.seeds.astype(np.uint32),
                     arrays.steps.astype(np.uint32)])
    return floats, ints


def _pad_rows(a: np.ndarray, rows: int, value) -> np.ndarray:
    out = np.full((rows,) + a.shape[1:], value, a.dtype)
    out[: len(a)] = a
    return out


@dataclasses.dataclass
class PenaltyRows:
    """The penalty inputs of a step's rows: where their counts live and how strong they are."""

    slots: np.ndarray  # int32 [S]: each row's count-table slot (NO_SLOT: a padding row)
    counted: np.ndarray  # bool [S]: the row draws its request's next token (counted)
    strengths: np.ndarray  # float32 [3, S]: repetition, presence, frequency
    # (slot, prompt ids, output ids) of requests new to their slot: written before sampling
    histories: list = dataclasses.field(default_factory=list)

    @classmethod
    def unslotted(cls, rows: int) -> "PenaltyRows":
        """Rows of no slot, none counted: the shapes a warm-up compiles penalized programs
        with (their strengths are arbitrary)."""
        return cls(np.full(rows, NO_SLOT, np.int32), np.zeros(rows, bool),
                   np.ones((3, rows), np.float32))

    def padded(self, rows: int) -> "PenaltyRows":
        """Padding rows up to `rows`: no slot, not counted, neutral strengths."""
        strengths = np.tile(np.array([[1.0], [0.0], [0.0]], np.float32), (1, rows))
        strengths[:, : self.strengths.shape[1]] = self.strengths
        return PenaltyRows(_pad_rows(self.slots, rows, NO_SLOT),
                           _pad_rows(self.counted, rows, False), strengths, self.histories)

    def take(self, rows: np.ndarray) -> "PenaltyRows":
        """These rows in the order of `rows` (indices, repeats allowed; histories kept)."""
        return PenaltyRows(self.slots[rows], self.counted[rows], self.strengths[:, rows],
                           self.histories)

    def packed(self) -> np.ndarray:
        """int32 [2, S]: slots and counted (`sample_from_counts`'s rows)."""
        return np.stack([self.slots.astype(np.int32), self.counted.astype(np.int32)])


ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")  # SamplingArrays'


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters of one step, host numpy (one row per sequence)."""

    temperature: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]
    top_p: np.ndarray  # float32 [S]
    min_p: np.ndarray  # float32 [S]
    seeds: np.ndarray  # uint32 [S]
    steps: np.ndarray  # int32 [S]
    penalties: PenaltyRows | None = None
    num_logprobs: int = 0

    @classmethod
    def defaults(cls, rows: int) -> "SamplingArrays":
        """Greedy rows with no cuts."""
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32),
                   np.ones(rows, np.float32), np.zeros(rows, np.float32),
                   np.zeros(rows, np.uint32), np.zeros(rows, np.int32))

    @classmethod
    def of_mode(cls, rows: int, mode: str) -> "SamplingArrays":
        """Rows whose `mode()` is `mode`: greedy (the defaults), plain (temperature 1, no cut)
        or cuts (also top-k 1): what a warm-up compiles each sampler mode's programs with."""
        arrays = cls.defaults(rows)
        if mode != "greedy":
            arrays.temperature[:] = 1.0
        if mode == "cuts":
            arrays.top_k[:] = 1
        if arrays.mode() != mode:
            raise ValueError(f"sampling mode must be greedy, plain or cuts, got {mode!r}")
        return arrays

    def mode(self) -> str:
        """The sampler mode of these rows (`sampling_mode`)."""
        return sampling_mode(self.temperature, self.top_k, self.top_p, self.min_p)

    @classmethod
    def from_requests(cls, requests) -> "SamplingArrays":
        """The arrays of a list of engine Requests (their params, seeds and output counts),
        without penalties (engine/input_batch.py adds those: they live in slots)."""
        arrays = cls.from_rows(np.array([r.sampling_row for r in requests], np.float64),
                               draw_steps(requests))
        if any(r.params.logprobs is not None for r in requests):
            arrays.num_logprobs = MAX_LOGPROBS
        return arrays

    @classmethod
    def from_rows(cls, rows: np.ndarray, steps: np.ndarray) -> "SamplingArrays":
        """The arrays of sampling rows float64 [S, 5] (temperature, top_k, top_p, min_p, seed:
        Request.sampling_row, exact in float64) and each row's `draw_steps`, without penalties
        or logprobs."""
        rows = rows.reshape(-1, 5)
        return cls(temperature=rows[:, 0].astype(np.float32), top_k=rows[:, 1].astype(np.int32),
                   top_p=rows[:, 2].astype(np.float32), min_p=rows[:, 3].astype(np.float32),
                   seeds=rows[:, 4].astype(np.uint32), steps=np.asarray(steps, np.int32))

    def padded(self, rows: int) -> "SamplingArrays":
        """The same arrays with greedy, cut-free padding rows up to `rows`."""
        pad = SamplingArrays.defaults(rows)
        fields = {f: _pad_rows(getattr(self, f), rows, getattr(pad, f)[0]) for f in ROW_FIELDS}
        penalties = None if self.penalties is None else self.penalties.padded(rows)
        return SamplingArrays(**fields, penalties=penalties, num_logprobs=self.num_logprobs)

    def take(self, rows: np.ndarray) -> "SamplingArrays":
        """These rows in the order of `rows` (indices, repeats allowed): a sharded round's rows
        in the order the mesh lays them out."""
        fields = {f: getattr(self, f)[rows] for f in ROW_FIELDS}
        penalties = None if self.penalties is None else self.penalties.take(rows)
        return SamplingArrays(**fields, penalties=penalties, num_logprobs=self.num_logprobs)


def draw_steps(requests) -> np.ndarray:
    """int32 [S]: the index of the token each request draws now. Tokens still in flight count
    (asynchronous scheduling), so a seeded request draws the same tokens either way."""
    return np.fromiter((len(r.output_ids) + r.num_pending for r in requests), np.int32,
                       len(requests))


@functools.partial(jax.jit, static_argnames=("rows",))
def first_rows(logits: jax.Array, num_rows, rows: int) -> jax.Array:
    """[rows, V] of logits [R, V]: its first num_rows rows, then zero rows (rows static, a
    power of two; num_rows traced): one small program per (R, rows), whatever num_rows."""
    if logits.shape[0] < rows:
        logits = jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))
    return jnp.where(jnp.arange(rows)[:, None] < num_rows, logits[:rows], 0.0)


def sample_step(logits: jax.Array, arrays: SamplingArrays, out_rows: int | None = None,
                place=None, counts=None):
    """Samples a padded batch: (tokens [S], chosen logprobs, top ids, top logprobs) on device.

    The logprob entries are None when arrays.num_logprobs is 0. With `out_rows`, tokens are
    padded to [out_rows] (see `sample`). `place`, if given, puts each host array on the devices
    first (a sharded runner replicates them over its mesh); else the jitted sampler transfers
    them itself. counts: with penalties, the runner's count table (engine/penalty_counts.py),
    whose device array the step updates.
    """
    inputs = pack_sampling(arrays)
    if arrays.penalties is not None:
        inputs += (arrays.penalties.packed(), arrays.penalties.strengths)
    if place is not None:
        inputs = jax.tree.map(lambda a: place(np.asarray(a)), inputs)
    mode = arrays.mode()
    if arrays.penalties is None:
        tokens = sample_packed(logits, *inputs, out_rows=out_rows, mode=mode)
    else:
        floats, ints, rows, strengths = inputs
        tokens, counts.device = sample_penalized(logits, floats, ints, counts.device, rows,
                                                 strengths, out_rows=out_rows, mode=mode)
    return with_logprobs(logits, tokens, arrays.num_logprobs)


def with_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int) -> tuple:
    """(tokens, chosen logprobs, top ids, top logprobs) of sampled tokens (padded past the
    logits' rows or not); the last three None when num_logprobs is 0."""
    if not num_logprobs:
        return tokens, None, None, None
    return (tokens,) + logprobs_of(logits, tokens, num_logprobs)
