"""`python -m scripts.serve` as a subprocess: start-up, and graceful shutdown on SIGTERM."""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
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

    def __init__(self, cache_dir: str, log_path, *flags: str, env: dict | None = None,
                 module: str = "scripts.serve"):
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, f"--model={TINY_DIR}", "--port=0",
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


SHUTDOWN_TIMEOUT = 2.0
HARNESS_MARGIN = 0.3  # signal delivery and this process's polling, on a loaded host


def stalled_reader(url: str) -> socket.socket:
    """A streaming request whose client never reads: with a tiny receive buffer and 20
    logprobs a token, the server's writes block within a few dozen tokens."""
    host, port = url.rsplit("/", 1)[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps(LONG | {"logprobs": 20}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def stalled_body(url: str) -> socket.socket:
    """A request whose body never arrives: its handler is still reading at shutdown."""
    host, port = url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    return sock


def test_sigterm_exits_within_the_timeout_plus_one_second(cache_dir, tmp_path):
    """Three streams still running at the deadline are failed with 503, a fourth whose client
    stopped reading and a fifth whose body never came are cut off, and the process is gone
    within --shutdown_timeout + 1 s of SIGTERM (+ the harness's margin). The server is paced
    (tests/server/paced_serve.py) so that the streams outlast the deadline on a fast host."""
    server = ServeProcess(cache_dir, tmp_path / "serve.log",
                          f"--shutdown_timeout={SHUTDOWN_TIMEOUT}", module="tests.server.paced_serve")
    try:
        firsts = [threading.Event() for _ in range(3)]
        runs = [stream_in_thread(server.url, first) for first in firsts]
        assert all(first.wait(60) for first in firsts)
        stalled = [stalled_reader(server.url), stalled_body(server.url)]
        time.sleep(1.0)  # the reader's writes fill the socket buffers
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        while server.proc.poll() is None and time.monotonic() - start < 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        assert server.proc.returncode == 0
        assert elapsed < SHUTDOWN_TIMEOUT + 1.0 + HARNESS_MARGIN, elapsed
        assert elapsed >= SHUTDOWN_TIMEOUT  # the running requests got their time
        for run in runs:
            run["thread"].join(10)
            events = run["events"]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "service_unavailable" and "shutting down" in error["message"]
        assert "Traceback" not in server.stderr()
        for sock in stalled:
            sock.close()
    finally:
        server.close()


def test_bad_model_is_one_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "scripts.serve", "--model=/no/such/model",
                             "--compilation_cache_dir="], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")]
