"""`scripts.serve` with every engine step taking at least STEP_SECONDS: a stream of 480 tokens
then runs for 480 * STEP_SECONDS on any machine, so a shutdown test can count on requests
still running at its deadline however fast the host decodes the tiny model."""
from __future__ import annotations

import time

from absl import app

from engine.llm_engine import LLMEngine
from scripts import serve

STEP_SECONDS = 0.05


def paced(step):
    def step_at_least(self):
        start = time.monotonic()
        deltas = step(self)
        time.sleep(max(STEP_SECONDS - (time.monotonic() - start), 0.0))
        return deltas
    return step_at_least


if __name__ == "__main__":
    LLMEngine.step = paced(LLMEngine.step)
    app.run(serve.main)
