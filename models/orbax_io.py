"""Self-contained orbax checkpoints: weights, config and tokenizer in one directory.

Layout of a checkpoint directory:
    pallasite_config.json   the ModelConfig, the weight dtype and, for a quantized model, its
                            quantization settings (quant.model.QuantConfig), from which
                            quant/loader.py rebuilds the shape-only quantized model that the
                            stored arrays are restored into
    params/                 orbax checkpoint of the model state (nested dict of arrays)
    tokenizer.json, tokenizer_config.json   (when the source had a tokenizer)

`save_checkpoint` writes into a temporary sibling directory and renames it at the end, so a
failure leaves nothing at the output path.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from configs.model import ModelConfig, config_from_dict, config_to_dict
from models.sharding import abstract_with_shardings
from models.tokenizer import Tokenizer
from models.weights import model_from_pure_dict

CONFIG_FILE = "pallasite_config.json"


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_checkpoint(output_dir: str, cfg: ModelConfig, model, tokenizer=None,
                    overwrite: bool = False, quantization: dict | None = None) -> None:
    """Writes the model (in its own dtype), config and tokenizer to `output_dir` atomically.

    quantization: QuantConfig.to_dict() of a quantized model (its QuantizedWeights are saved
    as their arrays: packed codes, scales, offsets, permutation).
    """
    output_dir = os.path.abspath(output_dir)
    if os.path.exists(output_dir) and not overwrite:
        raise FileExistsError(f"{output_dir} already exists (pass overwrite to replace it)")
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(output_dir) + ".tmp-", dir=parent)
    try:
        pure = nnx.to_pure_dict(nnx.state(model))
        dtype = str(next(a.dtype for a in jax.tree.leaves(pure)
                         if jnp.issubdtype(a.dtype, jnp.floating)))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.path.join(tmp, "params"), pure)
        checkpointer.wait_until_finished()
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            meta = {"model": config_to_dict(cfg), "dtype": dtype}
            if quantization is not None:
                meta["quantization"] = quantization
            json.dump(meta, f, indent=2)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.rename(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_checkpoint_meta(path: str) -> tuple[ModelConfig, jnp.dtype, dict | None]:
    """(config, stored weight dtype, quantization settings or None) of a checkpoint directory.

    FileNotFoundError when `path` is not a checkpoint; ValueError when its config is corrupt.
    """
    config_path = os.path.join(os.path.abspath(path), CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{os.path.abspath(path)} is not a Pallasite orbax checkpoint: "
                                f"{CONFIG_FILE} is missing")
    try:
        with open(config_path) as f:
            meta = json.load(f)
        return config_from_dict(meta["model"]), jnp.dtype(meta["dtype"]), meta.get("quantization")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{config_path} is corrupt: {e}") from None


def restore_checkpoint(path: str, cfg: ModelConfig, abstract, stored_dtype, dtype=None,
                       mesh=None):
    """Restores (model, tokenizer or None) from a directory written by save_checkpoint.

    abstract: dtype -> the shape-only model the stored arrays fill (models.weights.abstract_model
    for a float checkpoint; a quantized one's comes from quant/). dtype None keeps the stored
    dtype; otherwise float weights are cast to `dtype`. mesh: restore each weight directly onto
    its shards of this (data, model) mesh (models/sharding.py): every process reads only the
    parts its devices hold, whatever mesh the checkpoint was written from.
    """
    path = os.path.abspath(path)
    target = nnx.to_pure_dict(nnx.state(abstract(stored_dtype)))
    if mesh is None:  # onto the default device, whatever layout the arrays were saved from
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                              target)
    else:
        target = abstract_with_shardings(target, cfg, mesh)
    try:
        pure = ocp.StandardCheckpointer().restore(os.path.join(path, "params"), target)
    except Exception as e:  # orbax raises many types for missing/corrupt data
        raise ValueError(f"cannot restore weights from {path}/params: {type(e).__name__}: "
                         f"{str(e)[:300]}") from None
    model = model_from_pure_dict(cfg, pure, dtype or stored_dtype,
                                 abstract=abstract(dtype or stored_dtype))
    has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
    return model, (Tokenizer.from_dir(path) if has_tokenizer else None)
