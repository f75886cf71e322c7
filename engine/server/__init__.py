"""OpenAI-compatible HTTP server over the LLM engine.

- protocol.py: request parsing and validation, response and stream-chunk shapes (plain Python).
- chat.py: chat messages to prompt token ids; special-token text in content stays text.
- async_engine.py: the engine loop in its own thread; requests go in through a thread-safe
  command queue and come back on per-request asyncio queues.
- metrics.py: Prometheus metrics.
- app.py: the aiohttp application (routes, API key, body limit, errors in OpenAI's format, SSE).
- serving.py: running it: listen, a bounded drain on shutdown; a background-thread server
  for tests.

`python -m scripts.serve` is the command-line entry point.
"""
