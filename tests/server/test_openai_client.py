"""The server through the official openai client: completions and chat, streamed and not."""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL, sse_events

PROMPT = "The sea is"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the sea."}]


def streamed_text(stream, n: int = 1) -> tuple[list[str], list[str | None], list]:
    """Texts and finish reasons per choice index, and the chunks, of a completion stream."""
    texts, reasons, chunks = [""] * n, [None] * n, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_stream_equals_whole(client, server):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.prompt_tokens == len(server.server.engine.tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    texts, reasons, chunks = streamed_text(stream)
    assert texts[0] == choice.text and reasons[0] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_completion_from_token_ids(client):
    out = client.completions.create(model=MODEL, prompt=[10, 20, 30, 40], max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 5
    assert out.choices[0].finish_reason == "length"


def test_chat_greedy_stream_equals_whole(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                           max_completion_tokens=20, temperature=0)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                            temperature=0, stream=True)
    texts, reasons, chunks = streamed_text(stream)
    assert texts[0] == message.content and reasons[0] == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_2_gives_two_choices(client, server):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2,
                                    temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 16
    assert out.usage.prompt_tokens == len(server.server.engine.tokenizer.encode(PROMPT))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2,
                                            temperature=1.0, seed=3, stream=True)
    texts, reasons, _ = streamed_text(stream, n=2)
    assert all(reasons) and all(texts)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2,
                                           temperature=1.0, seed=3)
    assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == texts


def test_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(free) > 12, free
    stop = free[6:9]
    expected = free[: free.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    texts, reasons, _ = streamed_text(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}))
    assert texts[0] == expected and reasons[0] == "stop"


def test_seed_gives_the_same_text_twice(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                              temperature=1.0, top_p=0.95, seed=seed,
                                              presence_penalty=0.5, frequency_penalty=0.5
                                              ).choices[0].message.content
    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy: the best token
    _, _, chunks = streamed_text(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks for ch in c.choices for t in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           temperature=0)
    assert plain.choices[0].logprobs is None


def test_raw_stream_is_well_formed(http):
    """The wire format: data lines of JSON chunks, then data: [DONE]."""
    response = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"]
    assert response.text.endswith("data: [DONE]\n\n")
