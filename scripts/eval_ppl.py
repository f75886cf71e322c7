"""Perplexity of a model on a text: `python -m scripts.eval_ppl --model=smollm2-135m`.

The text is tokenized without special tokens, cut to its first --num_tokens tokens, and run in
one forward pass through the paged cache (engine/perplexity.py); perplexity = exp(mean negative
log-likelihood of each token given the ones before it). The default text is CPython's pydoc topics
(`pydoc_data.topics.topics`, joined in key order by blank lines), which ships with every CPython.

--quant=METHOD quantizes the weights on the fly (quant/model.py; GPTQ and AWQ calibrate on
--calib_text, by default a built-in text other than this evaluation text); a quantized checkpoint
written by scripts/quantize.py is evaluated with --model=DIR. --kv_cache_dtype=bf16|int8|fp8
stores K/V in that type in the paged cache the pass attends over (int8 / fp8 pages with a
float32 scale per token and head, as the engine stores them). --fuse_projections fuses
q/k/v and gate/up after quantizing (default: on a GPU), as the serving scripts do.
"""
from __future__ import annotations

import json

from absl import app, flags

from engine.api import load_prepared
from engine.perplexity import default_text, perplexity_of_ids
from quant.model import model_nbytes
from scripts import common

common.define_model_flags()
common.define_fusion_flags()
flags.DEFINE_string("text_file", None, "UTF-8 text to evaluate on (default: pydoc topics).")
flags.DEFINE_integer("num_tokens", 2048, "Evaluate on the first this-many tokens of the text.")
flags.DEFINE_integer("page_size", 16, "Tokens per KV-cache page.")
flags.DEFINE_string("json_out", None, "Also write the result as JSON to this file.")
flags.DEFINE_enum("quant", None, ["int8", "int8_asym", "int4_rtn", "int4_gptq", "int4_awq"],
                  "Quantize the weights on the fly with this method before evaluating.")
common.define_quant_flags()
common.define_kv_cache_dtype_flag()
FLAGS = flags.FLAGS


def main(argv):
    del argv
    common.setup_jax()
    try:
        if FLAGS.num_tokens < 2:
            raise ValueError(f"--num_tokens must be >= 2, got {FLAGS.num_tokens}")
        if FLAGS.text_file:
            with open(FLAGS.text_file, encoding="utf-8") as f:
                text = f.read()
        else:
            text = default_text()
        qcfg = common.quant_config_from_flags(FLAGS.quant) if FLAGS.quant else None
        loaded, quant = load_prepared(
            FLAGS.model, dtype=FLAGS.dtype, random_weights=FLAGS.random_weights, seed=FLAGS.seed,
            quantization=qcfg, calib_text=FLAGS.calib_text, calib_tokens=FLAGS.calib_tokens,
            calib_seq_len=FLAGS.calib_seq_len, fuse_projections=FLAGS.fuse_projections,
            gemv_layers=FLAGS.gemv_layers, log=common.log_line)
        if loaded.tokenizer is None:
            raise ValueError(f"model {FLAGS.model!r} has no tokenizer to encode the text with")
        ids = loaded.tokenizer.encode(text)[: FLAGS.num_tokens]
        ppl, nll = perplexity_of_ids(loaded.cfg, loaded.model, ids, FLAGS.page_size,
                                     FLAGS.kv_cache_dtype)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    result = {"model": FLAGS.model, "text": FLAGS.text_file or "pydoc_data.topics",
              "num_tokens": len(ids), "mean_nll": nll, "perplexity": ppl,
              "weight_bytes": model_nbytes(loaded.model), "quant": quant,
              "kv_cache_dtype": FLAGS.kv_cache_dtype,
              "fused_projections": loaded.cfg.fused_projections}
    extras = "".join(f", {name} {value}" for name, value in (
        ("--quant", FLAGS.quant), ("KV cache", FLAGS.kv_cache_dtype))
        if value not in (None, "auto"))
    print(f"perplexity {ppl:.4f} (mean NLL {nll:.5f}) over {len(ids)} tokens of "
          f"{result['text']} with {FLAGS.model}{extras}; weights "
          f"{result['weight_bytes'] / 2**20:.1f} MiB")
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
