"""How many programs this process compiled and how many it loaded from jax's persistent
compilation cache, from jax's monitoring events: the start-up summary's figures.

jax reports every backend compile request (a compile or a cache load) with its duration, and
every persistent-cache hit apart; a compile is a request that was not a hit. `count_compiles`
registers the listeners once per process; `compile_stats()` is a snapshot, and the difference
of two snapshots covers what happened between them. `report_serving_compiles` makes a server say
when a step had to compile a program that warm-up had not compiled ahead, since that holds up
every running request.
"""
from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Name prefix of the threads that compile ahead of time (engine/warmup.py's pool and
# LLMEngine.compile_in_background's thread): their compiles hold up no step.
AHEAD_OF_TIME_THREADS = "compile"


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """programs: backend compile requests; loaded: those the persistent cache served;
    seconds: their total time (compiling or loading)."""

    programs: int = 0
    loaded: int = 0
    seconds: float = 0.0

    @property
    def compiled(self) -> int:
        return self.programs - self.loaded

    def __sub__(self, other: "CompileStats") -> "CompileStats":
        return CompileStats(self.programs - other.programs, self.loaded - other.loaded,
                            self.seconds - other.seconds)

    def describe(self) -> str:
        """'N programs: C compiled, L loaded from the compilation cache (S s of compiling,
        summed over the programs)': S sums every program's compile time, so it exceeds the wall
        time when programs compile side by side, and says so."""
        return (f"{self.programs} programs: {self.compiled} compiled, {self.loaded} loaded from "
                f"the compilation cache ({self.seconds:.1f}s of compiling, summed over the "
                f"programs)")


_lock = threading.Lock()
_totals = {"programs": 0, "loaded": 0, "seconds": 0.0}
_listening = False
_serving_report = None  # (log, min_seconds) after report_serving_compiles


def _on_duration(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["programs"] += 1
            _totals["seconds"] += duration
            report = _serving_report
        thread = threading.current_thread().name
        if (report is not None and duration >= report[1]
                and not thread.startswith(AHEAD_OF_TIME_THREADS)):
            report[0](f"a step compiled a program on the serving path in {duration:.1f}s "
                      f"(thread {thread}): a shape that warm-up had not compiled yet")


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _totals["loaded"] += 1


def count_compiles() -> None:
    """Starts counting this process's compiles and cache loads (idempotent)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def report_serving_compiles(log, min_seconds: float = 1.0) -> None:
    """From now on (and counting compiles), log(line) for every compile request of at least
    min_seconds made outside the ahead-of-time compile threads (AHEAD_OF_TIME_THREADS): a
    program that a step needed before warm-up or the background compile had made it. log None:
    stop."""
    global _serving_report
    count_compiles()
    with _lock:
        _serving_report = None if log is None else (log, min_seconds)


def compile_stats() -> CompileStats:
    """The counts since `count_compiles` was first called."""
    with _lock:
        return CompileStats(**_totals)
