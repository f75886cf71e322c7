"""Quantize a model's weights and write a self-contained orbax checkpoint.

    python -m scripts.quantize --method=int4_gptq --output=/tmp/smollm2-gptq
    python -m scripts.generate --model=/tmp/smollm2-gptq --prompt="What is the capital of France?"
    python -m scripts.eval_ppl --model=/tmp/smollm2-gptq

Methods (quant/model.py): int8, int8_asym (per output channel), int4_rtn, int4_gptq, int4_awq
(group-wise along the input dim, --group_size, <= 0 for per channel). GPTQ and AWQ calibrate on
--calib_text (default: the built-in text of quant/calibration.py, held apart from eval_ppl's
default evaluation text), --calib_tokens tokens cut into rows of --calib_seq_len.
"""
from __future__ import annotations

import time

from absl import app, flags

from models.orbax_io import save_checkpoint
from quant.loader import load_model
from quant.model import model_nbytes
from scripts import common

common.define_model_flags()
flags.DEFINE_enum("method", None, ["int8", "int8_asym", "int4_rtn", "int4_gptq", "int4_awq"],
                  "Quantization method.")
common.define_quant_flags()
flags.DEFINE_string("output", None, "Output checkpoint directory.")
flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
flags.mark_flags_as_required(["method", "output"])
FLAGS = flags.FLAGS


def main(argv):
    del argv
    common.setup_jax()
    try:
        loaded = load_model(FLAGS.model, common.resolve_dtype(FLAGS.dtype), FLAGS.random_weights,
                            FLAGS.seed)
        before = model_nbytes(loaded.model)
        start = time.perf_counter()
        settings = common.quantize_from_flags(loaded, FLAGS.method)
        elapsed = time.perf_counter() - start
        save_checkpoint(FLAGS.output, loaded.cfg, loaded.model, loaded.tokenizer,
                        overwrite=FLAGS.overwrite, quantization=settings)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    after = model_nbytes(loaded.model)
    print(f"quantized {FLAGS.model} with {FLAGS.method} in {elapsed:.1f}s: weights "
          f"{before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; wrote {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
