"""`python -m scripts.serve` as a subprocess: start-up, and graceful shutdown on SIGTERM."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import TINY_DIR, sse_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 480, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One persistent compilation cache for this module's servers."""
    return str(tmp_path_factory.mktemp("jax_cache"))


class ServeProcess:
    """`scripts.serve` on the tiny model and a free port; the address comes from its stdout."""

    def __init__(self, cache_dir: str, log_path, *flags: str, env: dict | None = None):
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.serve", f"--model={TINY_DIR}", "--port=0",
             "--served_model_name=tiny", "--nowarmup", "--max_model_len=512",
             f"--compilation_cache_dir={cache_dir}", *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=None if env is None else {**os.environ, **env})
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = None
        deadline = time.monotonic() + 120
        while self.url is None:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert line is not None, f"the server exited: {self.stderr()}"
            if line.startswith("serving "):
                self.url = line.split(" on ", 1)[1].split()[0]

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def stream_in_thread(url: str, first_chunk: threading.Event) -> dict:
    """Starts a long streaming request; result['events'] holds its data events at the end."""
    result = {}

    def run():
        with httpx.Client(base_url=url, timeout=120) as client:
            with client.stream("POST", "/v1/completions", json=LONG) as response:
                result["status"] = response.status_code
                body = ""
                for text in response.iter_text():
                    body += text
                    if "data: " in body:
                        first_chunk.set()
                result["events"] = sse_events(body)
        first_chunk.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def test_the_api_key_comes_from_pallasite_api_key(cache_dir, tmp_path):
    """Without --api_key the server requires PALLASITE_API_KEY's key (configs.switches)."""
    server = ServeProcess(cache_dir, tmp_path / "serve.log",
                          env={"PALLASITE_API_KEY": "env-key"})
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.get("/v1/models").status_code == 401
            wrong = client.get("/v1/models", headers={"Authorization": "Bearer other"})
            right = client.get("/v1/models", headers={"Authorization": "Bearer env-key"})
            assert wrong.status_code == 401 and right.status_code == 200
    finally:
        server.close()


def test_sigterm_finishes_running_requests_and_refuses_new_ones(cache_dir, tmp_path):
    server = ServeProcess(cache_dir, tmp_path / "serve.log", "--shutdown_timeout=60")
    try:
        first = threading.Event()
        running = stream_in_thread(server.url, first)
        assert first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        refused = health = None
        with httpx.Client(base_url=server.url, timeout=10) as client:
            deadline = time.monotonic() + 10
            while (refused is None or health is None) and time.monotonic() < deadline:
                response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                if response.status_code == 503:
                    refused = response.json()["error"]
                    health = client.get("/health").status_code
                time.sleep(0.02)
        assert refused is not None and refused["code"] == "service_unavailable"
        assert health == 503
        running["thread"].join(120)
        events = running["events"]
        assert running["status"] == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 480  # it finished
        assert server.proc.wait(60) == 0
        assert "Traceback" not in server.stderr() and "server stopped" in server.stderr()
    finally:
        server.close()


def test_sigterm_aborts_requests_still_running_after_the_timeout(cache_dir, tmp_path):
    server = ServeProcess(cache_dir, tmp_path / "serve.log", "--shutdown_timeout=0.2")
    try:
        first = threading.Event()
        running = stream_in_thread(server.url, first)
        assert first.wait(60)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        running["thread"].join(60)
        events = running["events"]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        assert server.proc.wait(60) == 0
        assert time.monotonic() - start < 30
        assert "Traceback" not in server.stderr()
    finally:
        server.close()


def test_bad_model_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "scripts.serve", "--model=/no/such/model",
                             "--compilation_cache_dir="], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")]
