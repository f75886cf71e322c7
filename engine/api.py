"""The Python entry point: a model name in, a ready engine out, as the command line builds it.

    from engine.api import load_engine
    from engine.request import SamplingParams
    engine = load_engine("smollm2-135m")
    print(engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(max_tokens=16)))

`load_engine` loads the model (quant.loader.load_model), optionally quantizes it, prepares it
for the device (models.prepare.prepare_for_device: fused projections, layers for the GEMV
kernel) and builds the LLMEngine. scripts.generate and scripts.serve call it with their flags,
so a Python user gets the same model, and the same speed, as the commands.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from configs.model import ModelConfig
from engine.llm_engine import EngineConfig, LLMEngine
from engine.speculative import SpecConfig
from models.prepare import check_preparation, prepare_for_device
from ops.quant_wgmma import on_hopper
from quant.loader import LoadedModel, load_model
from quant.model import QuantConfig, quantize_loaded

_log = logging.getLogger(__name__)

# EngineConfig, or a function of the loaded model's config that gives one (sizes that depend
# on the model, such as its context length).
EngineConfigArg = EngineConfig | Callable[[ModelConfig], EngineConfig] | None


def default_dtype(platform: str):
    """float32 on the CPU, bfloat16 on accelerators."""
    return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)


def load_prepared(model: str, *, dtype=None, random_weights: bool = False, seed: int = 0,
                  quantization: QuantConfig | None = None, calib_text: str | None = None,
                  calib_tokens: int = 16384, calib_seq_len: int = 512, mesh=None,
                  fuse_projections: bool | None = None, gemv_layers: bool | None = None,
                  label: str = "model",
                  log: Callable[[str], None] | None = None) -> tuple[LoadedModel, dict | None]:
    """(the loaded model prepared for the device, the quantization settings or None).

    model: a preset, GGUF file, HF directory or orbax directory (quant.loader.load_model).
    dtype None: default_dtype of the platform. quantization: quantize the float weights after
    loading (GPTQ and AWQ calibrate on calib_text, None: the built-in text). mesh: a (data,
    model) mesh (engine.mesh.make_mesh) or None for one device. fuse_projections / gemv_layers:
    force the preparation on or off (None: by device; models/prepare.py). log: receives one line
    per preparation made or skipped (default: this module's logger at INFO).
    """
    platform = jax.default_backend()
    check_preparation(platform, mesh, fuse_projections, gemv_layers)  # before the long load
    loaded = load_model(model, default_dtype(platform) if dtype is None else jnp.dtype(dtype),
                        random_weights, seed, mesh=mesh)
    settings = None
    if quantization is not None:
        settings = quantize_loaded(loaded, quantization, calib_text, calib_tokens, calib_seq_len)
    prepared = prepare_for_device(loaded.cfg, loaded.model, platform=platform,
                                  hopper=on_hopper(), mesh=mesh,
                                  fuse_projections=fuse_projections, gemv_layers=gemv_layers,
                                  label=label)
    for note in prepared.notes:
        (log or _log.info)(note)
    return dataclasses.replace(loaded, cfg=prepared.cfg, model=prepared.model), settings


def load_engine(model: str, *, dtype=None, random_weights: bool = False, seed: int = 0,
                quantization: QuantConfig | None = None, calib_text: str | None = None,
                engine_config: EngineConfigArg = None, speculative: SpecConfig | None = None,
                draft_model: str | None = None, mesh=None, fuse_projections: bool | None = None,
                gemv_layers: bool | None = None,
                log: Callable[[str], None] | None = None) -> LLMEngine:
    """An LLMEngine over `model`, loaded, quantized and prepared as scripts.serve does.

    engine_config: the engine's sizes; a function of the model's config; or None: the device's
    defaults (engine/engine_config.py), which LLMEngine resolves. speculative: n-gram or
    draft-model speculation; a draft model (`draft_model`, any form `model` takes) is loaded in
    the same dtype and prepared for one device, since it runs unsharded. The other arguments
    are load_prepared's.
    """
    if speculative is not None and speculative.method == "draft" and not draft_model:
        raise ValueError("speculative method 'draft' needs a draft model (draft_model, "
                         "--draft_model)")
    platform = jax.default_backend()
    dtype = default_dtype(platform) if dtype is None else jnp.dtype(dtype)
    loaded, _ = load_prepared(model, dtype=dtype, random_weights=random_weights, seed=seed,
                              quantization=quantization, calib_text=calib_text, mesh=mesh,
                              fuse_projections=fuse_projections, gemv_layers=gemv_layers, log=log)
    if callable(engine_config):
        engine_config = engine_config(loaded.cfg)
    draft = None
    if speculative is not None and speculative.method == "draft":
        drafted, _ = load_prepared(draft_model, dtype=dtype, fuse_projections=fuse_projections,
                                   gemv_layers=gemv_layers, label="draft model", log=log)
        draft = (drafted.cfg, drafted.model)
    return LLMEngine(loaded.cfg, loaded.model, loaded.tokenizer, engine_config, speculative,
                     draft, mesh=mesh)
