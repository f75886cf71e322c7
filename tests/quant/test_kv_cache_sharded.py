"""The int8 KV cache over a (data, model) mesh of fake CPU devices, in a subprocess (jax fixes
its device count at start): pages and scales split alike, the tokens of one device."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.sharding.scenarios import MARK, ROOT, device_env

SHARDED = """
import json
from engine.llm_engine import LLMEngine
from engine.engine_config import EngineConfig
from engine.mesh import make_mesh
from engine.request import SamplingParams
from ops.kv_quant import QuantizedPages
from tests.sharding.scenarios import tiny_model, tiny_prompts
cfg, model = tiny_model("tiny-llama31", None)
prompts = tiny_prompts(cfg)[:2]
tokens = {}
for name, mesh in (("one", None), ("2x2", make_mesh(2, 2))):
    engine = LLMEngine(cfg, model, engine_cfg=EngineConfig(
        max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
        kv_cache_dtype="int8"), mesh=mesh)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    tokens[name] = [o.output_ids for o in outs]
    tokens[name + "_dtype"] = str(engine.runner.cache.dtype)
    cache = engine.runner.cache  # one device: every layer in one stacked array (the scan)
    tokens[name + "_scales"] = sum(isinstance(cache.layer(i)[0], QuantizedPages)
                                   for i in range(cache.num_layers))
print("RESULT " + json.dumps(tokens))
"""


def test_sharded_int8_cache_gives_one_devices_tokens():
    """tiny-llama31 on a 2x2 mesh of fake CPU devices (KV heads split over model, pages over
    data, scales alike) against one device, both with int8 pages."""
    proc = subprocess.run([sys.executable, "-c", SHARDED], cwd=ROOT, env=device_env(4, False),
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len(MARK):])
    assert result["one_dtype"] == result["2x2_dtype"] == "int8"
    assert result["2x2_scales"] == result["one_scales"] == 2  # both layers have scales
    assert result["2x2"] == result["one"]
