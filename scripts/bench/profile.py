"""Device time from jax's own profiler: busy time per step or per call, and where it goes.

`profile_calls` traces a few queued calls (a Perfetto trace, which holds the device's kernel
activity from CUPTI on GPUs); `summarize_trace` sums the device events: busy time (the union of
kernel intervals) against wall time, and the kernels grouped by kind and by name; the host's own
events are summed by name too. XLA runs a program op by op while the profiler is on unless
XLA_FLAGS has --xla_enable_command_buffers_during_profiling=true.
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile
import time

import jax

KINDS = (  # (kind, substrings of a lower-cased kernel name), first match wins
    ("attention", ("ragged", "paged", "attention", "decode_attn", "flash")),
    ("matmul", ("gemm", "gemv", "cublas", "cutlass", "matmul", "dot", "xmma", "sm90_",
                "wgmma")),
    ("kv write", ("scatter", "dynamic_update")),
    ("copy", ("memcpy", "memset", "copy")),
    ("reduce (norm, softmax, sampling)", ("reduce",)),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, keys in KINDS:
        if any(k in lower for k in keys):
            return kind
    return "elementwise / other fusion"


def profile_steps(runner, batch, steps: int, log_dir: str) -> dict:
    """Traces `steps` queued steps of `batch`; returns summarize_trace's dict (with the trace's
    path), or {'error': ...} when the profiler or its trace is not available."""
    return profile_calls(lambda: runner.execute_padded(batch), steps, steps, log_dir)


def profile_calls(run, calls: int, units: int, log_dir: str) -> dict:
    """Traces `calls` queued calls of run() (which returns device arrays; one untimed call
    first) and returns summarize_trace's dict per unit of work (`units` in all: steps, or
    products of a benchmark program) with the trace's path and the traced wall time, or
    {'error': ...} when the profiler or its trace is not available."""
    try:
        jax.block_until_ready(run())
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            for _ in range(calls):
                out = run()
            jax.block_until_ready(out)
            wall = time.perf_counter() - start
        paths = sorted(glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"),
                                 recursive=True), key=os.path.getmtime)
        if not paths:
            return {"error": f"no perfetto trace under {log_dir}"}
        summary = summarize_trace(load_trace(paths[-1]), units)
        return summary | {"trace_path": paths[-1], "traced_wall_s_per_step": wall / units}
    except Exception as e:  # noqa: BLE001 - the benchmark reports it and goes on
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def device_time_per_call(fn, args, calls: int, queue: int, log_dir: str | None = None) -> dict:
    """{'dev_us': device busy microseconds per call, 'kernels': the top kernels' microseconds
    per call} from one trace of `queue` queued runs of jit(fn)(*args), each of which does
    `calls` calls of the work (a benchmark program); {'dev_error': ...} where the profiler
    gives no device events (on a CPU, say). log_dir None: a temporary directory."""
    if log_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return device_time_per_call(fn, args, calls, queue, tmp)
    f = jax.jit(fn)
    prof = profile_calls(lambda: f(*args), queue, queue * calls, log_dir)
    if "error" in prof:
        return {"dev_error": prof["error"]}
    return {"dev_us": prof["busy_s_per_step"] * 1e6,
            "kernels": {r["name"][:48]: round(r["s_per_step"] * 1e6, 2)
                        for r in prof["by_name"][:4]}}


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_trace(trace: dict, steps: int, device_match: str = "gpu", top: int = 25) -> dict:
    """Device time of a trace of `steps` steps (trace-event JSON, times in microseconds).

    Device events are complete events ('ph' == 'X') of processes whose name contains
    `device_match` (case-insensitive; jax names them '/device:GPU:0' and the like).
    Returns per-step seconds: busy (union of kernel intervals), span (first kernel start to last
    kernel end), kernel sum; and by kind and by name: seconds per step and calls per step.
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if device_match in n.lower()}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids
              and "dur" in e]
    per_step = lambda us: us * 1e-6 / steps  # noqa: E731

    def table(groups):
        rows = [{"name": k, "s_per_step": per_step(sum(v)), "calls_per_step": len(v) / steps,
                 "mean_us": sum(v) / len(v)} for k, v in groups.items()]
        return sorted(rows, key=lambda r: -r["s_per_step"])

    host_groups = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("pid") not in device_pids:
            host_groups[e["name"]].append(e["dur"])
    host = {"host_by_name": table(host_groups)[:top]}
    # GPU traces may add derived lines ('XLA Ops', 'XLA Modules') over the streams' kernels:
    # count the CUDA streams' own events when there are any.
    lines = collections.Counter(threads.get((e["pid"], e.get("tid")), "") for e in device)
    streams = {name for name in lines if name.lower().startswith("stream")}
    kernels = [e for e in device
               if not streams or threads.get((e["pid"], e.get("tid")), "") in streams]
    if not kernels:
        return {"error": f"no device events (processes: {sorted(set(names.values()))[:12]})"} | host
    by_name, by_kind = collections.defaultdict(list), collections.defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e["dur"])
        by_kind[kernel_kind(e["name"])].append(e["dur"])
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    return host | {"steps": steps, "device_processes": sorted(names[p] for p in device_pids),
            "device_lines": dict(lines), "kernels_per_step": len(kernels) / steps,
            "busy_s_per_step": per_step(_union_length(intervals)),
            "kernel_sum_s_per_step": per_step(sum(e["dur"] for e in kernels)),
            "span_s_per_step": per_step(max(b for _, b in intervals)
                                        - min(a for a, _ in intervals)),
            "by_kind": table(by_kind), "by_name": table(by_name)[:top],
            "sample_event_args": [kernels[i].get("args", {}) for i in range(min(3, len(kernels)))]}


def format_summary(summary: dict) -> str:
    """A few lines of text: busy vs wall per step, then the kinds and the top kernels."""
    if "error" in summary:
        return f"profile: {summary['error']}"
    wall = summary.get("traced_wall_s_per_step")
    lines = [f"profile over {summary['steps']} steps: {summary['kernels_per_step']:.0f} kernels "
             f"per step; device busy {summary['busy_s_per_step'] * 1e3:.3f} ms, span "
             f"{summary['span_s_per_step'] * 1e3:.3f} ms"
             + (f", wall {wall * 1e3:.3f} ms" if wall else "") + " per step"]
    for row in summary["by_kind"]:
        lines.append(f"  {row['name']:<34} {row['s_per_step'] * 1e3:8.3f} ms "
                     f"{row['calls_per_step']:6.0f} calls")
    for title, rows in (("top kernels", summary["by_name"]),
                        ("top host events (nested events overlap)", summary["host_by_name"])):
        lines.append(f"  {title}:")
        for row in rows[:12]:
            lines.append(f"    {row['s_per_step'] * 1e3:8.3f} ms {row['calls_per_step']:5.0f}x "
                         f"{row['mean_us']:7.1f} us  {row['name'][:90]}")
    return "\n".join(lines)
