"""The decode benchmark's peer: HF transformers `generate` on the same shapes (torch, on a GPU).

    python -m scripts.bench.hf_peer --model=llama3.1-8b --batch=1,8 --context=512 \
        --json_out=hf.json [--static_compile]

A random-weight bf16 transformers model of the preset's family and shapes (scripts/bench/hf_configs.py),
prompts of `context - 1` random token ids (so the decode steps attend to about `context`
tokens), greedy `generate` of --new_tokens tokens. A streamer stamps when each new token
reaches the host: decode seconds per step = (last stamp - second stamp) / (new_tokens - 2).
Eager mode (sdpa attention, dynamic cache), or with --static_compile a static cache compiled by
torch.compile. scripts.bench.decode runs it in a subprocess before jax takes the GPU; a failing
row is recorded and the next runs. torch and transformers are imported in main: they are
optional.
"""
from __future__ import annotations

import json
import time

from absl import app, flags

from configs.model import get_preset
from scripts.bench.hf_configs import hf_config

flags.DEFINE_string("model", "llama3.2-1b", "Preset name.")
flags.DEFINE_list("batch", ["1"], "Batch sizes.")
flags.DEFINE_list("context", ["512"], "Contexts (prompt length + 1).")
flags.DEFINE_integer("new_tokens", 16, "Tokens generated per row (>= 3).")
flags.DEFINE_integer("max_tokens", 131072, "Skip rows with batch x context above this.")
flags.DEFINE_bool("static_compile", False, "Static cache + torch.compile instead of eager.")
flags.DEFINE_string("json_out", "hf.json", "Rows as JSON (written after every row).")
FLAGS = flags.FLAGS


class _Stamps:
    """A generate streamer recording when each put (prompt, then every new token) arrives."""

    def __init__(self, torch):
        self.torch, self.times = torch, []

    def put(self, value):
        self.torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_model(cfg, torch, transformers):
    """A random bf16 transformers model of cfg's family and shapes (`hf_config`), created on
    the GPU."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg, transformers))
    torch.set_default_dtype(torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def measure_row(model, torch, vocab: int, batch: int, context: int, new_tokens: int,
                static: bool) -> dict:
    """Prefill seconds and decode seconds per step of one greedy generate (after a warm-up)."""
    ids = torch.randint(0, vocab, (batch, context - 1), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False,
                  max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        model.generate(ids, **kwargs)  # warm-up (and, static, compilation)
        stamps = _Stamps(torch)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, streamer=stamps, **kwargs)
    t = stamps.times  # prompt, then one per new token
    step_s = (t[-1] - t[2]) / (len(t) - 3)
    return {"prefill_s": t[1] - start, "step_s": step_s, "tokens_per_s": batch / step_s,
            "new_tokens": len(t) - 1}


def main(argv):
    del argv
    import torch
    import transformers

    cfg = get_preset(FLAGS.model)
    mode = "static cache + torch.compile" if FLAGS.static_compile else "eager"
    out = {"model": FLAGS.model, "mode": mode, "torch": torch.__version__,
           "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(0), "rows": []}
    start = time.perf_counter()
    model = hf_model(cfg, torch, transformers)
    out["init_s"] = time.perf_counter() - start
    for b in map(int, FLAGS.batch):
        for c in map(int, FLAGS.context):
            row = {"model": FLAGS.model, "mode": mode, "batch": b, "context": c}
            if b * c > FLAGS.max_tokens:
                row["skipped"] = f"batch x context > {FLAGS.max_tokens}"
            else:
                try:
                    row |= measure_row(model, torch, cfg.vocab_size, b, c, FLAGS.new_tokens,
                                       FLAGS.static_compile)
                except Exception as e:  # noqa: BLE001 - a failing row is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    torch.cuda.empty_cache()
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(FLAGS.json_out, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
