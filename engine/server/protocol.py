"""The OpenAI API's request and response shapes (plain Python: no jax, no web framework).

`parse_completion` and `parse_chat` check a decoded JSON body field by field and raise
`OpenAIError` (status 400, naming the parameter) on a wrong type, an out-of-range value, a
token id outside the vocabulary or a string that is not valid Unicode (a lone surrogate, which
JSON can spell but UTF-8 cannot encode).
`sampling_params` then builds the engine's SamplingParams once the prompt length is known.
The builders at the bottom shape responses and stream chunks.

Extensions to the OpenAI fields (the names vLLM uses): `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.request import MAX_LOGPROBS, FinishReason, SamplingParams

MAX_N = 16
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


@dataclasses.dataclass
class GenerateRequest:
    """A checked /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" or "chat"
    model: str | None
    prompt_text: str | None = None  # completions: text to encode
    prompt_ids: list[int] | None = None  # completions: token ids as given
    messages: list[dict] | None = None  # chat
    max_tokens: int | None = None  # None: the default of the endpoint
    max_tokens_param: str = "max_tokens"  # the field it came from (errors name it)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top-N logprobs per token (0: only the chosen token's)
    sampling: dict = dataclasses.field(default_factory=dict)  # other SamplingParams fields


# ---- field checks --------------------------------------------------------------------------------

def _type_error(name: str, expected: str, value: Any) -> OpenAIError:
    return bad_request(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.80}",
                       name, "invalid_type")


def _range_error(name: str, allowed: str, value: Any) -> OpenAIError:
    return bad_request(f"'{name}' must be {allowed}, got {value!r:.80}", name, "invalid_value")


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None,
         allowed: str = "") -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _type_error(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _range_error(name, allowed or f"in [{lo}, {hi}]", value)
    return value


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False,
            allowed: str = "") -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    value = float(value)
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        raise _range_error(name, allowed or f"in [{lo:g}, {hi:g}]", value)
    return value


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or a list of strings", value)
    if len(value) > MAX_STOP_STRINGS:
        raise _range_error("stop", f"at most {MAX_STOP_STRINGS} strings", value)
    if any(not s for s in value):
        raise _range_error("stop", "non-empty strings", value)
    return tuple(value)


def _token_ids(value: Any, name: str, vocab_size: int | None) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _type_error(name, "a list of integer token ids", value)
    if vocab_size is not None:
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"'{name}' must hold token ids in the vocabulary [0, {vocab_size}), "
                              f"got {str(bad):.80}", name, "invalid_value")
    return list(value)


def _is_text(s: str) -> bool:
    """Whether `s` is valid Unicode text (no lone surrogate)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_unicode(body: Any) -> None:
    """Rejects a body with a string (a key or a value, anywhere) that is not valid Unicode,
    naming its place as `messages[0].content`. Iterative: the depth of a body is unbounded."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                raise bad_request(f"'{path or 'body'}' is not valid Unicode text: it holds a "
                                  "lone surrogate (such as \\ud800)", path or None,
                                  "invalid_unicode")
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else key
                if not _is_text(key):
                    raise bad_request(f"the key {ascii(key)} in '{path or 'body'}' is not valid "
                                      "Unicode text (a lone surrogate)", path or None,
                                      "invalid_unicode")
                stack.append((item, name))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _reject_unsupported(body: dict) -> None:
    """Fields whose meaning we cannot honor: an error beats silently ignoring them."""
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo", "unsupported")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", "suffix", "unsupported")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias", "unsupported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request("'best_of' is not supported (use 'n')", "best_of", "unsupported")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_request(f"'{name}' (tool calling) is not supported", name, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("only response_format {'type': 'text'} is supported",
                          "response_format", "unsupported")


def _common(body: dict, kind: str, vocab_size: int | None) -> GenerateRequest:
    """The fields both endpoints share."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_unicode(body)
    _reject_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    req = GenerateRequest(kind, model)
    req.stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object", options)
        if not req.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true",
                              "stream_options")
        req.include_usage = bool(_bool(options, "include_usage"))
    s = req.sampling
    s["temperature"] = _number(body, "temperature", 0.0, 2.0)
    s["top_p"] = _number(body, "top_p", 0.0, 1.0, lo_open=True, allowed="in (0, 1]")
    s["n"] = _int(body, "n", 1, MAX_N)
    s["presence_penalty"] = _number(body, "presence_penalty", -2.0, 2.0)
    s["frequency_penalty"] = _number(body, "frequency_penalty", -2.0, 2.0)
    s["repetition_penalty"] = _number(body, "repetition_penalty", 0.0, 10.0, lo_open=True,
                                      allowed="in (0, 10]")
    s["min_p"] = _number(body, "min_p", 0.0, 1.0)
    top_k = _int(body, "top_k", -1, 2**31 - 1, allowed="an integer in [-1, 2**31) (-1 or 0: off)")
    s["top_k"] = None if top_k is None else max(top_k, 0)
    seed = _int(body, "seed", -2**63, 2**64 - 1, allowed="a 64-bit integer")
    s["seed"] = None if seed is None else seed % 2**32
    s["ignore_eos"] = _bool(body, "ignore_eos")
    s["stop"] = _stop_strings(body)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _type_error("stop_token_ids", "a list of integer token ids", stop_ids)
        s["stop_token_ids"] = tuple(_token_ids(stop_ids, "stop_token_ids", vocab_size))
    return req


def parse_completion(body: dict, vocab_size: int | None = None) -> GenerateRequest:
    """Checks a /v1/completions body (token ids against `vocab_size` where given)."""
    req = _common(body, "completion", vocab_size)
    req.max_tokens = _int(body, "max_tokens", 1, None, allowed="an integer >= 1")
    req.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        req.prompt_text = prompt
    elif isinstance(prompt, list):
        if prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise bad_request("a batch of several prompts is not supported: send one request "
                              "per prompt", "prompt", "unsupported")
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        req.prompt_ids = _token_ids(prompt, "prompt", vocab_size)
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    return req


def _message(i: int, m: Any) -> dict:
    name = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _type_error(name, "an object with 'role' and 'content'", m)
    role = m.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise bad_request(f"'{name}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}",
                          f"{name}.role", "invalid_value")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text is understood
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"'{name}.content' parts must be {{'type': 'text', 'text': str}}"
                                  " (only text is supported)", f"{name}.content", "unsupported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise _type_error(f"{name}.content", "a string or a list of text parts", content)
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: dict, vocab_size: int | None = None) -> GenerateRequest:
    """Checks a /v1/chat/completions body (token ids against `vocab_size` where given)."""
    req = _common(body, "chat", vocab_size)
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of messages", messages)
    if not messages:
        raise bad_request("'messages' must hold at least one message", "messages")
    req.messages = [_message(i, m) for i, m in enumerate(messages)]
    req.max_tokens = _int(body, "max_completion_tokens", 1, None, allowed="an integer >= 1")
    if req.max_tokens is not None:
        req.max_tokens_param = "max_completion_tokens"
    else:
        req.max_tokens = _int(body, "max_tokens", 1, None, allowed="an integer >= 1")
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    req.logprobs = (top or 0) if want else None
    return req


def sampling_params(req: GenerateRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The engine's parameters; checks that prompt and output fit in the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens, but this model's context "
                          f"(max_model_len) is {max_model_len} tokens: the prompt must be at most "
                          f"{max_model_len - 1} tokens", "messages" if req.kind == "chat"
                          else "prompt", "context_length_exceeded")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = min(16, room) if req.kind == "completion" else room
    elif max_tokens > room:
        raise bad_request(f"this model's context is {max_model_len} tokens, but {prompt_len + max_tokens}"
                          f" were requested ({prompt_len} in the prompt, {max_tokens} to "
                          "generate): reduce the prompt or max_tokens",
                          req.max_tokens_param, "context_length_exceeded")
    fields = {k: v for k, v in req.sampling.items() if v is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, **fields)
    except ValueError as e:  # the engine's own checks name the parameter first
        param = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param if param.isidentifier() else None, "invalid_value")


# ---- responses ---------------------------------------------------------------------------------

def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class LogprobFormatter:
    """Turns the engine's per-token (logprob, {id: logprob}) into OpenAI's two formats."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False)
                    if self.tokenizer is not None else f"<{token_id}>")
            self._text[token_id] = text
        return text

    def completion(self, token_ids, logprobs, text_offset: int = 0) -> dict:
        """{"tokens", "token_logprobs", "top_logprobs", "text_offset"} of /v1/completions."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, (chosen, top) in zip(token_ids, logprobs):
            text = self.token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(chosen)
            out["top_logprobs"].append({self.token(t): lp for t, lp in top.items()})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out

    def chat(self, token_ids, logprobs) -> dict:
        """{"content": [{"token", "logprob", "bytes", "top_logprobs"}]} of chat completions."""
        def entry(token_id, lp):
            text = self.token(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        return {"content": [entry(t, chosen) | {"top_logprobs": [entry(i, lp)
                                                                  for i, lp in top.items()]}
                            for t, (chosen, top) in zip(token_ids, logprobs)]}


def completion_choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def chat_choice(index: int, text: str, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": reason}


def chat_delta_choice(index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def response(kind: str, request_id: str, created: int, model: str, choices: list,
             usage_: dict | None = None, chunk: bool = False, with_usage: bool = True) -> dict:
    """A whole response, or with `chunk` one stream chunk ("usage" only `with_usage`)."""
    obj = {"completion": "text_completion",
           "chat": "chat.completion.chunk" if chunk else "chat.completion"}[kind]
    out = {"id": request_id, "object": obj, "created": created, "model": model,
           "system_fingerprint": None, "choices": choices}
    if with_usage or not chunk:
        out["usage"] = usage_
    return out
