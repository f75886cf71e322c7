"""scripts/bench_wgmma.py: its sweep's configurations (ops.quant_wgmma.sweep_configs), and a
run on the CPU (check, table and bounds modes), where every kernel row records why it did not
run (the kernel needs a Hopper GPU). No timing is asserted."""
from __future__ import annotations

import json
import subprocess
import sys

from ops import quant_wgmma as qw


def run_bench(*args: str) -> subprocess.CompletedProcess:
    """scripts/bench_wgmma.py with `args` on the CPU."""
    return subprocess.run([sys.executable, "-m", "scripts.bench_wgmma", *args],
                          capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


def test_sweep_configs_are_taken_by_the_kernel():
    for bits, k, n in ((4, 4096, 28672), (8, 4096, 4096), (4, 14336, 4096)):
        configs = qw.sweep_configs(bits, k, n, 16)
        assert configs
        assert {c.instruction for c in configs} == {"wgmma", "mma"}
        assert {c.consumers for c in configs} >= {0, 2}
        assert {c.instruction for c in qw.sweep_configs(bits, k, n, 64)} == {"wgmma"}
        group = 128 if bits == 4 else k
        for cfg in configs:
            assert qw.supports(bits, 16, k, n, group, "bfloat16", "bfloat16", cfg), cfg
            columns = cfg.block_n * max(1, cfg.consumers)  # per program / per unit
            programs = n // columns * cfg.num_splits
            if cfg.consumers:  # the persistent kernel: work for every SM of an H200, or
                steps = k // cfg.block_k // cfg.num_splits  # splits of two steps at the most
                assert (programs >= 132 and steps >= 2) or steps == 2, cfg
            else:
                assert 120 <= programs <= 1100 or cfg.num_splits == 1
    large = qw.sweep_configs(4, 4096, 28672, 1024)  # prefill: row tiles
    assert len({c.block_m for c in large}) >= 3 and all(c.num_splits == 1 for c in large)
    assert {c.consumers for c in large} == {0, 2}  # and the warp-specialized row tiles
    assert {c.block_n for c in large if c.consumers} == {64, 128}
    assert all(qw.supports(4, 1024, 4096, 28672, 128, "bfloat16", "bfloat16", c) for c in large)


def test_bench_wgmma_on_the_cpu(tmp_path):
    out = tmp_path / "wgmma.json"
    proc = run_bench("--modes=check,table,bounds,tiles,run", "--tiles=256/3/128/1,128/2/64/16",
                     "--shapes=768x512", "--ms=2", "--calls=1", "--queue=1", "--xla",
                     "--run_removed=product", f"--json_out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    checks = [r for r in rows if r["mode"] == "check"]
    times = [r for r in rows if r["mode"] == "time" and "probe" not in r][:9]
    probes = [r for r in rows if "probe" in r and "/" not in r["probe"]]
    tiles = [r for r in rows if "probe" in r and "/" in r["probe"]]
    assert checks and all("needs a Hopper GPU" in r["error"] for r in checks)
    runs = [r for r in rows if r["mode"] == "run"]  # the Nsight Compute target: why not here
    assert len(runs) == 2 and all("needs a Hopper GPU" in r["error"] for r in runs)
    assert all("WgmmaConfig(" in r["config"] for r in runs)
    assert all(r["removed"] == ["product"] for r in runs)
    assert [(r["impl"], r["bits"]) for r in times] == [
        ("bf16", 16), ("wgmma", 4), ("mma", 4), ("ws", 4), ("xla", 4), ("wgmma", 8), ("mma", 8),
        ("ws", 8), ("xla", 8)]
    assert all("instruction='mma'" in r["config"] for r in times if r["impl"] == "mma")
    assert "no device events" in times[0]["dev_error"]
    assert all("needs a Hopper GPU" in r["dev_error"] for r in times[1:]
               if r["impl"] != "xla")
    # XLA's dequantize + dot of the same codes: no device time on the CPU (under jax's
    # profiler the CPU's XLA refuses the bf16 dot behind the gather of x into the codes' K
    # order; without the profiler it runs)
    assert all(r["dev_error"] for r in times if r["impl"] == "xla")
    assert {r["k_order"] for r in times if r["impl"] != "bf16"} == {"wgmma"}  # the model's
    assert {r["k_order"] for r in runs} == {"wgmma"}
    # bounds: per shape XLA's read of the per-channel codes' bytes (no device times here),
    # then per M a bf16 row, then the kernel as it is and with parts taken out
    reads = [r for r in rows if r.get("impl", "").startswith("read_")]
    assert [(r["impl"], r["M"]) for r in reads] == [("read_int4", 0), ("read_int8", 0)]
    assert all("no reduction form ran" in r["error"] for r in reads)
    assert [(r["probe"], r["bits"], r["group"]) for r in probes] == [
        ("int4 grouped", 4, 128), ("int4 per channel", 4, 768),
        ("int4 per channel, noconvert", 4, 768), ("int4 per channel, noload", 4, 768),
        ("int4 per channel, pipeline only", 4, 768), ("int4 per channel, 256-K steps", 4, 768),
        ("int4 per channel, 512-K steps", 4, 768), ("int8 per channel", 8, 768),
        ("int8 per channel, noconvert", 8, 768), ("int8 per channel, noload", 8, 768),
        ("int8 per channel, pipeline only", 8, 768)]
    for r in probes:  # 768 K: no whole steps of 512 (a row says so)
        if r["probe"].endswith("512-K steps"):
            assert "do not take 2x768x512" in r["error"]
        else:
            assert "needs a Hopper GPU" in r["dev_error"]
    # tiles: each probe at each tile; 16 splits of 128 K do not divide 768 K
    names = ("int4 grouped", "int4 per channel", "int4 per channel, pipeline only",
             "int4 grouped, contiguous tiles", "int4 per channel, pipeline only, contiguous tiles",
             "int8 per channel", "int8 per channel, pipeline only")
    assert [r["probe"] for r in tiles] == [f"{p} {t}" for t in ("256/3/128/1", "128/2/64/16")
                                           for p in names]
    for r in tiles:
        if r["probe"].endswith("/16"):
            assert "num_splits=16" in r["error"] and "do not take 2x768x512" in r["error"]
        else:
            assert "block_k=256" in r["config"] and "needs a Hopper GPU" in r["dev_error"]


def test_kernel_us_leaves_the_wrappers_out():
    """kernel_us sums the profiler's Mosaic GPU kernels of a row (in a subprocess: the script
    defines absl flags)."""
    code = ("from scripts.bench_wgmma import kernel_us\n"
            "row = {'kernels': {'int4_wgmma_mosaic_gpu_kernel': 22.33, 'wrapped_gather': 1.7}}\n"
            "print(kernel_us(row), row['kernel_us'], kernel_us({'kernels': {'gemm': 5.0}}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["22.33", "22.33", "None"]


def test_bench_wgmma_names_an_unknown_removed_part():
    proc = run_bench("--modes=run", "--run_removed=math")
    assert proc.returncode != 0 and "--run_removed" in proc.stderr and "math" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_wgmma_tiles_change_the_dispatch_tiles(tmp_path):
    """--tiles: '-' keeps the dispatch's value, name=value sets block_m or consumers;
    --tile_probes (one a flag: the names hold commas) keeps the probes named; a malformed tile
    or an unknown probe is a usage error naming the flag."""
    out = tmp_path / "tiles.json"
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench_wgmma", "--modes=tiles", "--bits=4",
         "--tiles=-/-/-/-,-/3/-/-/block_m=8", "--tile_probes=int4 grouped",
         "--tile_probes=int4 per channel, pipeline only",
         "--shapes=768x512", "--ms=2", "--calls=1", "--queue=1", f"--json_out={out}"],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tiles = [r for r in json.loads(out.read_text())["rows"] if "probe" in r]
    assert [r["probe"] for r in tiles] == [
        "int4 grouped -/-/-/-", "int4 per channel, pipeline only -/-/-/-",
        "int4 grouped -/3/-/-/block_m=8", "int4 per channel, pipeline only -/3/-/-/block_m=8"]
    tiles = tiles[::2]  # int4 grouped at each tile
    # the dispatch's at 2 rows without a K split: two stages
    assert "stages=2" in tiles[0]["config"] and "block_m=0" in tiles[0]["config"]
    assert "stages=3" in tiles[1]["config"] and "block_m=8" in tiles[1]["config"]
    assert all("needs a Hopper GPU" in r["dev_error"] for r in tiles)
    for bad, flag in (("--tiles=256/4/128", "--tiles"), ("--tiles=-/-/-/-/lanes=2", "--tiles"),
                      ("--tile_probes=int4 fast", "--tile_probes")):
        proc = subprocess.run([sys.executable, "-m", "scripts.bench_wgmma", "--modes=tiles",
                               bad], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode != 0 and flag in proc.stderr and "Traceback" not in proc.stderr



def test_resume_reuses_the_timed_rows_and_times_the_rest(tmp_path):
    """--resume: rows of the earlier file with a device time (here given one by hand: the CPU
    has none) come back as they were; the rest are timed again; a file of another device or
    no --json_out is refused with a one-line reason."""
    out = tmp_path / "wgmma.json"
    args = ["--modes=table,tiles", "--forms=", "--bits=4", "--shapes=768x512", "--ms=2",
            "--calls=1", "--queue=1", "--tiles=256/3/128/1", "--tile_probes=int4 grouped",
            f"--json_out={out}"]
    first = run_bench(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert [(r["impl"], r.get("probe")) for r in rows] == [
        ("bf16", None), ("wgmma", None), ("bf16", None), ("wgmma", "int4 grouped 256/3/128/1")]
    assert len({r["request"] for r in rows}) == 3  # the two bf16 rows are the same product
    for i, us in ((0, 7.5), (3, 2.25)):  # as if the bf16 and the probe row had been timed
        rows[i] = {k: v for k, v in rows[i].items() if k != "dev_error"} | {
            "dev_us": us, "TBps": 1.0}
    out.write_text(json.dumps(saved))

    again = run_bench(*args, "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "--resume: 2 timed rows" in again.stdout
    resumed = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r.get("resumed", False), r.get("dev_us")) for r in resumed] == [
        ("bf16", True, 7.5), ("wgmma", False, None), ("bf16", True, 7.5),
        ("wgmma", True, 2.25)]
    assert "needs a Hopper GPU" in resumed[1]["dev_error"]  # timed again
    assert resumed[3]["probe"] == "int4 grouped 256/3/128/1"
    assert resumed[3]["x_bf16"] == 7.5 / 2.25

    other = json.loads(out.read_text())
    other["device"] = "NVIDIA H200"
    out.write_text(json.dumps(other))
    refused = run_bench(*args, "--resume")
    assert refused.returncode != 0 and "NVIDIA H200" in refused.stderr
    assert "Traceback" not in refused.stderr
    alone = run_bench("--modes=table", "--resume")
    assert alone.returncode != 0 and "--resume needs --json_out" in alone.stderr
    assert "Traceback" not in alone.stderr
