"""OpenAI-compatible HTTP server: `python -m scripts.serve --model=smollm2-135m --port=8000`.

Loads the model, sizes the KV cache (the summary is printed), compiles the programs the first
requests reach (the others in the background once listening), then listens: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream=true gives
server-sent events), GET /health, GET /metrics (Prometheus). SIGTERM or Ctrl-C stops admitting
new requests (503), lets running ones finish for up to --shutdown_timeout seconds, and exits
within --shutdown_timeout + 1 s.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from absl import app, flags

from configs.switches import Switches
from engine.api import load_engine
from engine.compile_stats import report_serving_compiles
from engine.server.app import Server
from engine.server.serving import run_until_signal
from scripts import common, parallel

common.define_model_flags()
common.define_engine_flags()
common.define_speculative_flags()
common.define_fusion_flags()
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port; the address is printed).")
flags.DEFINE_string("api_key", None, "If set, /v1/ requests need 'Authorization: Bearer <key>' "
                    "(default: the PALLASITE_API_KEY environment variable, if set).")
flags.DEFINE_string("served_model_name", None, "The model id clients send (default: --model).")
flags.DEFINE_integer("max_waiting", 256, "Most sequences waiting for a free slot (beyond "
                     "--max_num_seqs running); above it, 429.")
flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body; above it, 413.")
flags.DEFINE_float("shutdown_timeout", 30.0, "Seconds running requests get to finish on SIGTERM; "
                   "the process exits within this + 1 s.")
flags.DEFINE_float("header_timeout", 20.0, "Seconds a connection may go without sending a whole "
                   "request head (from its opening or its last response); then it is closed.")
flags.DEFINE_float("body_timeout", 20.0, "Seconds to receive a request's body; then 408.")
flags.DEFINE_bool("special_tokens_in_content", False, "Let special-token text in chat messages' "
                  "content (e.g. '<|im_end|>') become the special token; off: it is encoded as "
                  "plain text, so a user cannot forge a role marker.")
flags.DEFINE_bool("warmup", True, "Compile the programs the engine can reach at start-up.")
flags.DEFINE_bool("compile_in_background", True, "With --warmup: compile before listening only "
                  "the programs the first requests reach (contexts up to 256 tokens, one "
                  "prompt per prefill step; engine/warmup.py), the rest in the background "
                  "once listening (--nocompile_in_background: all before listening).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    common.setup_jax()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    for name in ("max_waiting", "max_body_bytes"):
        if getattr(FLAGS, name) < 1:
            common.fail(f"--{name} must be >= 1")
    if not FLAGS.shutdown_timeout >= 0:
        common.fail("--shutdown_timeout must be >= 0")
    for name in ("header_timeout", "body_timeout"):
        if not getattr(FLAGS, name) > 0:
            common.fail(f"--{name} must be > 0")
    try:
        start = time.perf_counter()
        if FLAGS.coordinator_address or (FLAGS.num_processes or 1) > 1:
            raise ValueError("the server runs in one process: shard it over this host's devices "
                             "with --tp / --dp, without --coordinator_address / --num_processes")
        mesh = parallel.setup_parallel()  # --tp / --dp over this host's devices; None: one
        engine = load_engine(
            FLAGS.model, dtype=FLAGS.dtype, random_weights=FLAGS.random_weights, seed=FLAGS.seed,
            engine_config=lambda cfg: common.engine_config_from_flags(FLAGS, cfg),
            speculative=common.spec_config_from_flags(FLAGS), draft_model=FLAGS.draft_model,
            mesh=mesh, fuse_projections=FLAGS.fuse_projections, gemv_layers=FLAGS.gemv_layers,
            log=common.log_line)
        if mesh is not None:
            print(f"{parallel.describe(mesh)}; {engine.runner.plan.describe()}", file=sys.stderr)
        print(engine.kv_summary, file=sys.stderr, flush=True)
        common.print_kernels(engine.runner.kernels, engine.cfg.head_dim)
        later = (common.warmup_for_serving(engine, FLAGS.compile_in_background)
                 if FLAGS.warmup else [])
        common.freeze_startup_objects()
        print(common.startup_summary(time.perf_counter() - start), file=sys.stderr, flush=True)
        server = Server(engine, FLAGS.served_model_name or FLAGS.model,
                        api_key=FLAGS.api_key or Switches.from_env().api_key,
                        max_waiting=FLAGS.max_waiting, max_body_bytes=FLAGS.max_body_bytes,
                        shutdown_timeout=FLAGS.shutdown_timeout,
                        header_timeout=FLAGS.header_timeout, body_timeout=FLAGS.body_timeout,
                        special_tokens_in_content=FLAGS.special_tokens_in_content)
    except common.USER_ERRORS as e:
        common.fail(str(e))

    def listening(host, port):
        print(f"serving {server.model_name!r} on http://{host}:{port} (OpenAI API under /v1)",
              flush=True)
        engine.compile_in_background(later, log=common.log_line)
        report_serving_compiles(common.log_line)

    try:
        run_until_signal(server, FLAGS.host, FLAGS.port, listening)
    except OSError as e:
        common.fail(f"cannot listen on {FLAGS.host}:{FLAGS.port}: {e.strerror or e}")
    print("server stopped", file=sys.stderr, flush=True)
    # Exit now: the engine thread may still be inside a step (a compile can take seconds), and
    # finalizing the interpreter under it could crash or overrun --shutdown_timeout.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    app.run(main)
