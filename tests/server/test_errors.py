"""Bad input, limits and failures: each gives its status and an OpenAI-format error body, and the
server keeps serving afterwards."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import MAX_BODY_BYTES, MAX_MODEL_LEN, MODEL, metric, sse_events

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


def test_too_many_waiting_gives_429(server, http):
    limit = server.server.max_waiting
    server.server.max_waiting = 0  # every new request would exceed it
    try:
        assert_openai_error(http.post("/v1/completions", json=completion()), 429,
                            code="rate_limit_exceeded")
    finally:
        server.server.max_waiting = limit
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
