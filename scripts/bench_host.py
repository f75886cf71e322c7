"""Host-only benchmark: the engine's Python work per decode step, without a device.

    python -m scripts.bench_host --num_seqs=256 --json_out=host.json

The engine runs a tiny model's configuration, but its runner is replaced by a stub that returns
fixed token ids at once, so each step times only what the host does: scheduling, block tables
and the step batch, sampling arrays, counters, appending tokens and stop checks (what
`bench_serving` calls host time, less the dispatch of the jitted step).

- `--workload=decode`: `--num_seqs` requests decode together (prompts of 70-85 tokens, outputs
  long enough never to finish); the table gives the best of `--repeats` medians of `--steps`
  rounds, per model step, in total and per phase (the phase timers add about a microsecond per
  call).
- `--workload=serving`: bench_serving's default workload (400 requests at once, log-normal
  prompt and output lengths, medians 200 and 150) through `--num_seqs` slots, with its
  admissions, prefill chunks and finishes; host time per model step over all rounds and over
  those with the most sequences running (bench_serving's "at 256 running").

`--num_decode_steps` > 1 runs multi-step rounds (the stub returns a round's tokens too).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import math
import statistics
import time

import numpy as np
from absl import app, flags

from scripts import timing

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags (defined when it runs, so that tests can import its functions next
    to other scripts' flags of the same names)."""
    flags.DEFINE_integer("num_seqs", 256, "Sequences decoding together.")
    flags.DEFINE_integer("steps", 64, "Decode steps per timing.")
    flags.DEFINE_integer("repeats", 7, "Timings (the best is reported).")
    flags.DEFINE_bool("async_scheduling", True, "Engine with asynchronous scheduling.")
    flags.DEFINE_integer("num_decode_steps", 1, "Decode steps per round (multi-step rounds).")
    flags.DEFINE_bool("mixed_rounds", True,
                      "EngineConfig.mixed_rounds (with --num_decode_steps > 1).")
    flags.DEFINE_integer("num_requests", 400, "Requests of the serving workload (more give more "
                         "rounds while saturated, a steadier figure).")
    flags.DEFINE_enum("workload", "decode", ["decode", "serving"],
                      "decode: num_seqs sequences decoding; serving: bench_serving's workload.")
    flags.DEFINE_string("json_out", None, "Write the results as JSON here.")


def stub_engine(num_seqs: int, async_scheduling: bool, num_decode_steps: int = 1,
                add_requests: bool = True, max_num_batched_tokens: int = 8192,
                max_model_len: int = 4096, mixed_rounds: bool = True):
    """An engine of tiny-llama's shapes whose runner returns token ids 3.. at once (a round:
    the same ids at every step); with add_requests, num_seqs requests that do not finish
    before max_model_len."""
    import engine.llm_engine as llm_engine
    from configs.model import TINY_LLAMA
    from engine.request import SamplingParams
    from engine.runner import bucket
    from models.weights import random_model
    cfg = dataclasses.replace(TINY_LLAMA, max_position_embeddings=max_model_len)
    engine = llm_engine.LLMEngine(cfg, random_model(cfg, 0), None, llm_engine.EngineConfig(
        max_model_len=max_model_len, max_num_seqs=num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling, num_decode_steps=num_decode_steps,
        mixed_rounds=mixed_rounds))
    tokens = np.arange(max_num_batched_tokens, dtype=np.int32) % 200 + 3  # never an EOS id

    def execute_and_sample(batch, arrays, prev_samples=None, sample_index=None):
        return tokens[: max(batch.num_seqs, 1)].copy(), None, None, None

    def execute_multi_step(batch, arrays, steps, prev_samples=None, sample_index=None):
        return np.tile(tokens[: bucket(batch.num_seqs)], (steps, 1)), None

    def execute_mixed_round(batch, complete, arrays, steps, prev_samples=None,
                            sample_index=None):
        return execute_multi_step(batch, arrays, steps)

    engine.runner.execute_and_sample = execute_and_sample
    engine.runner.execute_multi_step = execute_multi_step
    engine.runner.execute_mixed_round = execute_mixed_round
    if add_requests:
        rng = np.random.default_rng(0)
        for i in range(num_seqs):
            engine.add_request(rng.integers(3, 256, 70 + i % 16).tolist(),
                               SamplingParams(max_tokens=max_model_len - 100,
                                              ignore_eos=True))
    return engine


def serving_workload(engine, num_requests: int = 400, seed: int = 0) -> None:
    """Adds bench_serving's default workload: log-normal prompt and output lengths (medians 200
    and 150, sigma 0.8, at most 1024 and 1000 tokens), all at once, ignoring EOS."""
    from engine.request import SamplingParams
    rng = np.random.default_rng(seed)

    def lengths(median, longest):
        drawn = rng.lognormal(math.log(median), 0.8, num_requests)
        return np.clip(np.round(drawn), 4, longest).astype(int).tolist()

    for prompt_len, output_len in zip(lengths(200, 1024), lengths(150, 1000)):
        engine.add_request(rng.integers(3, 256, prompt_len).tolist(),
                           SamplingParams(max_tokens=output_len, ignore_eos=True))


def measure_serving(num_seqs: int, async_scheduling: bool, num_decode_steps: int,
                    mixed_rounds: bool = True, num_requests: int = 400) -> dict:
    """Host seconds per model step over the serving workload: all rounds, and those of each
    of timing.round_sets (the most sequences running; saturated), in total and per phase
    (timers on)."""
    engine = stub_engine(num_seqs, async_scheduling, num_decode_steps, add_requests=False,
                         max_num_batched_tokens=2048, mixed_rounds=mixed_rounds)
    engine.stats = type(engine.stats)(record_steps=True)
    per_step: list = []
    phases = timing.time_engine_phases(engine, per_step)
    serving_workload(engine, num_requests)
    gc.collect()
    gc.freeze()
    while engine.has_unfinished():
        engine.step()
        engine.finished_request_ids()
    gc.unfreeze()
    steps = np.asarray(engine.stats.steps, float).reshape(-1, 6)
    out = {"workload": "serving", "num_seqs": num_seqs, "async_scheduling": async_scheduling,
           "num_decode_steps": num_decode_steps, "rounds": len(steps),
           "host_s_per_step_all": float(steps[:, 1].sum() / steps[:, 4].sum())}
    for name, mask in timing.round_sets(steps).items():
        chosen = np.nonzero(mask)[0]
        model_steps = steps[chosen, 4].sum()
        out |= timing.round_set_figures(steps, mask, name)
        out[f"phase_s_per_step_{name}"] = {
            k: sum(per_step[i][k] for i in chosen) / model_steps
            for k in phases if model_steps and any(per_step[i][k] for i in chosen)}
    return out


def measure(num_seqs: int, steps: int, repeats: int, async_scheduling: bool,
            num_decode_steps: int = 1) -> dict:
    """Best-of-`repeats` medians of host seconds per model step (no timers installed), then
    each phase's seconds per model step over `steps` more rounds with the phase timers on."""
    rounds = 3 + steps * (repeats + 1)
    engine = stub_engine(num_seqs, async_scheduling, num_decode_steps,
                         max_model_len=max(4096, 128 + rounds * num_decode_steps))
    for _ in range(3):  # prefill and the first decode steps
        engine.step()
    if engine.num_running != num_seqs:
        raise RuntimeError(f"{engine.num_running} of {num_seqs} sequences running")
    gc.collect()
    gc.freeze()
    medians = []
    for _ in range(repeats):
        per_step = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            per_step.append(time.perf_counter() - start)
        medians.append(statistics.median(per_step) / num_decode_steps)
    phases = timing.time_engine_phases(engine)  # per-call timers: about 1 us each
    model_steps = engine.stats.num_model_steps
    for _ in range(steps):
        engine.step()
    model_steps = engine.stats.num_model_steps - model_steps
    gc.unfreeze()
    return {"workload": "decode", "num_seqs": num_seqs, "async_scheduling": async_scheduling,
            "num_decode_steps": num_decode_steps, "steps": steps,
            "host_s_per_step": min(medians),
            "phase_s_per_step": {k: v / model_steps for k, v in phases.items() if v}}


def main(_):
    if FLAGS.workload == "serving":
        result = measure_serving(FLAGS.num_seqs, FLAGS.async_scheduling, FLAGS.num_decode_steps,
                                 FLAGS.mixed_rounds,
                                 FLAGS.num_requests)
    else:
        result = measure(FLAGS.num_seqs, FLAGS.steps, FLAGS.repeats, FLAGS.async_scheduling,
                         FLAGS.num_decode_steps)
    mode = (f"{'asynchronous' if result['async_scheduling'] else 'synchronous'}, "
            f"{result['num_decode_steps']}-step rounds")
    if FLAGS.workload == "serving":
        print(f"serving workload, {result['num_seqs']} slots, {mode}: "
              f"{result['host_s_per_step_all'] * 1e3:.3f} ms of host work per model step over "
              f"all {result['rounds']} rounds")
        table, table_label = {}, ""
        for name, label in (("at_max_running", "with the most running"),
                            ("saturated", "while saturated (requests waiting)")):
            if result[f"host_s_per_step_{name}"] is None:
                continue
            table, table_label = result[f"phase_s_per_step_{name}"], label
            print(f"  {result[f'host_s_per_step_{name}'] * 1e3:.3f} ms over the "
                  f"{result[f'rounds_{name}']} rounds {label} "
                  f"({result[f'multi_step_rounds_{name}']} of them multi-step, "
                  f"{result[f'mean_running_{name}']:.1f} running on average)")
        print(f"phases {table_label}:")
    else:
        print(f"{result['num_seqs']} sequences, {mode}: "
              f"{result['host_s_per_step'] * 1e3:.3f} ms of host work per model step "
              f"({result['host_s_per_step'] / result['num_seqs'] * 1e6:.2f} us per sequence)")
        table = result["phase_s_per_step"]
    print("| phase | ms per step |\n|---|---:|")
    for name, seconds in sorted(table.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds * 1e3:.3f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
