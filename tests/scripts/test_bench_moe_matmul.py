"""scripts/bench/moe_matmul.py on the CPU, the Pallas forms interpreted, on tiny-qwen3-moe's
shapes: every form answers within two bf16 roundings of the tiles form, for each of a decode
layer's products. No timing is asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_bench(tmp_path, *flags: str) -> list[dict]:
    out = tmp_path / "moe_matmul.json"
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench.moe_matmul", "--impl=pallas_interpret",
         "--model=tiny-qwen3-moe", "--rows=4,32", "--copies=2", "--runs=1",
         f"--json_out={out}", *flags],
        capture_output=True, text=True, timeout=600,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
             "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["rows"]


@pytest.mark.parametrize("projection,quant", [("gate_up", "none"), ("down", "int8")])
def test_every_form_answers(tmp_path, projection, quant):
    """The gathered form and the one-row kernel up to E = 8 rows (32 rows: a clear error),
    the grouped kernel, the kernel over gated rows and the router kernel at both sizes; each
    answer within two bf16 roundings (2^-7 of the largest value) of its reference, a time and
    a floor per row."""
    rows = run_bench(tmp_path, f"--projection={projection}", f"--quant={quant}",
                     "--forms=gathered,kernel,kernel_gated,grouped,tiles,router,router_xla")
    by = {(r["rows"], r["form"]): r for r in rows}
    assert "at most E=8 rows" in by[(32, "gathered")]["error"]
    for (n, form), row in by.items():
        if n == 32 and form == "gathered":
            continue
        assert "error" not in row, (n, form, row.get("error"))
        # two bf16 roundings: the output's, and the tiles form's of its dequantized experts
        assert row["max_rel_err"] < 2.0 ** -7 and row["step_s"] > 0 and row["floor_s"] > 0


def test_crowded_routing(tmp_path):
    """--routing=crowded: every token chooses the same k experts, so only k experts are
    touched; the grouped kernel still answers as the tiles form does."""
    rows = run_bench(tmp_path, "--projection=gate_up", "--quant=int8", "--routing=crowded",
                     "--forms=grouped,tiles")
    for row in rows:
        assert "error" not in row, row.get("error")
        assert row["touched_experts"] == 3  # tiny-qwen3-moe: top 3 of 8
        assert row["max_rel_err"] < 2.0 ** -7
