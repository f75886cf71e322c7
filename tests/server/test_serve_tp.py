"""`scripts.serve --tp=2` over two fake CPU devices answers like one device; several processes
are refused with one clear error."""
from __future__ import annotations

import subprocess
import sys

import httpx

from tests.server.test_shutdown import ROOT, ServeProcess, cache_dir  # noqa: F401 (fixture)

REQUEST = {"model": "tiny", "prompt": "the sea and the", "max_tokens": 12, "temperature": 0,
           "ignore_eos": True, "logprobs": 2}


def completion(server: ServeProcess) -> dict:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        response = client.post("/v1/completions", json=REQUEST)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_tensor_parallel_server_answers_like_one_device(cache_dir, tmp_path,  # noqa: F811
                                                        monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    answers = []
    for flags in ((), ("--tp=2",)):
        server = ServeProcess(cache_dir, tmp_path / f"serve{len(flags)}.log", *flags)
        try:
            answers.append(completion(server))
            if flags:
                assert "mesh: tp=2 x dp=1" in server.stderr()
        finally:
            server.close()
    one, two = answers
    assert one["text"] == two["text"] and one["logprobs"]["tokens"] == two["logprobs"]["tokens"]
    for a, b in zip(one["logprobs"]["token_logprobs"], two["logprobs"]["token_logprobs"]):
        assert abs(a - b) < 1e-4


def test_server_refuses_several_processes():
    result = subprocess.run(
        [sys.executable, "-m", "scripts.serve", "--model=tiny-llama", "--random_weights",
         "--num_processes=2", "--process_id=0", "--coordinator_address=127.0.0.1:1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "one process" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
