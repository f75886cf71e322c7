"""The engine loop in its own thread, fed from an asyncio event loop.

Only the engine thread touches the LLMEngine. The event loop hands it commands (add, abort,
abort all, stop) through a thread-safe queue; the thread answers each request on that request's
own asyncio queue with `loop.call_soon_threadsafe`, once per step for all requests together. So the
event loop never waits on the model, and the model never waits on a slow client.

An exception inside a step fails the requests then in the engine with status 500 and the loop goes
on; if the engine cannot be brought back to a clean state (or fails several steps in a row) it is
marked unhealthy and new requests get 503.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import traceback
import weakref

from engine.request import RequestOutput, SamplingParams
from engine.warmup import in_callers_context

log = logging.getLogger("pallasite.server")

MAX_CONSECUTIVE_FAILURES = 3


class EngineRequestError(Exception):
    """A request that the engine could not finish: `status` 500 (engine error) or 503."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Finished:
    """The last item of a request's stream: its whole output."""

    output: RequestOutput


class RequestStream:
    """One request as the event loop sees it: the engine's deltas arrive on `queue`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int],
                 params: SamplingParams, priority: int = 0):
        self.prompt_ids, self.params, self.priority = prompt_ids, params, priority
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admitted: asyncio.Future = loop.create_future()
        self.engine_id: int | None = None  # written by the engine thread
        self.done = False  # the final item (output or error) was taken

    async def next(self):
        """The next StreamDelta, or Finished; raises EngineRequestError if the request failed."""
        item = await self.queue.get()
        if isinstance(item, EngineRequestError):
            self.done = True
            raise item
        if isinstance(item, Finished):
            self.done = True
        return item


class AsyncEngine:
    """Runs `engine.step()` in a thread while requests come and go from an event loop."""

    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.healthy = True
        self.error: str | None = None
        self.num_waiting = 0  # sequences waiting in the engine (a snapshot)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[int, RequestStream] = {}  # engine request id -> stream (thread only)
        self._live: weakref.WeakSet = weakref.WeakSet()  # admitted streams (event loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failures = 0

    # ---- event-loop side ------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # The engine's steps run under the starting thread's jax settings, those its warm-up
        # compiled with.
        self._thread = threading.Thread(target=in_callers_context(self._run),
                                        name="pallasite-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.healthy and self._thread is not None and self._thread.is_alive()

    async def submit(self, prompt_ids: list[int], params: SamplingParams,
                     priority: int = 0) -> RequestStream:
        """Hands a request to the engine; raises ValueError if the engine rejects it."""
        if not self.alive:
            raise EngineRequestError(503, f"the engine is not serving: {self.error}")
        stream = RequestStream(self._loop, prompt_ids, params, priority)
        self._send(("add", stream))
        try:
            await stream.admitted
        except asyncio.CancelledError:  # the client left while the engine took the request
            self.abort(stream)
            raise
        self._live.add(stream)
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stops a request (its pages are freed at once); safe to call more than once."""
        if not stream.done:
            stream.done = True
            self._send(("abort", stream))

    def abort_all(self, status: int, message: str) -> None:
        """Fails every request in the engine with `status` (for shutdown): at once on the event
        loop, whatever the engine thread is doing (a step may take long); the engine thread
        then frees their pages."""
        error = EngineRequestError(status, message)
        for stream in list(self._live):
            if not stream.done:
                stream.queue.put_nowait(error)
        self._send(("abort_all", error))

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if not self._do_commands():
                    break
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish()
                    self._wake.wait(0.5)
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            log.error("engine loop died:\n%s", traceback.format_exc())
            self._mark_unhealthy(f"{type(e).__name__}: {e}")
            self._fail_streams(list(self._streams.values()), EngineRequestError(
                500, f"internal engine error: {type(e).__name__}: {e}"))
            self._streams.clear()
            self._fail_pending()

    def _do_commands(self) -> bool:
        """Runs queued commands; False on stop."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                if arg.engine_id is not None and self._streams.pop(arg.engine_id, None):
                    self.engine.abort(arg.engine_id)
                    self._release_finished()
            elif kind == "abort_all":
                streams = list(self._streams.values())
                self._streams.clear()
                for stream in streams:
                    self.engine.abort(stream.engine_id)
                self._release_finished()
                self._fail_streams(streams, arg)
            elif kind == "stop":
                self._fail_pending()
                return False

    def _add(self, stream: RequestStream) -> None:
        if stream.done:  # aborted before the engine saw it (its handler is gone)
            self._loop.call_soon_threadsafe(stream.admitted.cancel)
            return
        try:
            request_id = self.engine.add_request(stream.prompt_ids, stream.params, stream.priority)
        except ValueError as e:
            self._resolve(stream.admitted, None, e)
            return
        except Exception as e:  # noqa: BLE001
            log.error("add_request failed:\n%s", traceback.format_exc())
            self._resolve(stream.admitted, None, EngineRequestError(
                500, f"internal engine error: {type(e).__name__}: {e}"))
            return
        stream.engine_id = request_id
        self._streams[request_id] = stream
        self._resolve(stream.admitted, request_id, None)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
            finished = [(i, self.engine.output_of(i)) for i in self.engine.finished_request_ids()]
        except Exception as e:  # noqa: BLE001
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._recover(e)
            return
        self._failures = 0
        items = [(self._streams[d.request_id], d) for d in deltas if d.request_id in self._streams]
        for request_id, output in finished:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                items.append((stream, Finished(output)))
        self._publish()  # first: a client that has an item sees /metrics of its step
        self._deliver(items)

    def _release_finished(self) -> None:
        """Forgets requests that ended without a step (aborted)."""
        for request_id in self.engine.finished_request_ids():
            self.engine.output_of(request_id)
        self._publish()

    def _recover(self, error: Exception) -> None:
        """Fails the requests in the engine; checks that the engine is clean again."""
        self._failures += 1
        streams = list(self._streams.values())
        self._streams.clear()
        try:
            for stream in streams:
                self.engine.abort(stream.engine_id)
            self._release_finished()
            pool = self.engine.pool
            clean = not self.engine.has_unfinished() and pool.num_free == pool.num_pages
        except Exception:  # noqa: BLE001
            log.error("engine recovery failed:\n%s", traceback.format_exc())
            clean = False
        message = f"internal engine error: {type(error).__name__}: {error}"
        self._fail_streams(streams, EngineRequestError(500, message))
        if not clean:
            self._mark_unhealthy(f"{message} (the engine could not be reset)")
        elif self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._mark_unhealthy(f"{message} ({self._failures} failed steps in a row)")

    def _mark_unhealthy(self, reason: str) -> None:
        self.healthy = False
        self.error = reason
        if self.metrics is not None:
            self.metrics.healthy.set(0)

    def _fail_pending(self) -> None:
        """Answers the adds still in the command queue (the loop is stopping)."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._resolve(arg.admitted, None,
                              EngineRequestError(503, "the server is shutting down"))

    def _fail_streams(self, streams, error: EngineRequestError) -> None:
        self._deliver([(s, error) for s in streams])

    def _resolve(self, future: asyncio.Future, result, error) -> None:
        def settle():
            if not future.done():
                future.set_result(result) if error is None else future.set_exception(error)
        self._loop.call_soon_threadsafe(settle)

    def _deliver(self, items) -> None:
        """One thread-safe hop per step: every request's new items at once."""
        if items:
            def put_all():
                for stream, item in items:
                    stream.queue.put_nowait(item)
            self._loop.call_soon_threadsafe(put_all)

    def _publish(self) -> None:
        self.num_waiting = self.engine.num_waiting
        if self.metrics is not None:
            self.metrics.update_engine(self.engine)
