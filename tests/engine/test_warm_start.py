"""A start finds out whether its configuration started before on a compilation cache from a
marker named by a fingerprint (engine/warm_start.py): equal for the same configuration, and
different whenever something that changes the step programs does."""
from __future__ import annotations

import jax.numpy as jnp

from configs.model import TINY_LLAMA31
from engine import warm_start
from engine.llm_engine import EngineConfig, LLMEngine
from engine.warmup import split_first
from models.weights import random_model

CONFIG = EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, page_size=16)


def engine_and_first(cfg=TINY_LLAMA31, engine_cfg=CONFIG, seed=5, dtype=jnp.float32):
    engine = LLMEngine(cfg, random_model(cfg, seed, dtype=dtype), None, engine_cfg)
    first, _ = split_first(engine.warmup_programs(), page_size=engine_cfg.page_size)
    return engine, first


def test_the_fingerprint_names_the_configuration_not_the_weights_values(monkeypatch):
    engine, first = engine_and_first()
    key = warm_start.fingerprint(engine, first)
    assert len(key) == 64 and key == warm_start.fingerprint(engine, list(first))
    # other random values of the same shapes compile to the same programs
    assert warm_start.fingerprint(*engine_and_first(seed=6)) == key
    changed = {
        "engine config": engine_and_first(engine_cfg=EngineConfig(
            max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, page_size=16)),
        "weights dtype": engine_and_first(dtype=jnp.bfloat16),
        "programs": (engine, first[:-1]),
    }
    for what, (other, programs) in changed.items():
        assert warm_start.fingerprint(other, programs) != key, what
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
    assert warm_start.fingerprint(engine, first) != key, "XLA_FLAGS"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(warm_start, "source_digest", lambda: "edited source")
    assert warm_start.fingerprint(engine, first) != key, "source"


def test_the_source_digest_follows_every_package_file(tmp_path):
    for package in warm_start.SOURCE_PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "a.py").write_text("x = 1\n")
    digest = warm_start.source_digest(tmp_path)
    assert digest == warm_start.source_digest(tmp_path)
    (tmp_path / "ops" / "sub").mkdir()
    (tmp_path / "ops" / "sub" / "b.py").write_text("y = 2\n")
    with_file = warm_start.source_digest(tmp_path)
    assert with_file != digest
    (tmp_path / "ops" / "sub" / "b.py").write_text("y = 3\n")
    edited = warm_start.source_digest(tmp_path)
    assert edited not in (digest, with_file)
    (tmp_path / "scripts").mkdir()  # not a package whose source decides the programs
    (tmp_path / "scripts" / "c.py").write_text("z = 4\n")
    assert warm_start.source_digest(tmp_path) == edited


def test_a_marker_is_found_only_after_it_is_written(tmp_path):
    cache = str(tmp_path / "cache")
    assert not warm_start.started_before(cache, "a" * 64)
    warm_start.mark_started(cache, "a" * 64)
    warm_start.mark_started(cache, "a" * 64)  # again: no error
    assert warm_start.started_before(cache, "a" * 64)
    assert not warm_start.started_before(cache, "b" * 64)
