"""orbax checkpoints restore onto any mesh: saved at tp=2, restored at tp=4 x dp=2."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("case", ["tiny-llama31/float32", "tiny-llama31/int4_rtn"])
def test_saved_at_tp2_restores_at_tp4(scenario, case):
    result = scenario("checkpoint")
    if case not in result:
        pytest.skip("quantized weights (quant/) are not available")
    r = result[case]
    assert r["weights_equal"]
    assert r["restored_tp4"]["tokens"] == r["reference"]["tokens"]
    specs = r["specs"]
    q = [s for k, s in specs.items() if "[0]['self_attn']['q_proj']['kernel']" in k]
    assert q and all("'model'" in s for s in q[:2])  # restored straight onto its tp=4 shards
    k = [s for k, s in specs.items() if "[0]['self_attn']['k_proj']['kernel']" in k]
    assert all("model" not in s for s in k)  # 2 stored KV heads: whole, repeated at run time


def test_converter_layout_stores_tp8_shards(scenario):
    result = scenario("checkpoint")
    # tiny-llama31: vocab 256 and intermediate 160 split in 8 along their parallel axis.
    assert result["storage_chunks"] == {"embedding": [32, 64], "down_proj": [20, 64]}
    assert result["storage_restored_equal"]
