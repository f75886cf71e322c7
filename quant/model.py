"""Quantizing a whole model: the settings, the methods per decoder layer, and checkpoint shapes.

What is quantized: the seven linear layers of every decoder layer (q, k, v, o, gate, up, down;
in a mixture of experts every expert's gate, up and down, each expert on its own grid: the
stacked codes carry a leading expert axis, models/moe.py; RTN only, the router stays float),
and with `QuantConfig.lm_head` an untied output head too (RTN with the method's bits and group
size, whatever the method: its input is the final norm's output, which no layer-wise method
calibrates). The token embedding (also the output head when tied) and the RMSNorm weights stay
in float. The head is off by default: it is the most sensitive layer, but in a decode step of a
quantized llama3.1-8b the float head is a fifth (INT4) or a seventh (INT8) of the bytes read.

Methods (QuantConfig.method):
    int8        RTN, 8 bits per output channel, symmetric
    int8_asym   RTN, 8 bits per output channel, asymmetric (scale and offset)
    int4_rtn    RTN, 4 bits, group-wise along the input dim (group_size; <= 0: per channel)
    int4_gptq   GPTQ (quant/gptq.py), layers in order, each on inputs from the already quantized
                layers before it; within a layer q/k/v, then o, then gate/up, then down, each
                group on inputs through the group before it already quantized
    int4_awq    AWQ (quant/awq.py) scaling and clipping in float, layer by layer, then int4 RTN
The QuantConfig is stored in a checkpoint's pallasite_config.json; `quantized_abstract_model`
rebuilds the shape-only quantized model from it, the target orbax restores into.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.weights import abstract_model
from quant.awq import awq_layer
from quant.calibration import LayerwiseRunner, calibration_ids, linear_modules
from quant.gptq import gptq_quantize, hessian
from quant.qtensor import QuantizedWeight, abstract_quantized_weight, split_columns
from quant.rtn import quantize_rtn, resolve_group_size

METHODS = ("int8", "int8_asym", "int4_rtn", "int4_gptq", "int4_awq")
CALIBRATED = ("int4_gptq", "int4_awq")
# Linears quantized together because they read the same input (and, for GPTQ, in this order).
GPTQ_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
               ("down_proj",))


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a model's decoder linears are quantized (see the module docstring)."""

    method: str
    group_size: int = 128  # int4 only; <= 0: per output channel. INT8 is always per channel.
    symmetric: bool = False  # int4 only; int8 / int8_asym say it in the name
    act_order: bool = False  # int4_gptq only
    damp: float = 0.01  # int4_gptq: dampening, a fraction of mean(diag(H))
    lm_head: bool = False  # also the untied output head (RTN; see the module docstring)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; known: "
                             f"{', '.join(METHODS)}")
        if self.method.startswith("int8"):
            object.__setattr__(self, "group_size", -1)
            object.__setattr__(self, "symmetric", self.method == "int8")
        if self.method != "int4_gptq":
            object.__setattr__(self, "act_order", False)
        if self.group_size > 0 and self.group_size % 8:
            raise ValueError(f"group_size must be a multiple of 8 (or <= 0), got {self.group_size}")

    @property
    def bits(self) -> int:
        return 8 if self.method.startswith("int8") else 4

    @property
    def needs_calibration(self) -> bool:
        return self.method in CALIBRATED

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def describe(self) -> str:
        head = " +lm_head" if self.lm_head else ""
        if self.bits == 8:
            return self.method + head
        gs = "per-channel" if self.group_size <= 0 else f"g{self.group_size}"
        return (f"{self.method} {gs} {'sym' if self.symmetric else 'asym'}"
                f"{' act-order' if self.act_order else ''}{head}")


def quantize_experts(w, bits: int, group_size: int, symmetric: bool, dtype) -> QuantizedWeight:
    """RTN of stacked expert kernels [E, K, N], each expert on its own grid: a QuantizedWeight
    whose arrays have a leading expert axis (packed [E, K/8 or K, N], scales [E, G, N])."""
    return jax.vmap(lambda e: quantize_rtn(e, bits, group_size, symmetric, dtype))(w)


def _rtn_layer(layer, qcfg: QuantConfig, dtype) -> None:
    for module in linear_modules(layer).values():
        w = module.kernel.get_value()
        quantize = quantize_experts if w.ndim == 3 else quantize_rtn
        module.kernel.set_value(quantize(w, qcfg.bits, qcfg.group_size, qcfg.symmetric, dtype))


def check_method(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """ValueError for a calibrated method on a mixture of experts (GPTQ and AWQ calibrate the
    dense MLP's inputs; experts are RTN-quantized)."""
    if cfg.is_moe and qcfg.needs_calibration:
        raise ValueError(f"{qcfg.method}: mixtures of experts are quantized by RTN only "
                         "(int8, int8_asym, int4_rtn)")


def _gptq_layer(runner: LayerwiseRunner, index: int, x, qcfg: QuantConfig, dtype) -> None:
    mods = linear_modules(runner.model.layers[index])
    for names in GPTQ_GROUPS:
        _, rec = runner.run_layer(index, x, record=(names[0],))  # earlier groups quantized
        h = hessian(np.asarray(rec[names[0]], np.float32))
        kernels = [np.asarray(mods[n].kernel.get_value(), np.float32) for n in names]
        qw = gptq_quantize(np.concatenate(kernels, axis=1), h, qcfg.bits, qcfg.group_size,
                           qcfg.symmetric, act_order=qcfg.act_order, damp=qcfg.damp, dtype=dtype)
        for name, part in zip(names, split_columns(qw, [k.shape[1] for k in kernels])):
            mods[name].kernel.set_value(part)


def quantize_model(cfg: ModelConfig, model, qcfg: QuantConfig,
                   calib_ids: np.ndarray | None = None, progress: bool = True, **awq_args):
    """Quantizes the decoder linears of `model` in place and returns it.

    calib_ids: int32 [B, T] calibration token rows (GPTQ and AWQ only; quant/calibration.py).
    Scales and offsets are stored in the model's float dtype. With qcfg.lm_head the untied
    output head is RTN-quantized last (ValueError for a tied head, before any work).
    """
    check_lm_head(cfg, qcfg)
    check_method(cfg, qcfg)
    dtype = model.embed_tokens.embedding.get_value().dtype
    if not qcfg.needs_calibration:
        for layer in model.layers:
            _rtn_layer(layer, qcfg, dtype)
        return _quantize_head(model, qcfg, dtype)
    if calib_ids is None:
        raise ValueError(f"{qcfg.method} needs calibration token ids")
    runner = LayerwiseRunner(cfg, model, calib_ids)
    x = runner.embed()
    layers = runner.layers(qcfg.method) if progress else range(cfg.num_layers)
    for i in layers:
        if qcfg.method == "int4_gptq":
            _gptq_layer(runner, i, x, qcfg, dtype)
        else:
            awq_layer(runner, i, x, qcfg.bits, qcfg.group_size, qcfg.symmetric, **awq_args)
        x, _ = runner.run_layer(i, x)  # inputs of the next layer
        if qcfg.method == "int4_awq":
            _rtn_layer(model.layers[i], qcfg, dtype)
    return _quantize_head(model, qcfg, dtype)


def check_lm_head(cfg: ModelConfig, qcfg: QuantConfig) -> None:
    """ValueError when qcfg asks for a quantized head of a model whose head is its embedding."""
    if qcfg.lm_head and cfg.tie_word_embeddings:
        raise ValueError("lm_head quantization needs an untied output head; this model ties it "
                         "to the token embedding (tie_word_embeddings), which stays in float")


def _quantize_head(model, qcfg: QuantConfig, dtype):
    """RTN-quantizes the untied lm_head when qcfg.lm_head; returns the model."""
    if qcfg.lm_head:
        w = model.lm_head.kernel.get_value()
        model.lm_head.kernel.set_value(
            quantize_rtn(w, qcfg.bits, qcfg.group_size, qcfg.symmetric, dtype))
    return model


def quantized_abstract_model(cfg: ModelConfig, qcfg: QuantConfig, dtype=jnp.float32):
    """The shape-only model whose decoder linears are QuantizedWeights of `qcfg` (restore target)."""
    check_lm_head(cfg, qcfg)
    check_method(cfg, qcfg)
    model = abstract_model(cfg, dtype)
    modules = [(m, qcfg.act_order) for layer in model.layers
               for m in linear_modules(layer).values()]
    if qcfg.lm_head:
        modules.append((model.lm_head, False))  # RTN: never act-order
    for module, act_order in modules:
        *experts, k, n = module.kernel.get_value().shape
        weight = abstract_quantized_weight(
            k, n, qcfg.bits, resolve_group_size(qcfg.group_size, k), qcfg.symmetric, act_order,
            dtype)
        if experts:  # stacked experts: a leading expert axis on every array
            weight = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((*experts, *a.shape), a.dtype), weight)
        module.kernel.set_value(weight)
    return model


def model_nbytes(model) -> int:
    """Bytes of all weights of the model (quantized ones as stored: codes, scales, offsets)."""
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(nnx.state(model)))


def quantize_loaded(loaded, qcfg: QuantConfig, calib_text: str | None = None,
                    calib_tokens: int = 16384, calib_seq_len: int = 512) -> dict:
    """Quantizes a quant.loader.LoadedModel in place; returns the settings to store with it.

    GPTQ and AWQ calibrate on `calib_text` (a file; None: the built-in text).
    """
    settings = qcfg.to_dict()
    calib = None
    if qcfg.needs_calibration:
        calib, description = calibration_ids(loaded.tokenizer, calib_text, calib_tokens,
                                             calib_seq_len)
        settings["calibration"] = {"text": description, "tokens": int(calib.size),
                                   "seq_len": int(calib.shape[1])}
    quantize_model(loaded.cfg, loaded.model, qcfg, calib)
    return settings
