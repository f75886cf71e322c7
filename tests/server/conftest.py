"""One OpenAI-compatible server on the tiny test model, shared by the server tests.

It runs in a background thread of the test process on a free loopback port, with an API key, a
small context (128 tokens), a small body limit and short header and body timeouts, so that
every error path is cheap to reach.
"""
from __future__ import annotations

import os
import re

import httpx
import pytest

from tests.conftest import GOLDEN_DIR

TINY_DIR = os.path.join(GOLDEN_DIR, "tiny-llama")
API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 128
MAX_BODY_BYTES = 64 * 1024
MAX_NUM_SEQS = 8
HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="session")
def server():
    """The running ServerThread (its .server is the Server, .url the base address)."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.server.app import Server
    from engine.server.serving import ServerThread
    from quant.loader import load_model

    loaded = load_model(TINY_DIR)
    engine = LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer,
                       EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                                    max_num_batched_tokens=64))
    thread = ServerThread(Server(engine, MODEL, api_key=API_KEY, max_waiting=256,
                                 max_body_bytes=MAX_BODY_BYTES, shutdown_timeout=5.0,
                                 header_timeout=HEADER_TIMEOUT,
                                 body_timeout=BODY_TIMEOUT)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def http(server):
    """An httpx client with the API key set."""
    with httpx.Client(base_url=server.url, timeout=60.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


@pytest.fixture(scope="session")
def client(server):
    """The official openai client (no retries, so every error shows)."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60.0)


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    return 0.0


def sse_events(body: str) -> list[str]:
    """The data fields of a server-sent event stream, in order."""
    return [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
