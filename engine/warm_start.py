"""Whether this exact configuration has started before on a compilation cache, without compiling
anything to find out: a marker file named by a fingerprint of everything that decides the step
programs, written once a start has compiled its first programs.

A server compiles its first programs before it listens when the cache is cold, and leaves them
to the background when it is warm (each then loads in a fraction of a second). Finding that out
by compiling one program alone first cost a cold start that program's whole compile (2.8 s of a
llama3.2-1b start on an H100) before the others began. The fingerprint covers the engine and
model configurations, speculation, the programs, each runner's (the draft model's too) kernel
choice and its weights' and KV cache's shapes, dtypes and shardings, the devices, jax's version
and configuration, the `XLA_*` / `JAX_*` / `PALLASITE_*` environment and the engine's own
source code: what jax's cache keys cover (the source through the programs it traces). A marker
can outlive its cache entries (a cache emptied by hand): then the first requests compile what
they reach, and the server logs it (engine/compile_stats.py).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax
import jax.extend

# Environment variables that change what a program compiles to.
SETTING_PREFIXES = ("XLA_", "JAX_", "PALLASITE_")
# The project's packages whose source decides the step programs.
SOURCE_PACKAGES = ("configs", "engine", "models", "ops", "quant")
MARKER_DIR = "pallasite-started"


def settings_environment() -> dict[str, str]:
    """The environment variables of SETTING_PREFIXES, sorted by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SETTING_PREFIXES)}


def source_digest(root: Path = Path(__file__).resolve().parent.parent) -> str:
    """sha256 of the Python sources of SOURCE_PACKAGES under `root`, by relative path."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def arrays_layout(tree) -> list:
    """Each array's path, shape, dtype and sharding."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return [(jax.tree_util.keystr(path), leaf.shape, str(leaf.dtype),
             str(getattr(leaf, "sharding", None))) for path, leaf in leaves]


def fingerprint(engine, programs: list) -> str:
    """sha256 over what decides the compiled `programs` of `engine` (an LLMEngine)."""
    backend = jax.extend.backend.get_backend()
    runners = [engine.runner] + ([engine.draft.runner] if engine.draft is not None else [])
    parts = [engine.engine_cfg, engine.cfg, engine.spec_config, programs,
             [(r.kernels, arrays_layout(r.state), arrays_layout(r.cache)) for r in runners],
             [d.device_kind for d in jax.devices()],
             backend.platform, backend.platform_version, jax.__version__,
             sorted(jax.config.values.items()), settings_environment(), source_digest()]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def marker_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir) / MARKER_DIR / key


def started_before(cache_dir: str, key: str) -> bool:
    """Whether a start of fingerprint `key` has compiled its first programs into cache_dir."""
    return marker_path(cache_dir, key).exists()


def mark_started(cache_dir: str, key: str) -> None:
    """Records that the first programs of fingerprint `key` are in cache_dir."""
    path = marker_path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
