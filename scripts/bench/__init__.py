"""Benchmarks: serving, decode (the memory roofline), attention, matmul and speculative decoding.
Each runs as `python -m scripts.bench.<name>`, prints a short table and writes JSON."""
