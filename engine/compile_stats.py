"""How many programs this process compiled and how many it loaded from jax's persistent
compilation cache, from jax's monitoring events: the start-up summary's figures.

jax reports every backend compile request (a compile or a cache load) with its duration, and
every persistent-cache hit apart; a compile is a request that was not a hit. `count_compiles`
registers the listeners once per process; `compile_stats()` is a snapshot, and the difference
of two snapshots covers what happened between them.
"""
from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


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
        """'N programs: C compiled, L loaded from the compilation cache (S s of compiling)':
        S sums every program's compile time, so it exceeds the wall time when programs compile
        side by side."""
        return (f"{self.programs} programs: {self.compiled} compiled, {self.loaded} loaded from "
                f"the compilation cache ({self.seconds:.1f}s of compiling)")


_lock = threading.Lock()
_totals = {"programs": 0, "loaded": 0, "seconds": 0.0}
_listening = False


def _on_duration(event: str, duration: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["programs"] += 1
            _totals["seconds"] += duration


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


def compile_stats() -> CompileStats:
    """The counts since `count_compiles` was first called."""
    with _lock:
        return CompileStats(**_totals)
