"""One entry point for every way of naming a model: preset, GGUF file, HF dir, orbax dir."""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from configs.model import PRESETS, ModelConfig, get_preset

# Presets whose weights ship with an installed package.
EMBEDDED_PRESETS = ("smollm2-135m",)


@dataclasses.dataclass
class LoadedModel:
    cfg: ModelConfig
    model: object  # LlamaForCausalLM
    tokenizer: object | None  # models.tokenizer.Tokenizer
    source: str


def load_model(spec: str, dtype=jnp.float32, random_weights: bool = False,
               seed: int = 0, mesh=None) -> LoadedModel:
    """Loads the model named by `spec`.

    spec: a preset name (`smollm2-135m` loads the embedded GGUF; other presets need
    `random_weights=True`, which builds random weights of the preset's real shapes), a `.gguf`
    file, an HF checkpoint directory (config.json + safetensors) or an orbax directory written by
    scripts/convert_checkpoint.py.
    mesh: a (data, model) device mesh (engine/mesh.py): every weight goes straight onto its
    shards by the partition rules of engine/sharding.py (an orbax checkpoint is restored onto
    them, each process reading its own shards); None: the default device.
    """
    from models.weights import model_from_tensors, random_model

    if spec in PRESETS:
        cfg = get_preset(spec)
        if random_weights:
            if mesh is not None:
                from engine.sharding import random_model_on_mesh
                return LoadedModel(cfg, random_model_on_mesh(cfg, seed, dtype, mesh), None,
                                   f"random:{spec}")
            return LoadedModel(cfg, random_model(cfg, seed, dtype), None, f"random:{spec}")
        if spec not in EMBEDDED_PRESETS:
            raise ValueError(f"preset {spec!r} has no embedded weights: pass a GGUF file, an HF "
                             "directory or an orbax directory, or use random weights "
                             "(--random_weights)")
        from models.gguf_loader import find_smollm2_gguf
        spec = find_smollm2_gguf()
    if not os.path.exists(spec):
        raise FileNotFoundError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))})"
                                " nor an existing file or directory")
    if os.path.isdir(spec):
        from models.orbax_io import is_orbax_checkpoint, load_checkpoint
        if is_orbax_checkpoint(spec):
            cfg, model, tokenizer = load_checkpoint(spec, dtype, mesh=mesh)
            return LoadedModel(cfg, model, tokenizer, spec)
        from models.hf_loader import load_hf_dir
        loaded = load_hf_dir(spec)
    else:
        from models.gguf_loader import load_gguf
        loaded = load_gguf(spec)
    place = None
    if mesh is not None:
        from engine.sharding import leaf_placer
        place = leaf_placer(loaded.config, mesh)
    model = model_from_tensors(loaded.config, loaded.tensors, dtype, source=spec, place=place)
    return LoadedModel(loaded.config, model, loaded.tokenizer, spec)
