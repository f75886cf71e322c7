"""Running the server: listen, serve until told to stop, drain, close.

`serve()` is the coroutine the command line runs (it stops on SIGTERM or SIGINT);
`ServerThread` runs the same coroutine on its own event loop in a background thread (tests).

Shutdown is bounded: the process exits within `shutdown_timeout` + 1 s of the signal. Requests
get `shutdown_timeout` to finish; the rest are failed with 503 and their handlers get a short
grace to say so; closing connections and stopping the engine thread take at most a few tenths
of a second each; and a watchdog ends the process if its own exit takes longer than that.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading

from aiohttp import web

from engine.server.app import Server

log = logging.getLogger("pallasite.server")

DRAIN_GRACE_S = 0.3  # handlers of aborted requests: time to send their 503
CLOSE_S = 0.1  # aiohttp's wait for handlers still running as connections close
ENGINE_STOP_S = 0.2  # the engine thread's join (a daemon: a step still running is left)
EXIT_MARGIN_S = 0.95  # the watchdog: exit at shutdown_timeout + this at the latest


async def serve(server: Server, host: str, port: int, stop: asyncio.Event,
                on_listening=None) -> None:
    """Serves until `stop` is set, then shuts down gracefully.

    Shutdown: new requests get 503 while running ones finish (at most server.shutdown_timeout
    seconds; the rest are failed with 503), then the listener and connections close and the
    engine thread stops. `on_listening(host, port)` is called once the socket listens.
    """
    server.async_engine.start(asyncio.get_running_loop())
    app = server.make_app()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request in the engine at once (streaming or not). keepalive_timeout: aiohttp closes a
    # connection that has not sent a whole request head this long after it opened or after its
    # last response (slow or stalled clients); the body has server.body_timeout.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=CLOSE_S, keepalive_timeout=server.header_timeout)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        if on_listening is not None:
            on_listening(bound_host, bound_port)
        await stop.wait()
        await server.drain(DRAIN_GRACE_S)
    finally:
        await runner.cleanup()
        server.async_engine.stop(ENGINE_STOP_S)


def _exit_watchdog(seconds: float) -> None:
    """Ends the process `seconds` from now if it is still running (a daemon timer)."""
    def force_exit():
        print(f"shutdown took longer than {seconds:.1f}s: exiting now", file=sys.stderr,
              flush=True)
        os._exit(0)

    timer = threading.Timer(seconds, force_exit)
    timer.daemon = True
    timer.start()


def run_until_signal(server: Server, host: str, port: int, on_listening=None) -> None:
    """Runs `serve` on a new event loop; SIGTERM or SIGINT starts the graceful shutdown, and
    the process ends within server.shutdown_timeout + 1 s of it."""
    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_signal():
            if not stop.is_set():
                _exit_watchdog(server.shutdown_timeout + EXIT_MARGIN_S)
                stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await serve(server, host, port, stop, on_listening)

    asyncio.run(main())


class ServerThread:
    """A server on its own event loop in a daemon thread (for tests and notebooks)."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0):
        self.server, self.host, self.port = server, host, port
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="pallasite-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"the server did not start: {self._error!r}")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def _main(self) -> None:
        def listening(host, port):
            self.host, self.port = host, port
            self._ready.set()

        async def main():
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.server, self.host, self.port, self._stop, listening)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
            log.error("server thread failed: %r", e)
        finally:
            self._ready.set()
