"""The sharded-inference scenarios run in subprocesses with fake CPU devices (scenarios.py).

The first test that asks for a scenario starts all of them at once, so their compile and
collective-wait time overlaps on the CI machine's cores; each test then waits for its own.
"""
from __future__ import annotations

import concurrent.futures

import pytest

from tests.sharding.scenarios import run_scenario, run_workers

SCENARIOS = ("tiny", "hlo", "checkpoint", "smollm2")


@pytest.fixture(scope="session")
def scenario():
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(SCENARIOS) + 1)
    futures = {name: pool.submit(run_scenario, name) for name in SCENARIOS}
    futures["workers"] = pool.submit(run_workers)
    yield lambda name: futures[name].result()
    pool.shutdown(wait=True, cancel_futures=True)
