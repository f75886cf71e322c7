"""Does a device-side `lax.cond` stall the host? Dispatch latency of a jitted program with and
without one, against the program's device time.

    python -m scripts.bench_dispatch --json_out=dispatch.json

Each program runs `--layers` products [rows, dim] x [dim, dim] (random bf16; about the work of
a decode step) and then picks one token per row:
- `argmax`: the argmax of the last activations (the engine's step since the sampler's mode is
  chosen on the host, engine.sampling.sampling_mode);
- `cond`: `lax.cond(any(temperature > 0), sampled, argmax)` on a host input, the sampler's shape
  before that change (the predicate is known before the products run).
With `--weight_args=1,64,256` the argmax program also runs with its weights passed as that many
separate arrays (a model step passes every weight and cache page as its own argument: about 180
for llama3.2-1b, 350 for llama3.1-8b), to show how the dispatch grows with the arguments.
For each: the time until the call returns to Python (what the host loses per dispatch), the time
until its result is ready (synced per call), and the time per call with `--queue` calls queued
and one sync. If a program's call returned only once the device was nearly done, the host could
not prepare the next step while the device runs this one (asynchronous scheduling could not
overlap). On the H200 (docs/PERFORMANCE.md) it does not: the cond returns as early as the plain
program, and costs about 0.3 ms of latency per synced call.
"""
from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from scripts import common

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 256, "Rows of the activations (sequences of a decode step).")
flags.DEFINE_integer("dim", 4096, "Width of the products.")
flags.DEFINE_integer("layers", 64, "Products per program.")
flags.DEFINE_integer("calls", 20, "Timed calls per figure (median).")
flags.DEFINE_integer("queue", 10, "Calls queued before one sync (throughput figure).")
flags.DEFINE_list("weight_args", [], "Also time the argmax program with its products' weights "
                  "passed as this many separate arrays (product i reads array i mod n), e.g. "
                  "1,64,256: how a call's dispatch grows with its arguments.")
flags.DEFINE_string("json_out", None, "Write the results as JSON here.")


def programs(layers: int) -> dict:
    """{name: jitted (x [R, D], w [D, D], temperature [R]) -> tokens int32 [R]}."""
    def body(x, w):
        for _ in range(layers):
            x = jnp.tanh(x @ w)
        return x

    def argmax(x, w, temperature):
        del temperature
        return jnp.argmax(body(x, w), axis=-1).astype(jnp.int32)

    def cond(x, w, temperature):
        h = body(x, w).astype(jnp.float32)

        def sampled():  # a stand-in sampler: noise then argmax
            noise = jax.random.gumbel(jax.random.key(0), h.shape)
            return jnp.argmax(h / temperature[:, None] + noise, axis=-1).astype(jnp.int32)

        return jax.lax.cond(jnp.any(temperature > 0), sampled,
                            lambda: jnp.argmax(h, axis=-1).astype(jnp.int32))

    return {"argmax": jax.jit(argmax), "cond": jax.jit(cond)}


def spread_weights(layers: int):
    """jitted (x [R, D], weights: tuple of n [D, D], temperature [R]) -> tokens [R]: the argmax
    program with product i reading weights[i % n]."""
    def fn(x, weights, temperature):
        del temperature
        for i in range(layers):
            x = jnp.tanh(x @ weights[i % len(weights)])
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    return jax.jit(fn)


def measure(fn, args, calls: int, queue: int) -> dict:
    """Median seconds: until the call returns, until its result is ready; and per queued call."""
    jax.block_until_ready(fn(*args))  # compile and warm
    returned, ready = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = fn(*args)
        returned.append(time.perf_counter() - start)
        out.block_until_ready()
        ready.append(time.perf_counter() - start)
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(queue)]
    jax.block_until_ready(outs)
    queued = (time.perf_counter() - start) / queue
    return {"return_s": statistics.median(returned), "ready_s": statistics.median(ready),
            "queued_s": queued}


def main(argv) -> None:
    del argv
    if min(FLAGS.rows, FLAGS.dim, FLAGS.layers, FLAGS.calls, FLAGS.queue) < 1:
        common.fail("--rows, --dim, --layers, --calls and --queue must be >= 1")
    if not all(n.isdigit() and int(n) >= 1 for n in FLAGS.weight_args):
        common.fail(f"--weight_args must be integers >= 1, got {','.join(FLAGS.weight_args)}")
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (FLAGS.rows, FLAGS.dim), jnp.bfloat16)
    w = (jax.random.normal(kw, (FLAGS.dim, FLAGS.dim), jnp.float32)
         / FLAGS.dim ** 0.5).astype(jnp.bfloat16)
    rows = []
    for name, fn in programs(FLAGS.layers).items():
        for label, t in (("greedy rows", 0.0), ("sampled rows", 0.8)):
            temperature = jnp.full((FLAGS.rows,), t, jnp.float32)
            if name == "argmax" and t > 0:
                continue  # the host would run the sampler as a second program
            r = measure(fn, (x, w, temperature), FLAGS.calls, FLAGS.queue)
            rows.append({"program": name, "rows": label, **r,
                         "return_over_ready": r["return_s"] / r["ready_s"]})
    temperature = jnp.zeros((FLAGS.rows,), jnp.float32)
    for n in map(int, FLAGS.weight_args):
        weights = tuple(w * (1 + i / n) for i in range(n))  # distinct arrays
        r = measure(spread_weights(FLAGS.layers), (x, weights, temperature), FLAGS.calls,
                    FLAGS.queue)
        rows.append({"program": "argmax", "rows": f"greedy rows, {n} weight arrays", **r,
                     "return_over_ready": r["return_s"] / r["ready_s"]})
    print(f"device: {jax.devices()[0].device_kind}; {FLAGS.layers} products "
          f"[{FLAGS.rows}, {FLAGS.dim}] x [{FLAGS.dim}, {FLAGS.dim}] per program")
    print("| program | rows | call returns (ms) | result ready (ms) | returns / ready "
          "| queued per call (ms) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['program']} | {r['rows']} | {r['return_s'] * 1e3:.3f} | "
              f"{r['ready_s'] * 1e3:.3f} | {r['return_over_ready']:.0%} | "
              f"{r['queued_s'] * 1e3:.3f} |")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": FLAGS.rows,
                       "dim": FLAGS.dim, "layers": FLAGS.layers, "results": rows}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
