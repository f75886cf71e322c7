"""The sharded-inference scenarios run in subprocesses with fake CPU devices (scenarios.py).

The first test that asks for a scenario starts all of them at once, so their compile and
collective-wait time overlaps on the CI machine's cores; each test then waits for its own.

Under pytest-xdist (`make test` runs two workers) each worker has its own session, so each
scenario is claimed by one worker only: the worker that takes its lock file (in the run's
shared temporary directory) runs it and publishes the result there; another worker that needs
it waits on the lock and reads the result (or runs it itself if the owner died without one).
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import json
import os

import pytest

from tests.sharding.scenarios import run_scenario, run_workers

SCENARIOS = ("tiny", "hlo", "checkpoint", "smollm2")


def _jobs() -> dict:
    jobs = {name: functools.partial(run_scenario, name) for name in SCENARIOS}
    jobs["workers"] = run_workers
    return jobs


def _claim(shared, name: str):
    """This worker's lock on scenario `name` (an open file), or None if another worker has it."""
    lock = open(shared / f"{name}.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def _publish(shared, name: str, lock, future) -> None:
    """Writes the scenario's result (or its failure) for the other workers, then unlocks."""
    try:
        try:
            payload = {"result": future.result()}
        except BaseException as e:  # noqa: BLE001 - the waiting worker raises it
            payload = {"error": f"{type(e).__name__}: {e}"}
        tmp = shared / f"{name}.json.tmp"
        tmp.write_text(json.dumps(payload))
        tmp.rename(shared / f"{name}.json")
    finally:
        lock.close()


def _wait_for(shared, name: str, job):
    """Another worker's result of scenario `name`, once its lock is free."""
    with open(shared / f"{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = shared / f"{name}.json"
        if not path.exists():  # its owner ended without a result: run it here
            return job()
        payload = json.loads(path.read_text())
    if "error" in payload:
        raise AssertionError(f"scenario {name} failed in another worker: {payload['error']}")
    return payload["result"]


@pytest.fixture(scope="session")
def scenario(tmp_path_factory):
    shared = (tmp_path_factory.getbasetemp().parent
              if os.environ.get("PYTEST_XDIST_WORKER") else None)
    jobs = _jobs()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs))
    futures = {}
    for name, job in jobs.items():
        lock = None
        if shared is not None:
            lock = _claim(shared, name)
            if lock is None:
                continue  # another worker runs it
        futures[name] = pool.submit(job)
        if lock is not None:
            futures[name].add_done_callback(functools.partial(_publish, shared, name, lock))

    def get(name):
        if name in futures:
            return futures[name].result()
        return _wait_for(shared, name, jobs[name])

    yield get
    pool.shutdown(wait=True, cancel_futures=True)
