"""The serving benchmark's workload (seeded long-tailed lengths, random-token prompts, Poisson or
simultaneous arrivals), its latency summary and its printed table; shared by the in-process and
the HTTP modes."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from scripts.bench.common import markdown_table


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    request_rate: float  # requests/s; inf: all at once
    input_len: int  # median prompt tokens
    output_len: int  # median output tokens
    len_sigma: float  # sigma of the log-normal lengths
    max_input_len: int
    max_output_len: int
    shared_prefix_len: int = 0  # tokens of a system prompt shared by every request
    penalized_fraction: float = 0.0  # share of the requests that send PENALTIES
    temperature: float = 0.0  # every request's sampling temperature (0: greedy)

    def __post_init__(self):
        if not 0.0 <= self.penalized_fraction <= 1.0:
            raise ValueError(f"penalized_fraction must be in [0, 1], got "
                             f"{self.penalized_fraction}")
        if not 0.0 <= self.temperature <= 2.0:  # OpenAI's range
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        for what, median, longest in (("input", self.input_len, self.max_input_len),
                                      ("output", self.output_len, self.max_output_len)):
            if median > longest:  # the lengths would all be cut to the longest, silently
                raise ValueError(f"{what}_len {median} exceeds max_{what}_len {longest}: "
                                 f"raise --max_{what}_len to at least {median}")

    @property
    def longest(self) -> int:
        return self.shared_prefix_len + self.max_input_len + self.max_output_len


# The penalties a penalized request sends (typical of chat clients; repetition_penalty is the
# server's extension, the other two OpenAI's fields).
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds from the start
    penalized: list[bool]  # the request sends PENALTIES
    temperature: float = 0.0

    def sampling(self, i: int) -> dict:
        """Request i's sampling fields (SamplingParams' and the OpenAI API's names): greedy,
        or the temperature with the request's index as its seed (the same tokens every run),
        and PENALTIES where it is penalized."""
        fields = {"temperature": self.temperature}
        if self.temperature > 0:
            fields["seed"] = i
        return fields | (PENALTIES if self.penalized[i] else {})


def make_workload(spec: WorkloadSpec, seed: int, vocab: int) -> Workload:
    """Seeded log-normal prompt and output lengths, random token prompts, arrivals Poisson at
    spec.request_rate (or all at once)."""
    rng = np.random.default_rng(seed)

    def lengths(median, longest, shortest):
        drawn = rng.lognormal(math.log(median), spec.len_sigma, spec.num_requests)
        return np.clip(np.round(drawn), shortest, longest).astype(int).tolist()

    prefix = rng.integers(0, vocab, spec.shared_prefix_len).tolist()
    prompts = [prefix + rng.integers(0, vocab, n).tolist()
               for n in lengths(spec.input_len, spec.max_input_len, 4)]
    outputs = lengths(spec.output_len, spec.max_output_len, 1)
    rate = spec.request_rate
    gaps = np.zeros(spec.num_requests) if math.isinf(rate) else rng.exponential(
        1.0 / rate, spec.num_requests)
    fraction = spec.penalized_fraction  # evenly spread: where the count of fraction steps up
    penalized = [int((i + 1) * fraction) > int(i * fraction) for i in range(spec.num_requests)]
    return Workload(prompts, outputs, np.cumsum(gaps).tolist(), penalized, spec.temperature)


def describe(spec: WorkloadSpec, work: Workload) -> dict:
    """The workload's figures for the JSON."""
    return {"num_requests": spec.num_requests, "request_rate": spec.request_rate,
            "input_len_median": spec.input_len, "output_len_median": spec.output_len,
            "penalized_fraction": spec.penalized_fraction, "temperature": spec.temperature,
            "mean_input_len": float(np.mean([len(p) for p in work.prompts])),
            "mean_output_len": float(np.mean(work.output_lens))}


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    if not len(values):
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def summarize(duration: float, useful: int, ttft, tpot, latency) -> dict:
    return {"duration_s": duration, "requests_per_s": len(ttft) / duration,
            "output_tokens_per_s": useful / duration, "ttft_s": percentiles(ttft),
            "tpot_s": percentiles(tpot), "latency_s": percentiles(latency)}


def _fmt(x, digits=3):
    return None if x is None else f"{x:.{digits}f}"


def serving_table(results: dict) -> str:
    """Continuous batching against the static baseline (when run), then the engine's host
    shares (in process only)."""
    c, s = results["continuous"], results.get("static") or {}
    rows = [["requests/s", _fmt(c["requests_per_s"]), _fmt(s.get("requests_per_s"))],
            ["output tokens/s", _fmt(c["output_tokens_per_s"], 1),
             _fmt(s.get("output_tokens_per_s"), 1)]]
    for metric in ("ttft_s", "tpot_s", "latency_s"):
        for q in ("p50", "p90", "p99"):
            rows.append([f"{metric[:-2]} {q} (s)", _fmt(c[metric][q], 4),
                         _fmt((s.get(metric) or {}).get(q), 4)])
    rows.append(["prefix hit rate", _fmt(c.get("prefix_hit_rate")), None])
    rows.append(["preemptions", c.get("preemptions"), None])
    running = c.get("max_running")
    for name, key in (("host share", "host_share"), ("exposed host share", "exposed_host_share")):
        if c.get(f"{key}_all_steps") is None:
            continue
        rows.append([f"{name} of step", _fmt(c[f"{key}_all_steps"]), None])
        rows.append([f"{name} at {running} running", _fmt(c.get(f"{key}_at_max_running")), None])
        rows.append([f"{name} while saturated", _fmt(c.get(f"{key}_saturated")), None])
    text = markdown_table(["", "continuous", "static"], rows)
    if s:
        text += (f"\ncontinuous / static throughput: "
                 f"{c['output_tokens_per_s'] / s['output_tokens_per_s']:.2f}x")
    return text
