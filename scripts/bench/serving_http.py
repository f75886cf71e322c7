"""The HTTP mode of the serving benchmark: the same workload against a running server.

Each request is a streaming /v1/completions call whose prompt is the workload's token ids, with
`max_tokens` its drawn output length and the server's `ignore_eos` extension, so every request
does the same work as in process. Time to first token is the time to the first chunk carrying
a token; the output token count comes from the stream's usage chunk. Prefix hit rate and
preemptions are read from the server's /metrics; host time per step is only known in process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time

import aiohttp

from scripts.bench.workload import (Workload, WorkloadSpec, describe, make_workload,
                                   summarize)

WARMUP_REQUESTS = 8


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               max_tokens: int, sampling: dict, delay: float, start: float) -> dict:
    """Sends one streaming request (with its sampling fields, Workload.sampling) at start +
    delay; returns its timings or its error."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **sampling}
    first, tokens = None, 0
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return {"error": f"{response.status}: {(await response.text())[:200]}"}
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"error": chunk["error"].get("message")}
            if chunk.get("choices") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft": (first or end) - sent, "latency": end - sent, "tokens": tokens}


async def _run(url: str, model: str, work: Workload, headers) -> tuple:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _one(session, url, model, p, n, work.sampling(i), a, start)
            for i, (p, n, a) in enumerate(zip(work.prompts, work.output_lens, work.arrivals))))
        return results, time.perf_counter() - start


def _get(url: str, path: str, headers: dict) -> str:
    async def fetch():
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(url + path) as response:
                text = await response.text()
                if response.status != 200:
                    raise RuntimeError(f"GET {path}: {response.status} {text[:200]}")
                return text
    return asyncio.run(fetch())


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else math.nan


def run_http(url: str, api_key: str | None, spec: WorkloadSpec, seed: int,
             rerun_warmup: bool) -> dict:
    """Runs the workload against the server at `url`; returns the report (as the in-process
    mode's, without host figures). ValueError when the server cannot be used. rerun_warmup:
    the whole workload once untimed first; otherwise a few warm-up requests."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = json.loads(_get(url, "/v1/models", headers))["data"][0]
    except (OSError, RuntimeError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"cannot reach the server's /v1/models at {url}: {e}") from None
    model, vocab = info["id"], info.get("vocab_size")
    max_model_len = info.get("max_model_len")
    if vocab is None:
        raise ValueError("the server's /v1/models does not give vocab_size (not a Pallasite "
                         "server?)")
    if max_model_len is not None and spec.longest > max_model_len:
        raise ValueError(f"shared_prefix_len + max_input_len + max_output_len = {spec.longest} "
                         f"exceeds the server's max_model_len {max_model_len}")
    work = make_workload(spec, seed, vocab)
    warm = work if rerun_warmup else make_workload(
        dataclasses.replace(spec, num_requests=WARMUP_REQUESTS, request_rate=math.inf),
        seed + 1, vocab)
    asyncio.run(_run(url, model, warm, headers))

    before = _get(url, "/metrics", headers)
    results, duration = asyncio.run(_run(url, model, work, headers))
    after = _get(url, "/metrics", headers)
    done = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tpot = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    summary = summarize(duration, sum(r["tokens"] for r in done), [r["ttft"] for r in done],
                        tpot, [r["latency"] for r in done])
    summary["requests_per_s"] = len(done) / duration
    summary |= {
        "errors": len(errors), "first_errors": errors[:5],
        "prefix_hit_rate": _metric(after, "pallasite_prefix_cache_hit_rate"),
        "preemptions": int(_metric(after, "pallasite_preemptions_total")
                           - _metric(before, "pallasite_preemptions_total"))}
    return {"mode": "http", "url": url, "model": model} | describe(spec, work) | {
        "continuous": summary}
