"""The aiohttp application: OpenAI routes, /health, /metrics, API key, limits, errors.

Every error is answered in OpenAI's format {"error": {"message", "type", "param", "code"}};
bad input (a wrong field, a lone surrogate, a header that is not UTF-8) never gives a 500, and
an unexpected exception gives a 500 without a stack trace (the trace goes to the server's log).

Admission: a request is refused with 429 only if its sequences would wait beyond `max_waiting`
(sequences admitted and not finished, less the engine's `max_num_seqs` slots, or the engine's
own waiting count when it is short of KV pages); one that could never be admitted is a 400.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import traceback
import uuid

from aiohttp import web

from engine.server import protocol
from engine.server.async_engine import AsyncEngine, EngineRequestError, Finished
from engine.server.chat import ChatEncoder
from engine.server.metrics import ServerMetrics
from engine.server.protocol import OpenAIError, bad_request

log = logging.getLogger("pallasite.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def _dumps(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: JSON's \u escapes can still spell it
        return json.dumps(obj, separators=(",", ":")).encode()


def _header_bytes(value: str) -> bytes | None:
    """A header's bytes as sent (aiohttp decodes headers as UTF-8 with surrogateescape);
    None for a value that no bytes could give."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def error_response(error: OpenAIError) -> web.Response:
    return web.Response(status=error.status, body=_dumps(error.body()),
                        content_type="application/json")


class Server:
    """The server's state: the engine (in its thread), settings, metrics, and the routes."""

    def __init__(self, engine, served_model_name: str, api_key: str | None = None,
                 max_waiting: int = 256, max_body_bytes: int = 1 << 20,
                 shutdown_timeout: float = 30.0, header_timeout: float = 20.0,
                 body_timeout: float = 20.0, special_tokens_in_content: bool = False):
        for name, value, least in (("max_waiting", max_waiting, 1),
                                   ("max_body_bytes", max_body_bytes, 1),
                                   ("shutdown_timeout", shutdown_timeout, 0),
                                   ("header_timeout", header_timeout, 0.001),
                                   ("body_timeout", body_timeout, 0.001)):
            if not value >= least:  # NaN fails too
                raise ValueError(f"{name} must be >= {least}, got {value}")
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key or None
        self.max_waiting = max_waiting
        self.max_body_bytes = max_body_bytes
        self.shutdown_timeout = shutdown_timeout
        self.header_timeout = header_timeout  # the connection's keep-alive / idle limit
        self.body_timeout = body_timeout
        self.metrics = ServerMetrics()
        self.async_engine = AsyncEngine(engine, self.metrics)
        self.max_model_len = engine.engine_cfg.max_model_len
        self.max_num_seqs = engine.engine_cfg.max_num_seqs
        self.vocab_size = engine.cfg.vocab_size
        self.logprob_format = protocol.LogprobFormatter(engine.tokenizer)
        self.chat_encoder = (None if engine.tokenizer is None
                             else ChatEncoder(engine.tokenizer, special_tokens_in_content))
        self.draining = False
        self.in_flight = 0
        self.active = 0  # sequences admitted and not yet finished (the event loop's count)
        self.created = int(time.time())

    # ---- application ----------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self._middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else "other"
        status = 500
        try:
            if request.path.startswith("/v1/"):
                self._check_api_key(request)
            response = await handler(request)
            status = response.status
            return response
        except OpenAIError as e:
            status = e.status
            return error_response(e)
        except web.HTTPException as e:  # unknown route, wrong method, ...
            status = e.status
            kind = "not_found_error" if e.status == 404 else "invalid_request_error"
            return error_response(OpenAIError(e.status, f"{e.reason}: {request.method} "
                                              f"{request.path}", kind))
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        except Exception as e:  # noqa: BLE001
            log.error("internal error on %s %s:\n%s", request.method, request.path,
                      traceback.format_exc())
            status = 500
            return error_response(OpenAIError(500, f"internal server error: {type(e).__name__}",
                                              "server_error"))
        finally:
            self.metrics.http_requests.labels(endpoint, str(status)).inc()

    def _check_api_key(self, request: web.Request) -> None:
        if self.api_key is None:
            return
        header = _header_bytes(request.headers.get("Authorization", "")) or b""
        scheme, _, key = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(),
                                                                  self.api_key.encode()):
            raise OpenAIError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                              "<key>'", "invalid_request_error", None, "invalid_api_key")

    # ---- simple routes --------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.async_engine.alive:
            return web.json_response({"status": "unhealthy", "error": self.async_engine.error},
                                     status=503)
        if self.draining:
            return web.json_response({"status": "shutting down"}, status=503)
        return web.json_response({"status": "ok"})

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.headers["Content-Type"] = self.metrics.content_type
        return response

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.engine.cfg
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "pallasite", "max_model_len": self.max_model_len,
            "vocab_size": cfg.vocab_size}]})

    # ---- generation -----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_chat)

    async def _read_json(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise OpenAIError(413, f"the request body has {request.content_length} bytes; the "
                              f"limit is {self.max_body_bytes}", code="request_too_large")
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            raise OpenAIError(413, f"the request body exceeds {self.max_body_bytes} bytes",
                              code="request_too_large") from None
        except asyncio.TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within "
                              f"{self.body_timeout:g} s", code="request_timeout") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise bad_request(f"the request body is not valid JSON: {e}", None,
                              "invalid_json") from None

    def _check_admitting(self) -> None:
        if self.draining:
            raise OpenAIError(503, "the server is shutting down", "server_error", None,
                              "service_unavailable")
        if not self.async_engine.alive:
            raise OpenAIError(503, f"the engine is not serving: {self.async_engine.error}",
                              "server_error", None, "service_unavailable")

    def _encode(self, req: protocol.GenerateRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if req.prompt_ids is not None:
            return req.prompt_ids
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send the prompt as token ids",
                              "messages" if req.kind == "chat" else "prompt")
        if req.kind == "completion":
            return tokenizer.encode(req.prompt_text, add_special_tokens=True)
        try:
            return self.chat_encoder.encode(req.messages)
        except Exception as e:  # noqa: BLE001 - a template's own raise_exception, bad roles, ...
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") \
                from None

    def _reserve(self, n: int) -> None:
        """Admits `n` sequences (429 if they would wait beyond max_waiting, 400 if they never
        could); the caller releases them with `self.active -= n`. No await in between: the
        check and the count are one step of the event loop."""
        most = self.max_num_seqs + self.max_waiting
        if n > most:
            raise bad_request(f"'n' is {n}, but at most {most} sequences are admitted at once "
                              f"({self.max_num_seqs} running and {self.max_waiting} waiting): "
                              "this request can never be admitted", "n", "invalid_value")
        queued = self.async_engine.num_waiting  # > 0: the engine is short of slots or pages
        waiting = max(self.active + n - self.max_num_seqs, queued + n if queued else 0)
        if waiting > self.max_waiting:
            raise OpenAIError(429, f"too many requests: this one would leave {waiting} sequences "
                              f"waiting for a slot (limit {self.max_waiting}); retry later",
                              "rate_limit_error", None, "rate_limit_exceeded")
        self.active += n

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        arrival = time.perf_counter()
        self._check_admitting()
        req = parse(await self._read_json(request), self.vocab_size)
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(400, f"the model '{req.model}' does not exist; this server serves "
                              f"'{self.model_name}'", "invalid_request_error", "model",
                              "model_not_found")
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(None, self._encode, req)
        params = protocol.sampling_params(req, len(prompt_ids), self.max_model_len)
        self._check_admitting()  # the server may have begun draining while this one encoded
        self._reserve(params.n)
        self.in_flight += 1
        stream = None
        try:
            try:
                stream = await self.async_engine.submit(prompt_ids, params)
            except ValueError as e:  # the engine's own checks (vocabulary, pool size)
                raise bad_request(str(e), "messages" if req.kind == "chat" else "prompt") \
                    from None
            except EngineRequestError as e:
                raise self._engine_error(e) from None
            run = _Run(self, req, stream, arrival, len(prompt_ids))
            if req.stream:
                return await run.streamed(request)
            return await run.collect()
        finally:
            self.in_flight -= 1
            self.active -= params.n
            if stream is not None and not stream.done:
                self.async_engine.abort(stream)
                self.metrics.finished.labels("abort").inc()

    def _engine_error(self, e: EngineRequestError) -> OpenAIError:
        return OpenAIError(e.status, str(e), "server_error", None,
                           "service_unavailable" if e.status == 503 else "internal_error")

    # ---- shutdown -------------------------------------------------------------------------------

    async def drain(self, grace: float = 0.3) -> None:
        """Stops admitting (503), lets running requests finish within shutdown_timeout, then
        fails the rest with 503 and gives their handlers at most `grace` seconds to send it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.in_flight:
            log.warning("aborting %d requests still running after %.1fs", self.in_flight,
                        self.shutdown_timeout)
            self.async_engine.abort_all(503, "the server is shutting down")
            deadline = loop.time() + grace
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.02)


class _Run:
    """One generation request being answered, whole or as a stream."""

    def __init__(self, server: Server, req: protocol.GenerateRequest, stream, arrival: float,
                 prompt_len: int):
        self.server, self.req, self.stream = server, req, stream
        self.arrival, self.prompt_len = arrival, prompt_len
        self.first_token: float | None = None
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())

    async def _next(self):
        item = await self.stream.next()
        if self.first_token is None and not isinstance(item, Finished) and item.token_ids:
            self.first_token = time.perf_counter()
        return item

    def _record(self, output) -> dict:
        """Metrics of a finished request; returns its usage figures."""
        m, end = self.server.metrics, time.perf_counter()
        generated = [len(o.token_ids) for o in output.outputs]
        for o in output.outputs:
            m.finished.labels(protocol.finish_reason(o.finish_reason) or "unknown").inc()
        m.prompt_tokens.inc(self.prompt_len)
        m.generation_tokens.inc(sum(generated))
        m.e2e.observe(end - self.arrival)
        if self.first_token is not None:
            m.ttft.observe(self.first_token - self.arrival)
            if max(generated) > 1:
                m.tpot.observe((end - self.first_token) / (max(generated) - 1))
        return protocol.usage(self.prompt_len, sum(generated))

    def _logprobs(self, token_ids, logprobs, offset: int = 0):
        if self.req.logprobs is None or not logprobs:
            return None
        fmt = self.server.logprob_format
        return (fmt.chat(token_ids, logprobs) if self.req.kind == "chat"
                else fmt.completion(token_ids, logprobs, offset))

    async def collect(self) -> web.Response:
        try:
            while not isinstance(item := await self._next(), Finished):
                pass
        except EngineRequestError as e:
            self.server.metrics.finished.labels("error").inc()
            raise self.server._engine_error(e) from None
        output = item.output
        usage = self._record(output)
        choice = protocol.chat_choice if self.req.kind == "chat" else protocol.completion_choice
        choices = [choice(o.index, o.text, self._logprobs(o.token_ids, o.logprobs),
                          protocol.finish_reason(o.finish_reason)) for o in output.outputs]
        body = protocol.response(self.req.kind, self.id, self.created, self.server.model_name,
                                 choices, usage)
        return web.Response(body=_dumps(body), content_type="application/json")

    def _chunk(self, choices, usage=None) -> bytes:
        body = protocol.response(self.req.kind, self.id, self.created, self.server.model_name,
                                 choices, usage, chunk=True, with_usage=self.req.include_usage)
        return b"data: " + _dumps(body) + b"\n\n"

    @staticmethod
    async def _write_error(response: web.StreamResponse, error: OpenAIError) -> None:
        """An error after the stream began: an error event, then the usual end."""
        try:
            await response.write(b"data: " + _dumps(error.body()) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            pass

    async def streamed(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        chat = self.req.kind == "chat"
        n = self.stream.params.n
        offsets = [0] * n
        try:
            if chat:
                await response.write(self._chunk([protocol.chat_delta_choice(
                    i, {"role": "assistant", "content": ""}, None, None) for i in range(n)]))
            while not isinstance(item := await self._next(), Finished):
                reason = protocol.finish_reason(item.finish_reason)
                logprobs = self._logprobs(item.token_ids, item.logprobs, offsets[item.index])
                offsets[item.index] += len(item.text)
                if chat:
                    delta = {"content": item.text} if item.text or reason is None else {}
                    choice = protocol.chat_delta_choice(item.index, delta, logprobs, reason)
                else:
                    choice = protocol.completion_choice(item.index, item.text, logprobs, reason)
                await response.write(self._chunk([choice]))
            usage = self._record(item.output)
            if self.req.include_usage:
                await response.write(self._chunk([], usage))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except EngineRequestError as e:
            self.server.metrics.finished.labels("error").inc()
            await self._write_error(response, self.server._engine_error(e))
        except ConnectionError:  # the client went away: the caller aborts the request
            pass
        except Exception as e:  # noqa: BLE001 - the headers are sent: report it in the stream
            log.error("internal error in a stream:\n%s", traceback.format_exc())
            self.server.metrics.finished.labels("error").inc()
            await self._write_error(response, OpenAIError(
                500, f"internal server error: {type(e).__name__}", "server_error"))
        return response
