"""What the benchmarks share: timing device work the way a step runs it, the card's ceilings
measured in the same run, rows that record their error, and the printed table."""
from __future__ import annotations

import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from engine.warm_start import settings_environment
from ops.tpu_chips import chip_of_device_kind
from scripts.bench.profile import device_time_per_call
from scripts.common import write_json

__all__ = ["calibrate", "dispatch_hold", "error_text", "floor_TBps", "markdown_table",
           "published_floor", "queued_seconds", "run_info", "time_per_call", "write_json"]

# On the CPU the read floor is a matrix-vector product over this many bytes of float32 at most
# (far past the caches): XLA's elementwise copy into a fresh buffer runs there at about a
# quarter of the rate the cores read memory (2-core machine: 8.8 against 35 GB/s), so a
# decode step, which reads its weights through such products, would beat its "floor".
CPU_READ_BYTES = 1 << 30


def queued_seconds(run, calls: int, runs: int, warm: bool = True) -> list[float]:
    """Seconds per call of run() (which returns device arrays), one sample per run: `calls`
    calls queued, then one sync; with `warm` one untimed call first (compilation). The ~30 us
    dispatch of a jitted call is spread over the calls, as in a decode loop."""
    if warm:
        jax.block_until_ready(run())
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = run()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return samples


def dispatch_hold(run, runs: int) -> float:
    """Median seconds until run() returns (not until its results are ready), each call made on
    an idle device: how long one dispatch keeps the host."""
    holds = []
    for _ in range(runs):
        start = time.perf_counter()
        out = run()
        holds.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return statistics.median(holds)


def time_per_call(fn, args, calls: int, runs: int, queue: int) -> float:
    """Seconds per call of the work in `fn(*args)`, which itself runs `calls` of them on
    distinct inputs: fn jitted, queued `queue` times per sample, median of `runs` samples."""
    f = jax.jit(fn)
    return statistics.median(queued_seconds(lambda: f(*args), queue, runs)) / calls


def calibrate(copy_bytes: int = 4 << 30, matmul: int = 8192, runs: int = 3, queue: int = 5,
              device_times: bool = False) -> dict:
    """The card's ceilings measured now: copy bandwidth (bytes read + written by one elementwise
    pass over `copy_bytes` of uint32), read bandwidth (a max over them) and the bf16 matrix
    rate (a matmul^3 product of random values), in TB/s and TFLOP/s; on the CPU also the read
    rate of a float32 matrix-vector product (gemv_read_TBps, see CPU_READ_BYTES). With
    `device_times` also the copy and matmul rates from the profiler's device time
    (dev_copy_TBps, dev_matmul_TFLOPs), which rows timed the same way are compared against."""
    x = jax.random.bits(jax.random.key(0), (copy_bytes // 4,), jnp.uint32)
    a, b = (jax.random.normal(k, (matmul, matmul), jnp.bfloat16)
            for k in jax.random.split(jax.random.key(1)))
    calib = {"copy_bytes": copy_bytes, "matmul_size": matmul}
    rates = [("copy_TBps", lambda x: x ^ jnp.uint32(1), (x,), 2 * copy_bytes),
             ("read_TBps", jnp.max, (x,), copy_bytes),
             ("matmul_TFLOPs", lambda a, b: a @ b, (a, b), 2 * matmul ** 3)]
    if jax.default_backend() == "cpu":
        n = math.isqrt(min(copy_bytes, CPU_READ_BYTES) // 4)
        m = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)  # [n, n]
        v = jax.random.normal(jax.random.key(3), (n,), jnp.float32)  # [n]
        rates.append(("gemv_read_TBps", lambda m, v: m @ v, (m, v), 4 * n * n))
    for name, fn, args, work in rates:
        calib[name] = work / time_per_call(fn, args, 1, runs, queue) / 1e12
        if device_times and name in ("copy_TBps", "matmul_TFLOPs"):
            dev = device_time_per_call(fn, args, 1, queue)
            if "dev_us" in dev:
                calib["dev_" + name] = work / (dev["dev_us"] * 1e-6) / 1e12
    print(f"calib: copy {calib['copy_TBps']:.2f} TB/s (read + write), read "
          f"{calib['read_TBps']:.2f} TB/s, bf16 matmul {calib['matmul_TFLOPs']:.0f} TFLOP/s"
          + (f", matrix-vector read {calib['gemv_read_TBps']:.3f} TB/s"
             if "gemv_read_TBps" in calib else "")
          + (f"; device time: copy {calib['dev_copy_TBps']:.2f} TB/s, matmul "
             f"{calib['dev_matmul_TFLOPs']:.0f} TFLOP/s" if "dev_copy_TBps" in calib else ""),
          flush=True)
    return calib


def floor_TBps(calib: dict) -> float:
    """The bandwidth, TB/s, that a memory floor divides bytes by: a TPU's published figure
    (`published_floor`), else the fastest plain read calibrate measured (the copy; on the CPU
    the matrix-vector product's read where faster)."""
    if "published_TBps" in calib:
        return calib["published_TBps"]
    return max(calib["copy_TBps"], calib.get("gemv_read_TBps", 0.0))


def published_floor(device_kind: str | None = None) -> dict:
    """On a TPU of ops.tpu_chips.CHIPS: {"published_TBps": its published HBM bandwidth,
    "published_source": where}, the floor the benchmarks divide by there (a vendor figure, not
    a measurement); {} on other devices. device_kind: default this process's first device."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    chip = chip_of_device_kind(kind)
    if chip is None:
        return {}
    return {"published_TBps": chip.hbm_bytes_per_s / 1e12, "published_source": chip.source}


def error_text(e: BaseException) -> str:
    """A failed row's error: its type and the start of its message (a row that fails, out of
    memory or a tile the compiler rejects, is a result; the run goes on)."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def run_info() -> dict:
    """Device, jax version, date, command line and the settings from the environment
    (engine.warm_start.settings_environment: XLA_FLAGS' autotune level,
    PALLASITE_MOE=reference, ...): the head of every benchmark's JSON."""
    settings = settings_environment()
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "environment": settings}


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A markdown table: the first column left-aligned, the others right-aligned; None is '-'."""
    def cell(v):
        return "-" if v is None else str(v)
    lines = ["| " + " | ".join(header) + " |",
             "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
