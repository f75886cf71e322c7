"""Bad input, limits and failures: each gives its status and an OpenAI-format error body, and the
server keeps serving afterwards."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from engine.request import SamplingParams
from tests.server.conftest import (API_KEY, BODY_TIMEOUT, HEADER_TIMEOUT, MAX_BODY_BYTES,
                                   MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL, metric, sse_events)

MESSAGES = [{"role": "user", "content": "hi"}]


def assert_openai_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4} | fields


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4} | fields


@pytest.mark.parametrize("path, body, param", [
    # wrong types
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", completion(max_tokens="5"), "max_tokens"),
    ("/v1/completions", completion(max_tokens=2.5), "max_tokens"),
    ("/v1/completions", completion(prompt=5), "prompt"),
    ("/v1/completions", completion(prompt=[1, "a"]), "prompt"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(stop=[1]), "stop"),
    ("/v1/completions", completion(n=True), "n"),
    ("/v1/chat/completions", chat(messages="hi"), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 3}]),
     "messages[0].content"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]),
     "messages[0].role"),
    ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    # missing fields
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    # out of range
    ("/v1/completions", completion(temperature=3), "temperature"),
    ("/v1/completions", completion(temperature=-0.1), "temperature"),
    ("/v1/completions", completion(top_p=0), "top_p"),
    ("/v1/completions", completion(top_p=1.5), "top_p"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(n=1000), "n"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(logprobs=21), "logprobs"),
    ("/v1/completions", completion(top_k=2**40), "top_k"),
    ("/v1/completions", completion(max_tokens=10**30), "max_tokens"),
    ("/v1/completions", completion(prompt=[-1, 5]), "prompt"),
    ("/v1/completions", completion(presence_penalty=2.5), "presence_penalty"),
    ("/v1/completions", completion(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", completion(stop=[""]), "stop"),
    ("/v1/completions", completion(prompt=[1, 99999]), "prompt"),
    ("/v1/chat/completions", chat(top_logprobs=3), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("/v1/chat/completions", chat(max_completion_tokens=-1), "max_completion_tokens"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), "stream_options"),
    # integers beyond int64 and token ids outside the vocabulary, in every integer field
    ("/v1/completions", completion(prompt=[5, 2**63]), "prompt"),
    ("/v1/completions", completion(prompt=[5, 1_000_000]), "prompt"),
    ("/v1/completions", completion(n=2**63), "n"),
    ("/v1/completions", completion(top_k=2**63), "top_k"),
    ("/v1/completions", completion(seed=2**70), "seed"),
    ("/v1/completions", completion(logprobs=2**63), "logprobs"),
    ("/v1/completions", completion(max_tokens=2**63), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=2**63), "max_completion_tokens"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-2**63 - 1), "top_logprobs"),
    ("/v1/chat/completions", chat(n=10**30), "n"),
    # unsupported
    ("/v1/completions", completion(echo=True), "echo"),
    ("/v1/completions", completion(prompt=["a", "b"]), "prompt"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools"),
])
def test_bad_fields_give_400(http, path, body, param):
    assert_openai_error(http.post(path, json=body), 400, param=param)


def test_malformed_json_gives_400(http):
    for raw in (b"{bad json", b"", b"\xff\xfe", b"[1, 2]", b"null", b"[" * 50_000,
                b'{"prompt": "x", "temperature": NaN}'):
        assert_openai_error(http.post("/v1/chat/completions", content=raw,
                                      headers={"Content-Type": "application/json"}), 400)
    assert_still_serving(http)


def test_prompt_longer_than_the_context_gives_400(http):
    long_ids = list(range(3, 3 + MAX_MODEL_LEN))
    assert_openai_error(http.post("/v1/completions", json=completion(prompt=long_ids)), 400,
                        "prompt", "context_length_exceeded")
    assert_openai_error(http.post("/v1/chat/completions", json=chat(
        messages=[{"role": "user", "content": "word " * 500}])), 400, "messages",
        "context_length_exceeded")
    assert_openai_error(http.post("/v1/completions", json=completion(max_tokens=MAX_MODEL_LEN)),
                        400, "max_tokens", "context_length_exceeded")
    assert_still_serving(http)


def test_unknown_model_gives_400_model_not_found(http, client):
    assert_openai_error(http.post("/v1/completions", json=completion(model="gpt-17")), 400,
                        "model", "model_not_found")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert_still_serving(http)


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", temperature=9)
    assert info.value.body["param"] == "temperature"


def test_api_key_is_required(server, http):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic test-key"}):
        with httpx.Client(base_url=server.url, headers=headers) as anonymous:
            assert_openai_error(anonymous.post("/v1/completions", json=completion()), 401,
                                code="invalid_api_key")
            assert_openai_error(anonymous.get("/v1/models"), 401)
            assert anonymous.get("/health").status_code == 200  # probes need no key
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert_still_serving(http)


def test_body_too_large_gives_413(http):
    big = completion(prompt="a" * (MAX_BODY_BYTES + 10))
    assert_openai_error(http.post("/v1/completions", json=big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit holds while reading
        yield json.dumps(big).encode()
    assert_openai_error(http.post("/v1/completions", content=chunked()), 413)
    assert_still_serving(http)


@pytest.fixture
def max_waiting_4(server):
    """The shared server with 4 waiting places for the test's duration."""
    limit = server.server.max_waiting
    server.server.max_waiting = 4
    yield 4
    server.server.max_waiting = limit


@pytest.fixture
def slow_steps(server):
    """Engine steps of at least 20 ms, so requests overlap however fast the host is."""
    engine = server.server.engine
    original = engine.step

    def slow_step():
        time.sleep(0.02)
        return original()

    engine.step = slow_step
    yield
    engine.step = original


def burst(server, count: int, max_tokens: int) -> list[int]:
    """Statuses of `count` completions sent at the same moment."""
    async def run():
        limits = httpx.Limits(max_connections=count + 4)
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=completion(
                max_tokens=max_tokens, ignore_eos=True)) for _ in range(count)))
        for r in responses:
            if r.status_code != 200:
                assert_openai_error(r, 429, code="rate_limit_exceeded")
        return [r.status_code for r in responses]
    return asyncio.run(run())


def test_simultaneous_arrivals_fill_the_slots_and_the_waiting_places(server, http, max_waiting_4,
                                                                     slow_steps):
    """8 slots + 4 waiting places: 12 simultaneous requests to an idle server all run; of 30,
    the 12 that fit run and the others get 429 (none finishes before the last arrives)."""
    assert burst(server, MAX_NUM_SEQS + 4, 4) == [200] * (MAX_NUM_SEQS + 4)
    statuses = burst(server, 30, 60)
    assert statuses.count(200) >= MAX_NUM_SEQS + 4 and 429 in statuses, statuses
    assert_still_serving(http)


def test_n_that_can_never_be_admitted_gives_400(http, max_waiting_4):
    assert_openai_error(http.post("/v1/completions", json=completion(n=MAX_NUM_SEQS + 5)), 400,
                        "n", "invalid_value")
    response = http.post("/v1/completions", json=completion(n=MAX_NUM_SEQS + 4, max_tokens=2))
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_NUM_SEQS + 4


def test_too_many_waiting_gives_429(server, http, max_waiting_4):
    """With every slot and waiting place reserved, the next request is refused for now."""
    server.server.active += MAX_NUM_SEQS + 4  # as if 12 sequences were admitted
    try:
        assert_openai_error(http.post("/v1/completions", json=completion()), 429,
                            code="rate_limit_exceeded")
    finally:
        server.server.active -= MAX_NUM_SEQS + 4
    assert_still_serving(http)


BAD_STOP_IDS = [2**63, 10**30, -1, -2**63 - 1, 1_000_000]


@pytest.mark.parametrize("stop_id", BAD_STOP_IDS)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_stop_token_ids_give_400_and_poison_nothing(http, server, path, stop_id):
    body = (completion if path == "/v1/completions" else chat)(stop_token_ids=[5, stop_id])
    error = assert_openai_error(http.post(path, json=body), 400, "stop_token_ids",
                                "invalid_value")
    assert "vocabulary" in error["message"]
    # a stop id never seen before still works: the rejected request left no state behind
    fresh = 17 + BAD_STOP_IDS.index(stop_id) + (0 if path == "/v1/completions" else 50)
    response = http.post(path, json=body | {"stop_token_ids": [fresh]})
    assert response.status_code == 200, response.text
    assert not server.server.engine.has_unfinished()


def test_the_engine_rejects_out_of_vocabulary_stop_ids(server):
    engine = server.server.engine
    for stop_id in (-1, engine.cfg.vocab_size):
        with pytest.raises(ValueError, match="stop_token_ids.*vocabulary"):
            engine.add_request([5, 6], SamplingParams(max_tokens=2, stop_token_ids=(stop_id,)))


SURROGATE = "a\\ud800b"  # JSON text for a lone surrogate


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model":"tiny","prompt":"%s"}', "prompt"),
    ("/v1/completions", '{"model":"%s","prompt":"hi"}', "model"),
    ("/v1/completions", '{"model":"tiny","prompt":"hi","stop":["%s"]}', "stop[0]"),
    ("/v1/completions", '{"model":"tiny","prompt":["%s"]}', "prompt[0]"),
    ("/v1/completions", '{"model":"tiny","prompt":"hi","user":"%s"}', "user"),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"%s"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":[{"type":'
     '"text","text":"%s"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"%s","content":"x"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", '{"model":"%s","messages":[{"role":"user","content":"x"}]}',
     "model"),
    ("/v1/chat/completions", '{"model":"tiny","messages":[{"role":"user","content":"x"}],'
     '"stop":"%s"}', "stop"),
])
def test_lone_surrogates_give_400(http, path, body, param):
    raw = (body % SURROGATE).encode()
    error = assert_openai_error(http.post(path, content=raw,
                                          headers={"Content-Type": "application/json"}),
                                400, param, "invalid_unicode")
    assert "Unicode" in error["message"]


def test_lone_surrogates_in_keys_and_raw_bytes_give_400(http):
    for raw in (b'{"model":"tiny","prompt":"hi","\\udc80":1}',
                b'{"model":"tiny","prompt":"a\xed\xa0\x80b"}'):  # UTF-8 bytes of a surrogate
        assert_openai_error(http.post("/v1/completions", content=raw,
                                      headers={"Content-Type": "application/json"}), 400)
    assert_still_serving(http)


@pytest.mark.parametrize("name", ["Authorization", "X-Custom", "User-Agent", "Content-Type",
                                  "OpenAI-Organization"])
def test_headers_that_are_not_utf8(server, http, name):
    value = b"Bearer \xff\xfe\xed\xa0\x80" if name == "Authorization" else b"\xff\xfe\x80"
    headers = {"Authorization": f"Bearer {API_KEY}".encode(), name: value}
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        response = client.post("/v1/completions", json=completion(max_tokens=2), headers=headers)
        if name == "Authorization":
            assert_openai_error(response, 401, code="invalid_api_key")
            assert_openai_error(client.get("/v1/models", headers=headers), 401)
        else:
            assert response.status_code == 200, response.text
    assert_still_serving(http)


def connection_closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`; and what it sent."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, received
        if not data:
            return True, received
        received += data
    return False, received


def test_stalled_and_trickling_request_heads_are_closed(server, http):
    host, port = server.url.rsplit("/", 1)[1].split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {API_KEY}\r\n").encode()
    silent = socket.create_connection((host, int(port)))  # connects, sends nothing
    stalled = socket.create_connection((host, int(port)))
    stalled.sendall(head)
    trickle = socket.create_connection((host, int(port)))
    start = time.monotonic()
    for i in range(int(HEADER_TIMEOUT / 0.25) + 4):  # a byte every 0.25 s, never the blank line
        try:
            trickle.sendall(b"X-Slow: %d\r\n" % i)
        except OSError:
            break
        time.sleep(0.25)
    for sock in (silent, stalled, trickle):
        closed, _ = connection_closed_within(sock, HEADER_TIMEOUT + 5 - (time.monotonic() - start))
        assert closed
        sock.close()
    assert time.monotonic() - start < HEADER_TIMEOUT + 5
    assert_still_serving(http)


def test_stalled_request_body_gives_408(server, http):
    host, port = server.url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    start = time.monotonic()
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}"
                  f"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                  '{"prompt": "').encode())
    closed, received = connection_closed_within(sock, BODY_TIMEOUT + 15)
    sock.close()
    assert closed and received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b'"code":"request_timeout"' in received
    assert time.monotonic() - start < BODY_TIMEOUT + 15  # the body timeout + aiohttp's lingering
    assert_still_serving(http)


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_engine_failure_fails_its_requests_with_500_and_serving_goes_on(server, http):
    engine = server.server.engine
    original = engine.step

    def broken_step():
        engine.step = original  # fail once
        raise RuntimeError("injected fault")

    engine.step = broken_step
    assert_openai_error(http.post("/v1/completions", json=completion()), 500,
                        code="internal_error")
    engine.step = broken_step
    response = http.post("/v1/completions", json=completion(stream=True))
    events = sse_events(response.text)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "internal_error"
    assert engine.pool.num_free == engine.pool.num_pages
    assert_still_serving(http)
    text = http.get("/metrics").text
    assert metric(text, "pallasite_engine_healthy") == 1.0
    assert metric(text, "pallasite_requests_finished_total", reason="error") >= 2


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(server, http, stream):
    engine = server.server.engine
    original = engine.step

    def slow_step():  # 100 tokens take 3 s or more: the request is surely running at hang-up
        time.sleep(0.03)
        return original()

    before = metric(http.get("/metrics").text, "pallasite_requests_finished_total",
                    reason="abort")
    body = completion(prompt="once upon a time", max_tokens=100, stream=stream, ignore_eos=True)
    engine.step = slow_step
    try:
        if stream:  # hang up after the first chunk
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                assert metric(http.get("/metrics").text, "pallasite_kv_cache_pages_used") > 0
        else:  # give up waiting for the whole answer
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=1.0)
    finally:
        engine.step = original
    # the connection is closed: the request is aborted and its pages freed within moments
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if (metric(text, "pallasite_kv_cache_pages_used") == 0
                and metric(text, "pallasite_num_requests_running") == 0):
            break
        time.sleep(0.02)
    assert metric(text, "pallasite_kv_cache_pages_used") == 0
    assert metric(text, "pallasite_requests_finished_total", reason="abort") == before + 1
    assert engine.pool.num_free == engine.pool.num_pages
    assert_still_serving(http)
