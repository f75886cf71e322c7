"""One entry point for every way of naming a model: preset, GGUF file, HF dir, orbax dir.

It lives in quant/ because an orbax directory may hold a quantized model, whose restore target
(the shape-only quantized model) only quant/ can build; float sources are read by the loaders of
models/.
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from configs.model import PRESETS, ModelConfig, get_preset
from models.gguf_file import find_smollm2_gguf
from models.gguf_loader import load_gguf
from models.hf_loader import load_hf_dir
from models.llama import LlamaForCausalLM
from models.orbax_io import is_orbax_checkpoint, read_checkpoint_meta, restore_checkpoint
from models.sharding import leaf_placer, random_model_on_mesh
from models.tokenizer import Tokenizer
from models.weights import abstract_model, model_from_tensors, random_model
from quant.model import QuantConfig, quantized_abstract_model

# Presets whose weights ship with an installed package.
EMBEDDED_PRESETS = ("smollm2-135m",)


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    source: str


def load_model(spec: str, dtype=jnp.float32, random_weights: bool = False,
               seed: int = 0, mesh=None) -> LoadedModel:
    """Loads the model named by `spec`.

    spec: a preset name (`smollm2-135m` loads the embedded GGUF; other presets need
    `random_weights=True`, which builds random weights of the preset's real shapes), a `.gguf`
    file, an HF checkpoint directory (config.json + safetensors) or an orbax directory written by
    scripts/convert_checkpoint.py or scripts/quantize.py.
    mesh: a (data, model) device mesh (engine/mesh.py): every weight goes straight onto its
    shards by the partition rules of models/sharding.py (an orbax checkpoint is restored onto
    them, each process reading its own shards); None: the default device.
    """
    if spec in PRESETS:
        cfg = get_preset(spec)
        if random_weights:
            if mesh is not None:
                return LoadedModel(cfg, random_model_on_mesh(cfg, seed, dtype, mesh), None,
                                   f"random:{spec}")
            return LoadedModel(cfg, random_model(cfg, seed, dtype), None, f"random:{spec}")
        if spec not in EMBEDDED_PRESETS:
            raise ValueError(f"preset {spec!r} has no embedded weights: pass a GGUF file, an HF "
                             "directory or an orbax directory, or use random weights "
                             "(--random_weights)")
        spec = str(find_smollm2_gguf())
    if not os.path.exists(spec):
        raise FileNotFoundError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))})"
                                " nor an existing file or directory")
    if os.path.isdir(spec):
        if is_orbax_checkpoint(spec):
            cfg, model, tokenizer = load_checkpoint(spec, dtype, mesh=mesh)
            return LoadedModel(cfg, model, tokenizer, spec)
        loaded = load_hf_dir(spec)
    else:
        loaded = load_gguf(spec)
    place = None if mesh is None else leaf_placer(loaded.config, mesh)
    model = model_from_tensors(loaded.config, loaded.tensors, dtype, source=spec, place=place)
    return LoadedModel(loaded.config, model, loaded.tokenizer, spec)


def load_checkpoint(path: str, dtype=None, mesh=None):
    """Restores (config, model, tokenizer or None) from an orbax directory (models/orbax_io.py),
    float or quantized (its stored QuantConfig rebuilds the quantized restore target).

    dtype None keeps the stored dtype; mesh: restore each weight onto its shards of this mesh.
    """
    cfg, stored_dtype, quantization = read_checkpoint_meta(path)
    if quantization is None:
        abstract = lambda dt: abstract_model(cfg, dt)  # noqa: E731
    else:
        try:
            qcfg = QuantConfig.from_dict(quantization)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: corrupt quantization settings: {e}") from None
        abstract = lambda dt: quantized_abstract_model(cfg, qcfg, dt)  # noqa: E731
    model, tokenizer = restore_checkpoint(path, cfg, abstract, stored_dtype, dtype, mesh)
    return cfg, model, tokenizer
