"""Host-only benchmark: the engine's Python work per decode step, without a device.

    python -m scripts.bench_host --num_seqs=256 --json_out=host.json

The engine runs a tiny model's configuration, but its runner is replaced by a stub that returns
fixed token ids at once, so each step times only what the host does: scheduling, block tables
and the step batch, sampling arrays, counters, appending tokens and stop checks (what
`bench_serving` calls host time, less the dispatch of the jitted step). `--num_seqs` requests
decode together (prompts of 70-85 tokens, outputs long enough never to finish); the table gives
the best of `--repeats` medians of `--steps` steps, in total and per phase (the phase timers
add about a microsecond per call).
"""
from __future__ import annotations

import dataclasses
import gc
import json
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
    flags.DEFINE_string("json_out", None, "Write the results as JSON here.")


def stub_engine(num_seqs: int, async_scheduling: bool):
    """An engine of tiny-llama's shapes whose runner returns token ids 1.. at once."""
    import engine.llm_engine as llm_engine
    from configs.model import TINY_LLAMA
    from engine.request import SamplingParams
    from models.weights import random_model
    cfg = dataclasses.replace(TINY_LLAMA, max_position_embeddings=4096)
    engine = llm_engine.LLMEngine(cfg, random_model(cfg, 0), None, llm_engine.EngineConfig(
        max_model_len=4096, max_num_seqs=num_seqs, max_num_batched_tokens=8192,
        async_scheduling=async_scheduling))
    tokens = np.arange(num_seqs, dtype=np.int32) % 200 + 3  # never an EOS id

    def execute_and_sample(batch, arrays, prev_samples=None, sample_index=None):
        return tokens[: max(batch.num_seqs, 1)].copy(), None, None, None

    engine.runner.execute_and_sample = execute_and_sample
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        engine.add_request(rng.integers(3, 256, 70 + i % 16).tolist(),
                           SamplingParams(max_tokens=3000, ignore_eos=True))
    return engine


def measure(num_seqs: int, steps: int, repeats: int, async_scheduling: bool) -> dict:
    """Best-of-`repeats` medians of host seconds per step (no timers installed), then each
    phase's seconds per step over `steps` more steps with the phase timers on."""
    engine = stub_engine(num_seqs, async_scheduling)
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
        medians.append(statistics.median(per_step))
    phases = timing.time_engine_phases(engine)  # per-call timers: about 1 us each
    for _ in range(steps):
        engine.step()
    gc.unfreeze()
    return {"num_seqs": num_seqs, "async_scheduling": async_scheduling, "steps": steps,
            "host_s_per_step": min(medians),
            "phase_s_per_step": {k: v / steps for k, v in phases.items() if v}}


def main(_):
    result = measure(FLAGS.num_seqs, FLAGS.steps, FLAGS.repeats, FLAGS.async_scheduling)
    print(f"{result['num_seqs']} sequences, "
          f"{'asynchronous' if result['async_scheduling'] else 'synchronous'}: "
          f"{result['host_s_per_step'] * 1e3:.3f} ms of host work per step "
          f"({result['host_s_per_step'] / result['num_seqs'] * 1e6:.2f} us per sequence)")
    print("| phase | ms per step |\n|---|---:|")
    for name, seconds in sorted(result["phase_s_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {seconds * 1e3:.3f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    define_flags()
    app.run(main)
