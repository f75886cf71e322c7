"""Random weights for engine tests at a scale where every layer matters.

The default 0.02 initializer makes every layer a near no-op; here kernels give unit-variance
outputs, embeddings are standard normal, biases 0.5 x normal, norm weights 1 +- 0.2, and the
final norm's scale `final_norm` sets the spread of the logits (0.3: standard deviation about 2).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from configs.model import ModelConfig
from models.weights import model_from_pure_dict, random_model


def unit_scale_pure_dict(cfg: ModelConfig, seed: int, final_norm: float = 0.3) -> dict:
    """The weights in the model's own pure-dict layout (float32 numpy leaves)."""
    pure = nnx.to_pure_dict(nnx.state(random_model(cfg, seed)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name, parent, shape = path[-1].key, path[-2].key, np.shape(leaf)
        if name == "embedding":
            values = rng.standard_normal(shape)
        elif name == "kernel":  # [in, out]: unit-variance outputs
            values = rng.standard_normal(shape) / math.sqrt(shape[0])
        elif name == "bias":
            values = 0.5 * rng.standard_normal(shape)
        else:
            assert name == "weight", path
            values = (final_norm if parent == "norm" else 1.0) * (
                1.0 + 0.2 * rng.standard_normal(shape))
        return values.astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, pure)


def unit_scale_model(cfg: ModelConfig, seed: int, final_norm: float = 0.3):
    """The model of `unit_scale_pure_dict`."""
    return model_from_pure_dict(cfg, unit_scale_pure_dict(cfg, seed, final_norm))
