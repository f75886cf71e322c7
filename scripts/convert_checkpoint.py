"""Convert a GGUF file or HF checkpoint directory to a self-contained orbax checkpoint.

    python -m scripts.convert_checkpoint --input=model.gguf --output=/tmp/smollm2-orbax

The output directory holds the weights (orbax), the config and the tokenizer; `--model=DIR`
loads it in every script. The conversion writes a temporary directory beside the output and
renames it at the end, so a failure leaves nothing half-written at --output.
"""
from __future__ import annotations

from absl import app, flags

from models.orbax_io import save_checkpoint
from models.sharding import storage_layout
from quant.loader import load_model
from scripts import common, parallel

flags.DEFINE_string("input", "smollm2-135m",
                    "GGUF file, HF checkpoint directory, orbax directory or embedded preset name.")
flags.DEFINE_string("output", None, "Directory to create.")
flags.DEFINE_enum("dtype", "bfloat16", common.DTYPES, "Dtype of the stored weights.")
flags.DEFINE_bool("overwrite", False, "Replace --output if it exists.")
flags.DEFINE_integer("storage_tp", 8,
                     "Store each weight in chunks of its shards at this tensor-parallel size, so "
                     "a run at any tp dividing it reads only its own shards (1: whole arrays).")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    parallel.host_devices(FLAGS.storage_tp)  # before jax starts: CPUs to lay the shards out on
    common.setup_jax()
    if not FLAGS.output:
        common.fail("--output is required")
    try:
        loaded = load_model(FLAGS.input, common.resolve_dtype(FLAGS.dtype))
        model = loaded.model
        if FLAGS.storage_tp > 1:  # orbax writes every array in chunks of its shards
            model = storage_layout(model, loaded.cfg, FLAGS.storage_tp)
        save_checkpoint(FLAGS.output, loaded.cfg, model, loaded.tokenizer,
                        overwrite=FLAGS.overwrite)
    except common.USER_ERRORS as e:
        common.fail(str(e))
    print(f"wrote {FLAGS.output} ({loaded.cfg.name}, {loaded.cfg.num_params() / 1e6:.1f}M "
          f"parameters, {FLAGS.dtype})")


if __name__ == "__main__":
    app.run(main)
