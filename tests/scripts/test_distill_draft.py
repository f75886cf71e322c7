"""scripts/distill_draft.py end to end on the tiny golden model: training lowers the KL, and the
saved checkpoint loads and serves as the engine's draft model (greedy output unchanged)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from engine.llm_engine import EngineConfig, LLMEngine
from engine.request import SamplingParams
from engine.speculative import SpecConfig
from quant.loader import load_model
from tests.conftest import GOLDEN_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_DIR = os.path.join(GOLDEN_DIR, "tiny-llama")


def run_distill(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "scripts.distill_draft", "--compilation_cache_dir=",
           f"--model={TINY_DIR}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_distilled_draft_learns_and_drafts_for_the_engine(tmp_path):
    output, figures_file = tmp_path / "draft", tmp_path / "figures.json"
    result = run_distill("--num_layers=1", "--steps=40", "--seq_len=32", "--batch_size=4",
                         "--eval_rows=4", "--learning_rate=3e-3", "--num_tokens=4000",
                         f"--output={output}", f"--json_out={figures_file}")
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(figures_file.read_text())
    assert figures["target_layers"] == [0]
    assert figures["after"]["kl"] < 0.9 * figures["before"]["kl"], figures
    losses = figures["losses"]
    assert len(losses) == 40 and np.mean(losses[-5:]) < np.mean(losses[:5]), losses

    target, draft = load_model(TINY_DIR), load_model(str(output))
    assert draft.cfg == target.cfg.replace(num_layers=1, name=draft.cfg.name)
    text = "the sea and the sky and the sea"
    assert draft.tokenizer.encode(text) == target.tokenizer.encode(text)

    engine_cfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64,
                              page_size=16, num_pages=8)
    prompts = [target.tokenizer.encode(p) for p in (text, "license: the software is provided")]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLMEngine(target.cfg, target.model, target.tokenizer, engine_cfg)
    want = [o.output_ids for o in plain.generate(prompts, params)]
    spec = LLMEngine(target.cfg, target.model, target.tokenizer, engine_cfg,
                     SpecConfig("draft", 3), (draft.cfg, draft.model))
    spec.runner.share_programs(plain.runner)  # same target: reuse its compiled programs
    assert [o.output_ids for o in spec.generate(prompts, params)] == want
    assert spec.spec_stats.num_drafts > 0


def test_distill_rejects_bad_settings(tmp_path):
    result = run_distill("--num_layers=3", f"--output={tmp_path / 'x'}")
    assert result.returncode == 1 and "--num_layers" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    existing = tmp_path / "exists"
    existing.mkdir()
    result = run_distill(f"--output={existing}")
    assert result.returncode == 1 and "--overwrite" in result.stderr, result.stderr[-2000:]
