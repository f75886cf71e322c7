"""Generate text with a model: `python -m scripts.generate --prompt="What is the capital of France?"`.

Each --prompt is one request; all run together in one engine. Without --json the text streams
to the terminal as it is generated, prompt by prompt, followed by a one-line speed summary. With
--json one JSON object per prompt is printed.
"""
from __future__ import annotations

import json
import sys
import time

from absl import app, flags

from engine.api import load_engine
from engine.request import SamplingParams
from scripts import common, parallel

common.define_model_flags()
common.define_engine_flags()
common.define_speculative_flags()
common.define_fusion_flags()
flags.DEFINE_multi_string("prompt", None, "A prompt; repeat the flag for several requests.")
flags.DEFINE_integer("max_tokens", 128, "Most tokens generated per prompt.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1].")
flags.DEFINE_integer("sample_seed", None, "Per-request sampling seed (default: drawn from --seed).")
flags.DEFINE_bool("chat", True, "Apply the model's chat template to each prompt.")
flags.DEFINE_bool("json", False, "Print one JSON object per prompt instead of streaming text.")
flags.DEFINE_bool("warmup", True, "Compile the run's programs before timing it.")
FLAGS = flags.FLAGS


def build_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when `chat`."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so text prompts cannot be encoded")
    if chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True) for p in prompts]
    # Plain text gets BOS where the model adds it (Llama 2, Gemma); a chat template writes its own.
    return [tokenizer.encode(p, add_special_tokens=not chat) for p in prompts]


def stream_in_order(engine, prompt_ids, params) -> list[int]:
    """Streams each request's text in prompt order, buffering the ones not yet on screen.

    Returns the request ids, in prompt order.
    """
    ids = [engine.add_request(p, params) for p in prompt_ids]
    position = {request_id: i for i, request_id in enumerate(ids)}
    buffers = [[] for _ in ids]
    done = set()
    current = 0
    while engine.has_unfinished():
        for delta in engine.step():
            index = position[delta.request_id]
            buffers[index].append(delta.text)
            if delta.finish_reason is not None:
                done.add(index)
        while current < len(ids):
            sys.stdout.write("".join(buffers[current]))
            buffers[current].clear()
            sys.stdout.flush()
            if current not in done:
                break
            sys.stdout.write("\n" + ("-" * 40 + "\n" if current + 1 < len(ids) else ""))
            current += 1
    return ids


def main(argv):
    del argv
    common.setup_jax()
    if not FLAGS.prompt:
        common.fail("give at least one --prompt")
    try:
        started = time.perf_counter()
        mesh = parallel.setup_parallel()  # --tp / --dp / multi-process; None: one device
        params = SamplingParams(max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                                top_k=FLAGS.top_k, top_p=FLAGS.top_p, seed=FLAGS.sample_seed)
        spec = common.spec_config_from_flags(FLAGS)
        engine = load_engine(
            FLAGS.model, dtype=FLAGS.dtype, random_weights=FLAGS.random_weights, seed=FLAGS.seed,
            engine_config=lambda cfg: common.engine_config_from_flags(FLAGS, cfg),
            speculative=spec, draft_model=FLAGS.draft_model, mesh=mesh,
            fuse_projections=FLAGS.fuse_projections, gemv_layers=FLAGS.gemv_layers,
            log=common.log_line)
        prompt_ids = build_prompts(engine.tokenizer, FLAGS.prompt, FLAGS.chat)
        if mesh is not None:
            print(f"{parallel.describe(mesh)}; {engine.runner.plan.describe()}", file=sys.stderr)
        print(engine.kv_summary, file=sys.stderr)
        common.print_kernels(engine.runner.kernels, engine.cfg.head_dim)
        if FLAGS.warmup:
            longest = max(len(p) for p in prompt_ids)
            engine.warmup(len(prompt_ids), longest + FLAGS.max_tokens,
                          [len(p) for p in prompt_ids], samplers=FLAGS.temperature > 0,
                          progress=common.print_progress("compiling", engine.warmup_threads))
        common.freeze_startup_objects()
        print(common.startup_summary(time.perf_counter() - started), file=sys.stderr)
        start = time.perf_counter()
        if FLAGS.json:
            outputs = engine.generate(prompt_ids, params)
            for prompt, out in zip(FLAGS.prompt, outputs):
                print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.output_ids,
                                  "prompt_tokens": len(out.prompt_ids), "ttft_s": out.ttft_s,
                                  "tokens_per_s": out.decode_tokens_per_s,
                                  "finish_reason": out.finish_reason.value}))
            return
        ids = stream_in_order(engine, prompt_ids, params)
        elapsed = time.perf_counter() - start
        outputs = [engine.output_of(i) for i in ids]
        generated = sum(len(o.output_ids) for o in outputs)
        ttft = max(o.ttft_s for o in outputs)
        decode_rate = (generated - len(outputs)) / max(elapsed - ttft, 1e-9)
        print(f"[{len(outputs)} prompt(s), {sum(len(p) for p in prompt_ids)} prompt tokens, "
              f"{generated} generated in {elapsed:.2f}s; time to first token {ttft:.2f}s; "
              f"decode {decode_rate:.1f} tokens/s]")
        if spec is not None:
            stats = engine.spec_stats
            print(f"[speculative {spec.method}: {stats.num_drafts} drafts, {stats.num_draft_tokens}"
                  f" drafted, {stats.num_accepted_tokens} accepted ({stats.acceptance_rate:.0%}); "
                  f"mean acceptance length {stats.mean_acceptance_length:.2f}]")
    except common.USER_ERRORS as e:
        common.fail(str(e))


if __name__ == "__main__":
    app.run(main)
