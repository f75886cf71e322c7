"""What speculative verification costs on the device, the speed-up that predicts, and the
speed-up measured with a proposer that always agrees (the upper bound).

Step costs: for S sequences holding `context` cached tokens of random K/V, the time of a decode
step (one token per sequence) and of a verification step of k + 1 tokens per sequence (every
token's logits, as the engine verifies), k = 1 .. max_k, each timed as the engine runs it
(queued, one sync). Predicted speed-up: a round verifies k proposals of which a fraction alpha
is accepted, giving alpha k + 1 tokens for k draft steps and one verification step:
    speedup(k, alpha) = (alpha k + 1) / (k c_draft + c_verify(k)),  costs in decode steps.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from engine import spec_rounds
from engine.llm_engine import EngineConfig, LLMEngine
from configs.mesh import mesh_shape
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.step_batch import make_step_batch
from engine.sharded_runner import ShardedModelRunner
from engine.speculative import SpecConfig
from scripts.bench.common import queued_seconds
from scripts.bench.decode_model import fill_cache_random


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
    pages_per_seq = -(-(context + q) // page_size)
    _, pages = seq_pages(num_seqs, pages_per_seq, dp)
    rows = [(rng.integers(0, vocab, q).tolist(), context, pages[s]) for s in range(num_seqs)]
    batch = make_step_batch(rows, page_size)
    batch.verify_len = q if q > 1 else 0
    return batch


def time_steps(run, calls: int, runs: int) -> float:
    """Seconds per call of run() (which returns a device array): queued calls, one sync."""
    return statistics.median(queued_seconds(run, calls, runs))


def step_costs(cfg, model, batches, max_k, context, page_size, calls: int, runs: int,
               mesh=None) -> list[dict]:
    """Decode and verification step times for each batch size (see the module docstring), on
    the sharded runner over `mesh` when given."""
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
        fill_cache_random(runner, s)
        decode = step_batch(s, 1, context, page_size, cfg.vocab_size, rng, dp)
        decode_s = time_steps(lambda: runner.execute_padded(decode), calls, runs)
        row = {"batch": s, "decode_step_s": decode_s, "verify": []}
        print(f"batch {s}: decode step {decode_s * 1e3:.2f} ms", flush=True)
        for k in range(1, max_k + 1):
            verify = step_batch(s, k + 1, context, page_size, cfg.vocab_size, rng, dp)
            verify_s = time_steps(lambda: runner.execute_all_logits(verify), calls, runs)
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


def oracle_run(cfg, model, num_seqs: int, k: int, prompt_len: int, tokens: int,
               page_size: int, mesh=None) -> dict:
    """Plain greedy decoding against speculation whose proposals always agree (tokens/s).

    The proposer reads a continuation of each prompt. Plain greedy's continuation is the first
    one; in bf16 a verification step (k + 1 query tokens) and a decode step round differently,
    so on a random model's near-ties speculative greedy can leave it. Speculative runs are
    therefore repeated with the continuation of the run before (a run with every proposal
    accepted takes the same steps every time) until one accepts everything; the last is timed.
    Every run is also run untimed first, so nothing compiles while timed; prefix caching is off
    (a repeated prompt would hit the cache and take other steps).
    """
    rng = np.random.default_rng(1)
    plen = prompt_len
    prompts = [rng.integers(0, cfg.vocab_size, plen).tolist() for _ in range(num_seqs)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    engine_cfg = EngineConfig(max_model_len=plen + tokens + k + 16, max_num_seqs=num_seqs,
                              max_num_batched_tokens=max(num_seqs * plen, num_seqs * (k + 1)),
                              page_size=page_size, enable_prefix_caching=False)

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
