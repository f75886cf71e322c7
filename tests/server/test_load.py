"""Load: 64 concurrent streaming clients with random prompts, some hanging up early; a soak of
mixed traffic with aborts and bad requests, then a leak check.

Bounded: 64 requests of at most 24 tokens each, on loopback, under a 120 s deadline; the soak
sends traffic for 5 s.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx

from tests.server.conftest import API_KEY, MODEL, metric

NUM_CLIENTS = 64


async def one_client(client: httpx.AsyncClient, rng: random.Random, hang_up_after: int | None):
    """Runs one streaming request; returns (status, data events, hung up)."""
    if rng.random() < 0.5:
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
    else:
        prompt = " ".join(rng.choice(["sea", "sky", "the", "blue", "wind", "a"])
                          for _ in range(rng.randint(1, 20)))
    kind = rng.choice(["completions", "chat/completions"])
    body = {"model": MODEL, "max_tokens": rng.randint(1, 24), "stream": True,
            "stream_options": {"include_usage": True}, "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randrange(1000), "ignore_eos": rng.random() < 0.5}
    if kind == "completions":
        body["prompt"] = prompt
    else:
        text = prompt if isinstance(prompt, str) else "sea " * min(len(prompt), 20)
        body["messages"] = [{"role": "user", "content": text}]
    events = []
    async with client.stream("POST", f"/v1/{kind}", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, [response.text], False
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if hang_up_after is not None and len(events) >= hang_up_after:
                    return 200, events, True  # leaving the block closes the connection
    return 200, events, False


def check_stream(events: list[str]) -> None:
    """A complete stream: JSON chunks of one id, every choice finished, usage, then [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1
    finished = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert len(finished) == 1 and finished[0]["finish_reason"] in ("stop", "length")
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
    token_chunks = [c for c in chunks[:-1] if c["choices"]
                    and "role" not in c["choices"][0].get("delta", {})]
    assert len(token_chunks) == usage["completion_tokens"]  # one chunk per generated token


def server_errors(metrics_text: str) -> float:
    """5xx answers so far, from the request counter."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith("pallasite_http_requests_total") and 'status="5' in line)


def test_64_concurrent_streams_some_hanging_up(server, http):
    rng = random.Random(0)
    hang_ups = [rng.randint(1, 3) if i % 4 == 0 else None for i in range(NUM_CLIENTS)]

    async def run_all():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            return await asyncio.gather(*(one_client(client, random.Random(i), hang_ups[i])
                                          for i in range(NUM_CLIENTS)))

    errors_before = server_errors(http.get("/metrics").text)
    start = time.monotonic()
    results = asyncio.run(asyncio.wait_for(run_all(), timeout=120.0))
    elapsed = time.monotonic() - start
    statuses = [status for status, _, _ in results]
    assert statuses == [200] * NUM_CLIENTS, [r for r in results if r[0] != 200][:3]
    completed = [events for _, events, hung_up in results if not hung_up]
    assert len(completed) >= NUM_CLIENTS * 3 // 4 - 1
    for events in completed:
        check_stream(events)

    deadline = time.monotonic() + 10.0
    while True:  # the hung-up requests are aborted; every page comes back
        text = http.get("/metrics").text
        idle = (metric(text, "pallasite_num_requests_running") == 0
                and metric(text, "pallasite_num_requests_waiting") == 0
                and metric(text, "pallasite_kv_cache_pages_used") == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, text
    assert metric(text, "pallasite_kv_cache_pages_total") > 0
    assert server_errors(text) == errors_before, "5xx answers under load"
    assert elapsed < 120.0


def test_bench_serving_drives_the_server_over_http(server, tmp_path):
    """`scripts.bench.serving --url`: the synthetic workload over HTTP (seeded sampling, half
    the requests with penalties), with the in-process figures."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "scripts.bench.serving", f"--url={server.url}",
         f"--api_key={API_KEY}", "--num_requests=12", "--input_len=8", "--output_len=8",
         "--max_input_len=32", "--max_output_len=32", "--request_rate=50",
         "--penalized_fraction=0.5", "--temperature=0.7", f"--json_out={out}"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "output tokens/s" in result.stdout and "ttft p99 (s)" in result.stdout
    result = json.loads(out.read_text())
    assert result["penalized_fraction"] == 0.5 and result["temperature"] == 0.7
    report = result["continuous"]
    assert report["errors"] == 0 and report["requests_per_s"] > 0
    assert report["output_tokens_per_s"] > 0 and report["ttft_s"]["p50"] > 0
    assert report["tpot_s"]["p90"] is not None and report["preemptions"] == 0


SOAK_SECONDS = 5.0


async def soak_worker(server, client: httpx.AsyncClient, rng: random.Random, until: float,
                      counts: dict) -> None:
    """Mixed traffic until `until`: whole and streamed requests, hang-ups, client timeouts,
    bad bodies and bodies cut off mid-way."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    while time.monotonic() < until:
        kind = rng.choice(["whole", "stream", "hang_up", "timeout", "bad", "cut_body"])
        counts[kind] = counts.get(kind, 0) + 1
        body = {"model": MODEL, "prompt": "the sea " * rng.randint(1, 10),
                "max_tokens": rng.randint(1, 16), "n": rng.choice([1, 1, 2]),
                "temperature": rng.choice([0.0, 0.9]), "ignore_eos": True}
        if kind == "whole":
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        elif kind in ("stream", "hang_up"):
            status, events, _ = await one_client(client, rng, 1 if kind == "hang_up" else None)
            assert status == 200 and events
        elif kind == "timeout":  # the client gives up before the answer
            try:
                await client.post("/v1/completions", json=body | {"max_tokens": 100},
                                  timeout=0.05)
            except httpx.TimeoutException:
                pass
        elif kind == "bad":
            bad = rng.choice([{"stop_token_ids": [2**63]}, {"stop_token_ids": [-1]},
                              {"n": 1000}, {"prompt": [10**6]}, {"temperature": "x"}])
            assert (await client.post("/v1/completions", json=body | bad)).status_code == 400
        else:  # a body that stops half-way, then the connection closes
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         f"{API_KEY}\r\nContent-Length: 500\r\n\r\n{{\"prompt\":".encode())
            await writer.drain()
            writer.close()
            await writer.wait_closed()


def test_soak_mixed_traffic_leaks_nothing(server, http):
    """Sustained mixed traffic with aborts and bad requests; then running 0, waiting 0, no KV
    page held, no sequence counted as admitted, and no 5xx."""
    errors_before = server_errors(http.get("/metrics").text)
    counts: dict = {}

    async def run_all():
        until = time.monotonic() + SOAK_SECONDS
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            await asyncio.gather(*(soak_worker(server, client, random.Random(100 + i), until,
                                               counts) for i in range(12)))

    asyncio.run(asyncio.wait_for(run_all(), timeout=SOAK_SECONDS + 60))
    assert min(counts.values()) >= 2 and len(counts) == 6, counts
    deadline = time.monotonic() + 60.0  # an engine step may be compiling a new shape
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "pallasite_num_requests_running") == 0
                and metric(text, "pallasite_num_requests_waiting") == 0
                and metric(text, "pallasite_kv_cache_pages_used") == 0
                and server.server.active == 0 and server.server.in_flight == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, ([line for line in text.splitlines() if "num_requests" in line or "pages_used" in line],
                  server.server.active, server.server.in_flight, counts)
    assert server_errors(text) == errors_before, "5xx answers in the soak"
    engine = server.server.engine
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_pages
