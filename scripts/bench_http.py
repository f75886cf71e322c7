"""The HTTP mode of scripts/bench_serving.py: the same workload against a running server.

    python -m scripts.serve --model=smollm2-135m --port=8000 &
    python -m scripts.bench_serving --url=http://127.0.0.1:8000 --num_requests=100 --input_len=64 \
        --output_len=64 --max_input_len=256 --max_output_len=256

Each request is a streaming /v1/completions call whose prompt is the workload's token ids, with
`max_tokens` its drawn output length and the server's `ignore_eos` extension, so every request
does the same work as in process. Arrivals follow the same seeded schedule. Time to first token
is the time to the first chunk carrying a token; the output token count comes from the stream's
usage chunk (`stream_options.include_usage`). Prefix hit rate and preemptions are read from the
server's /metrics. Host time per step is only known in process. --warmup=rerun sends the
whole workload once untimed first; otherwise a few warm-up requests go first.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import time

import aiohttp
import numpy as np

WARMUP_REQUESTS = 8


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
               max_tokens: int, delay: float, start: float) -> dict:
    """Sends one streaming request at start + delay; returns its timings or its error."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
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


async def _run(url: str, model: str, prompts, output_lens, arrivals, headers) -> tuple:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     headers=headers) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _one(session, url, model, p, n, a, start)
            for p, n, a in zip(prompts, output_lens, arrivals)))
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


def main(FLAGS, make_workload, summarize, print_table) -> None:
    """Runs bench_serving's workload over HTTP against FLAGS.url; prints and writes JSON."""
    from scripts import common
    url = FLAGS.url.rstrip("/")
    headers = {"Authorization": f"Bearer {FLAGS.api_key}"} if FLAGS.api_key else {}
    try:
        info = json.loads(_get(url, "/v1/models", headers))["data"][0]
    except (OSError, RuntimeError, ValueError, KeyError, IndexError) as e:
        common.fail(f"cannot reach the server's /v1/models at {url}: {e}")
    model, vocab = info["id"], info.get("vocab_size")
    max_model_len = info.get("max_model_len")
    if vocab is None:
        common.fail("the server's /v1/models does not give vocab_size (not a Pallasite server?)")
    longest = FLAGS.shared_prefix_len + FLAGS.max_input_len + FLAGS.max_output_len
    if max_model_len is not None and longest > max_model_len:
        common.fail(f"shared_prefix_len + max_input_len + max_output_len = {longest} exceeds "
                    f"the server's max_model_len {max_model_len}")
    work = make_workload(FLAGS.seed, FLAGS.num_requests, vocab, FLAGS.request_rate)
    # --warmup=rerun: the whole workload once untimed; otherwise (the server compiled its
    # programs at start) a few requests, to open connections and touch the common programs.
    warm = (work if FLAGS.warmup == "rerun"
            else make_workload(FLAGS.seed + 1, WARMUP_REQUESTS, vocab, math.inf))
    asyncio.run(_run(url, model, warm.prompts, warm.output_lens, warm.arrivals, headers))

    before = _get(url, "/metrics", headers)
    results, duration = asyncio.run(_run(url, model, work.prompts, work.output_lens,
                                         work.arrivals, headers))
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
                           - _metric(before, "pallasite_preemptions_total")),
        "host_share_all_steps": None, "host_share_at_max_running": None, "max_running": "-"}
    report = {"url": url, "model": model, "num_requests": FLAGS.num_requests,
              "request_rate": FLAGS.request_rate, "input_len_median": FLAGS.input_len,
              "output_len_median": FLAGS.output_len,
              "mean_input_len": float(np.mean([len(p) for p in work.prompts])),
              "mean_output_len": float(np.mean(work.output_lens)), "continuous": summary}
    print_table(report)
    if errors:
        print(f"{len(errors)} requests failed; first: {errors[0]}")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(report, f, indent=2)
