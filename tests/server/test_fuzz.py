"""Property-based fuzzing of request bodies: arbitrary JSON values, strings (lone surrogates
included) and numbers in every field of both endpoints. Each answer is a 200 or a 4xx with
OpenAI's error object, and the server then serves a normal request.

Bounded: 80 bodies (about half answered 200) on the tiny model, 128-token context, at most
8 tokens a sample: about 15 s on a loaded 2-core host.
"""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL, sse_events

TEXT = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates too
NUMBERS = st.integers() | st.floats() | st.integers(-3, 140) | st.floats(-3, 3)
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(TEXT, inner, max_size=4), max_leaves=8)
TOKEN_IDS = st.lists(st.integers(-2, 300) | st.integers(), max_size=6)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer"]) | JSON,
    "content": TEXT | JSON}), max_size=3)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """A field's value: a plausible one (often valid) or any JSON value."""
    return plausible | JSON


COMMON = {
    "model": field(st.just(MODEL) | TEXT), "max_tokens": field(st.integers(-1, 8)),
    "temperature": field(st.floats(-1, 3)), "top_p": field(st.floats(-0.5, 1.5)),
    "n": field(st.integers(-1, 4)), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
    "stop": field(TEXT | st.lists(TEXT, max_size=3)), "stop_token_ids": field(TOKEN_IDS),
    "seed": field(st.integers()), "top_k": field(st.integers(-2, 300)),
    "min_p": field(st.floats(-1, 2)), "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)), "repetition_penalty": field(st.floats(-1, 11)),
    "ignore_eos": field(st.booleans()), "user": field(TEXT), "logit_bias": JSON,
    "best_of": field(st.integers(-1, 3)), "response_format": JSON, "echo": JSON,
}
ENDPOINTS = {
    "/v1/completions": ({"model": MODEL, "prompt": "hello", "max_tokens": 2}, COMMON | {
        "prompt": field(TEXT | TOKEN_IDS | st.lists(TEXT, max_size=2)),
        "logprobs": field(st.integers(-1, 25)), "suffix": JSON}),
    "/v1/chat/completions": ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}, COMMON | {
        "messages": field(MESSAGES), "max_completion_tokens": field(st.integers(-1, 8)),
        "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 25)),
        "tools": JSON}),
}


@st.composite
def requests(draw) -> tuple[str, object]:
    """An endpoint and a body: a valid one with up to 3 fields fuzzed, or now and then any
    JSON value at all."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    if draw(st.integers(0, 15)) == 0:
        return path, draw(JSON)
    base, fields = ENDPOINTS[path]
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    return path, body


def check_answer(response) -> None:
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert all("error" not in json.loads(e) for e in events[:-1]), events[-3:]
        else:
            assert response.json()["choices"]
        return
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_fuzzed_bodies_get_200_or_an_openai_4xx_and_leak_nothing(http, server):
    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=requests())
    def one_body(request):
        path, body = request
        raw = json.dumps(body).encode()  # ensure_ascii: a surrogate is sent as \ud800
        check_answer(http.post(path, content=raw, headers={"Content-Type": "application/json"}))
        normal = http.post("/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                     "max_tokens": 1})
        assert normal.status_code == 200, normal.text

    one_body()
    engine = server.server.engine
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_pages
    assert server.server.in_flight == 0 and server.server.active == 0
