"""engine.api.load_engine builds the engine scripts.generate builds: the same prepared model and
the same greedy tokens, from Python."""
from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from engine.api import load_engine, load_prepared
from engine.llm_engine import EngineConfig
from engine.request import SamplingParams
from engine.speculative import SpecConfig
from tests.scripts.test_scripts import TINY_DIR, run_script

PROMPTS = ("hello there", "the sea")
FUSED_LINE = "model: q/k/v and gate/up projections fused"


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


def test_load_engine_generates_what_the_command_generates():
    result = run_script("generate", f"--model={TINY_DIR}", *(f"--prompt={p}" for p in PROMPTS),
                        "--json", "--max_tokens=10", "--nowarmup", "--fuse_projections=true")
    assert result.returncode == 0, result.stderr[-2000:]
    want = [json.loads(line)["token_ids"] for line in result.stdout.strip().splitlines()]
    assert FUSED_LINE in result.stderr

    notes = []
    engine = load_engine(TINY_DIR, fuse_projections=True, log=notes.append)
    assert notes == [FUSED_LINE] and engine.cfg.fused_projections
    ids = [chat_ids(engine.tokenizer, p) for p in PROMPTS]
    outputs = engine.generate(ids, SamplingParams(max_tokens=10))
    assert [o.output_ids for o in outputs] == want


def test_defaults_on_the_cpu():
    """On the CPU: float32 weights, projections fused (auto, logged), and an engine config built
    from the loaded config."""
    notes = []
    loaded, settings = load_prepared(TINY_DIR, log=notes.append)
    assert settings is None and loaded.cfg.fused_projections
    assert notes == ["model: q/k/v and gate/up projections fused"]
    assert loaded.model.embed_tokens.embedding.get_value().dtype == jnp.float32
    seen = []
    engine = load_engine(TINY_DIR, engine_config=lambda c: seen.append(c) or EngineConfig(
        max_model_len=64, max_num_seqs=2))
    assert seen == [engine.cfg] and engine.engine_cfg.max_num_seqs == 2


def test_bad_requests_fail_before_loading():
    with pytest.raises(ValueError, match="needs a draft model"):
        load_engine("no-such-model", speculative=SpecConfig("draft"))
    with pytest.raises(ValueError, match=r"\(--gemv_layers\) needs fused projections"):
        load_prepared("no-such-model", fuse_projections=False, gemv_layers=True)
