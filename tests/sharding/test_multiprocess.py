"""Two processes joined by jax.distributed on loopback (4 fake CPU devices each) give the
outputs of one process, with the mesh spanning both (dp across them, and tp=8 across them)."""
from __future__ import annotations


def test_two_processes_equal_one(scenario):
    first, second = scenario("workers")
    for r in (first, second):
        assert (r["process_count"], r["local_devices"], r["devices"]) == (2, 4, 8)
    expected = first["one_device"]["tokens"]
    for mesh in ("4x2", "8x1"):
        assert first[mesh]["tokens"] == expected
        assert second[mesh]["tokens"] == expected  # every process steps the same engine
    assert "one_device" not in second  # only process 0 did the extra reference run
