"""What speculative verification costs on the device, and the speed-up that predicts.

    python -m scripts.bench_verify --model=llama3.1-8b --dtype=bfloat16 --batches=1,8,64 \
        --max_k=8 --context=1024 --json_out=verify.json

1. Step costs. For each batch of S sequences holding `--context` cached tokens of random K/V:
   the time of a decode step (one token per sequence, last-token logits) and of a verification
   step of k + 1 tokens per sequence (every token's logits, as the engine verifies), k = 1 ..
   max_k. The engine pads a verification step to a power-of-two number of tokens per sequence,
   so k = 3 costs what k = 4 does. Each step is timed as the engine runs it: `--calls` calls
   queued, one sync, median of `--runs`.
2. Predicted speed-up, by the seed's model: a round verifies k proposals of which a fraction
   alpha is accepted, giving alpha k + 1 tokens for k draft steps and one verification step:
       speedup(k, alpha) = (alpha k + 1) / (k c_draft + c_verify(k)),  costs in decode steps,
   with c_draft = 0 (n-gram lookup) or `--draft_cost` (a draft model's step over the target's).
3. Upper bound, measured: the engine generating greedily with a proposer that always agrees
   with the target (it proposes the target's own continuation, found by a plain run first), at
   k = `--oracle_k`, against plain decoding of the same prompts, end to end (tokens/s).
Prints tables and writes JSON.

--tp / --dp (scripts/parallel.py) run all three over a device mesh: the step costs on the sharded
runner (engine/sharded_runner.py; with dp > 1 the sequences spread round robin over the data
shards), the end-to-end runs on a sharded engine. --fuse_projections fuses q/k/v and gate/up
(default: on a GPU without a mesh), as the serving scripts do.
"""
from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from scripts import common, parallel, timing

common.define_model_flags()
common.define_fusion_flags()
flags.DEFINE_list("batches", ["1", "8", "64"], "Sequences per step.")
flags.DEFINE_integer("max_k", 8, "Largest number of proposals verified per sequence.")
flags.DEFINE_integer("context", 1024, "Tokens already cached per sequence.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
flags.DEFINE_integer("calls", 20, "Steps queued before one sync.")
flags.DEFINE_integer("runs", 3, "Timed repetitions (median).")
flags.DEFINE_list("alphas", ["0.5", "0.6", "0.7", "0.8", "0.9"], "Acceptance rates to predict.")
flags.DEFINE_float("draft_cost", 0.0, "A draft step's cost in target decode steps (0: n-gram).")
flags.DEFINE_bool("step_costs", True, "Measure the decode and verification step costs.")
flags.DEFINE_integer("oracle_k", 4, "Proposals per step of the always-agreeing run (0: skip).")
flags.DEFINE_integer("oracle_prompt_len", 32, "Prompt tokens of the always-agreeing run.")
flags.DEFINE_integer("oracle_tokens", 64, "Tokens generated per sequence there.")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
FLAGS = flags.FLAGS


def random_cache(cache, seed: int):
    """The cache's pages filled with random values of its dtype (never zeros), each made where
    its page array lives (its sharding, on a mesh)."""
    from models.kv_cache import KVCache
    keys = jax.random.split(jax.random.key(seed), 2 * len(cache.k_pages))

    def fill_like(key, a):
        make = lambda k: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)  # noqa: E731
        return jax.jit(make, out_shardings=a.sharding)(key)

    fill = [fill_like(k, a) for k, a in zip(keys, cache.k_pages + cache.v_pages)]
    n = len(cache.k_pages)
    return KVCache(tuple(fill[:n]), tuple(fill[n:]))


def seq_pages(num_seqs: int, pages_per_seq: int, dp: int = 1) -> tuple[int, list[list[int]]]:
    """(pages per data shard, each sequence's pages): disjoint pages, sequence s in data shard
    s % dp (pages of shard d: [d * pages per shard, (d + 1) * pages per shard))."""
    per_shard = -(-num_seqs // dp) * pages_per_seq
    return per_shard, [list(range((s % dp) * per_shard + (s // dp) * pages_per_seq,
                                  (s % dp) * per_shard + (s // dp + 1) * pages_per_seq))
                       for s in range(num_seqs)]


def step_batch(num_seqs: int, q: int, context: int, page_size: int, vocab: int, rng,
               dp: int = 1):
    """S sequences, each computing q tokens after `context` cached ones, on disjoint pages
    spread over `dp` data shards (seq_pages)."""
    from engine.runner import make_step_batch
    pages_per_seq = -(-(context + q) // page_size)
    _, pages = seq_pages(num_seqs, pages_per_seq, dp)
    rows = [(rng.integers(0, vocab, q).tolist(), context, pages[s]) for s in range(num_seqs)]
    batch = make_step_batch(rows, page_size)
    batch.verification = q > 1
    return batch


def time_steps(run, calls: int, runs: int) -> float:
    """Seconds per call of run() (which returns a device array): queued calls, one sync."""
    return statistics.median(timing.queued_seconds(run, calls, runs))


def step_costs(cfg, model, batches, max_k, context, page_size, mesh=None) -> list[dict]:
    """Decode and verification step times for each batch size (see the module docstring), on
    the sharded runner over `mesh` when given."""
    from engine.mesh import mesh_shape
    from engine.runner import ModelRunner
    from engine.sharded_runner import ShardedModelRunner
    dp = 1 if mesh is None else mesh_shape(mesh)[1]
    rng = np.random.default_rng(0)
    pages_per_seq = -(-(context + max_k + 1) // page_size)
    rows = []
    for s in batches:
        pages, _ = seq_pages(s, pages_per_seq, dp)
        if mesh is None:
            runner = ModelRunner(cfg, model, pages, page_size, max_seqs=s,
                                 max_width=pages_per_seq)
        else:
            runner = ShardedModelRunner(cfg, model, pages, page_size, max_seqs=s,
                                        max_width=pages_per_seq, mesh=mesh)
        runner.cache = random_cache(runner.cache, s)
        decode = step_batch(s, 1, context, page_size, cfg.vocab_size, rng, dp)
        decode_s = time_steps(lambda: runner.execute_padded(decode), FLAGS.calls, FLAGS.runs)
        row = {"batch": s, "decode_step_s": decode_s, "verify": []}
        print(f"batch {s}: decode step {decode_s * 1e3:.2f} ms", flush=True)
        for k in range(1, max_k + 1):
            verify = step_batch(s, k + 1, context, page_size, cfg.vocab_size, rng, dp)
            verify_s = time_steps(lambda: runner.execute_all_logits(verify), FLAGS.calls,
                                  FLAGS.runs)
            row["verify"].append({"k": k, "step_s": verify_s, "over_decode": verify_s / decode_s})
            print(f"batch {s}: verify k={k} {verify_s * 1e3:.2f} ms "
                  f"({verify_s / decode_s:.2f} decode steps)", flush=True)
        rows.append(row)
        runner = None  # frees its cache before the next batch size's
    return rows


def predicted_speedups(row: dict, alphas, draft_cost: float) -> dict:
    """{alpha: (best k, speed-up)} and the full table {alpha: [speed-up for k = 1..]}."""
    table = {}
    for alpha in alphas:
        table[alpha] = [(alpha * v["k"] + 1) / (v["k"] * draft_cost + v["over_decode"])
                        for v in row["verify"]]
    best = {a: (int(np.argmax(t)) + 1, float(max(t))) for a, t in table.items()}
    return {"best": best, "table": table}


def oracle_run(cfg, model, num_seqs: int, k: int, mesh=None) -> dict:
    """Plain greedy decoding against speculation whose proposals always agree (tokens/s).

    The proposer reads a continuation of each prompt. Plain greedy's continuation is the first
    one; in bf16 a verification step (k + 1 query tokens) and a decode step round differently,
    so on a random model's near-ties speculative greedy can leave it. Speculative runs are
    therefore repeated with the continuation of the run before (a run with every proposal
    accepted takes the same steps every time) until one accepts everything; the last is timed.
    Every run is also run untimed first, so nothing compiles while timed; prefix caching is off
    (a repeated prompt would hit the cache and take other steps).
    """
    import engine.spec_rounds as spec_rounds
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.request import SamplingParams
    from engine.speculative import SpecConfig

    rng = np.random.default_rng(1)
    plen, tokens = FLAGS.oracle_prompt_len, FLAGS.oracle_tokens
    prompts = [rng.integers(0, cfg.vocab_size, plen).tolist() for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine_cfg = EngineConfig(max_model_len=plen + tokens + k + 16, max_num_seqs=num_seqs,
                              max_num_batched_tokens=max(num_seqs * plen, num_seqs * (k + 1)),
                              page_size=FLAGS.page_size, enable_prefix_caching=False)

    def run(engine):
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, [o.output_ids for o in outs]

    plain_engine = LLMEngine(cfg, model, None, engine_cfg, mesh=mesh)
    run(plain_engine)  # compiles every program of the run, untimed
    plain_s, plain = run(plain_engine)
    plain_engine = None
    continuation = {}

    def agreeing(token_ids, k, *_):  # the next k tokens of the continuation
        full = continuation[tuple(token_ids[:plen])]
        return full[len(token_ids):len(token_ids) + k]

    proposer = spec_rounds.propose_ngram
    spec_rounds.propose_ngram = agreeing
    try:
        engine = LLMEngine(cfg, model, None, engine_cfg,
                           spec_config=SpecConfig("ngram", k, max_batch=num_seqs), mesh=mesh)
        spec = plain
        for attempt in range(4):
            continuation.update({tuple(p): p + o for p, o in zip(prompts, spec)})
            run(engine)  # untimed: compiles; its outputs equal the timed run's
            engine.spec_stats = type(engine.spec_stats)()
            spec_s, spec_next = run(engine)
            stats = engine.spec_stats
            if stats.acceptance_rate == 1.0:
                break
            spec = spec_next
    finally:
        spec_rounds.propose_ngram = proposer
    spec = spec_next
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
             for x, y in zip(spec, plain)]
    return {"batch": num_seqs, "k": k, "plain_tokens_per_s": num_seqs * tokens / plain_s,
            "speculative_tokens_per_s": num_seqs * tokens / spec_s,
            "speedup": plain_s / spec_s, "same_tokens": spec == plain,
            "tokens_equal_to_plain": agree, "continuation_rounds": attempt + 1,
            "acceptance_rate": stats.acceptance_rate,
            "mean_tokens_per_verification": stats.mean_acceptance_length}


def print_tables(rows, predicted, oracle, alphas) -> None:
    max_k = len(rows[0]["verify"]) if rows else 0
    if rows:
        print("verification step cost, in decode steps (decode step time in ms)")
        print("batch  decode ms  " + "  ".join(f"k={k:<4d}" for k in range(1, max_k + 1)))
        for row in rows:
            costs = "  ".join(f"{v['over_decode']:6.2f}" for v in row["verify"])
            print(f"{row['batch']:5d}  {row['decode_step_s'] * 1e3:9.2f}  {costs}")
        print("\npredicted speed-up, best k (draft cost "
              f"{FLAGS.draft_cost} decode steps per proposal)")
        print("batch  " + "  ".join(f"a={a:<9}" for a in alphas))
        for row, p in zip(rows, predicted):
            print(f"{row['batch']:5d}  " + "  ".join(
                f"{p['best'][a][1]:5.2f}x k={p['best'][a][0]}" for a in alphas))
    if oracle:
        print("\nalways-agreeing proposer, measured end to end")
        for o in oracle:
            print(f"batch {o['batch']:3d} k={o['k']}: {o['speculative_tokens_per_s']:9.1f} vs "
                  f"{o['plain_tokens_per_s']:9.1f} tokens/s = {o['speedup']:.2f}x "
                  f"(acceptance {o['acceptance_rate']:.2f}, "
                  f"same tokens as plain: {o['same_tokens']}, "
                  f"first difference at {min(o['tokens_equal_to_plain'])})")


def main(argv) -> None:
    del argv
    common.setup_jax()
    try:
        batches = [int(b) for b in FLAGS.batches]
        alphas = [float(a) for a in FLAGS.alphas]
        if min(batches) < 1 or FLAGS.max_k < 1 or FLAGS.context < 1:
            raise ValueError(f"--batches ({FLAGS.batches}), --max_k ({FLAGS.max_k}) and "
                             f"--context ({FLAGS.context}) must be >= 1")
        if not all(0.0 <= a <= 1.0 for a in alphas):
            raise ValueError(f"--alphas must lie in [0, 1], got {FLAGS.alphas}")
        from engine.mesh import is_main_process
        from quant.loader import load_model
        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        common.check_fusion(mesh)
        loaded = load_model(FLAGS.model, common.resolve_dtype(FLAGS.dtype), True, FLAGS.seed,
                            mesh=mesh)
        loaded = common.prepare_model(loaded, mesh)  # --fuse_projections
    except common.USER_ERRORS as e:
        common.fail(str(e))
    cfg, model = loaded.cfg, loaded.model
    if mesh is not None:
        print(parallel.describe(mesh))
    rows = (step_costs(cfg, model, batches, FLAGS.max_k, FLAGS.context, FLAGS.page_size, mesh)
            if FLAGS.step_costs else [])
    predicted = [predicted_speedups(r, alphas, FLAGS.draft_cost) for r in rows]
    oracle = []
    for s in batches if FLAGS.oracle_k else []:
        oracle.append(oracle_run(cfg, model, s, FLAGS.oracle_k, mesh))
        print(f"always-agreeing run, batch {s}: {json.dumps(oracle[-1])}", flush=True)
    print_tables(rows, predicted, oracle, alphas)
    if FLAGS.json_out and is_main_process():
        with open(FLAGS.json_out, "w") as f:
            json.dump({"model": FLAGS.model, "dtype": FLAGS.dtype, "context": FLAGS.context,
                       "device": str(jax.devices()[0].device_kind), "draft_cost": FLAGS.draft_cost,
                       "mesh": None if mesh is None else dict(mesh.shape),
                       "fused_projections": cfg.fused_projections,
                       "step_costs": rows, "predicted": predicted, "oracle": oracle}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
