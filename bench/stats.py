"""Summaries of a run: throughput, latency percentiles, frontend CPU per 1k tokens."""

from __future__ import annotations

import statistics

from .engine_counters import EngineCounters
from .workload import RunResult

__all__ = ["percentile", "summarize"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _ms(values: list[float]) -> dict[str, float | None]:
    return {
        f"p{int(q * 100)}": (None if (v := percentile(values, q)) is None else v * 1e3)
        for q in (0.5, 0.9, 0.99)
    }


def _engine_figures(engine: EngineCounters | None, wall_s: float) -> dict:
    if engine is None or not wall_s:
        return {}
    steps = engine.steps or None  # counted by the zero-compute executor only
    return {
        "engine_cpu_s": engine.cpu_s,
        "engine_cores": engine.cpu_s / wall_s,
        "engine_steps_per_s": steps / wall_s if steps else None,
        "engine_wait_ms_per_s": engine.wait_s / wall_s * 1e3,
        "engine_preemptions_per_s": engine.preemptions / wall_s,
        "machine_switches_per_step": engine.machine_switches / steps if steps else None,
    }


def summarize(run: RunResult, cpu_s: float | None, engine: EngineCounters | None = None) -> dict:
    """One row of results; ``cpu_s`` is the frontend process's CPU time during the run,
    ``engine`` the engine side's counters over it (bench/engine_counters.py)."""
    ok = [r for r in run.records if r.error is None and r.end is not None]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    e2e = [r.end - r.start for r in ok]
    return {
        "requests": len(run.records),
        "errors": len(run.records) - len(ok),
        "output_tokens": tokens,
        "wall_s": run.wall_s,
        "output_tok_s": tokens / run.wall_s if run.wall_s else 0.0,
        "req_s": len(ok) / run.wall_s if run.wall_s else 0.0,
        "ttft_ms": _ms(ttft),
        "itl_ms": _ms(itl),
        "e2e_ms": _ms(e2e),
        "e2e_mean_ms": statistics.fmean(e2e) * 1e3 if e2e else None,
        # Below output_tokens/requests when a frontend merges deltas (a starved server does).
        "frames_per_request": statistics.fmean(len(r.token_times) for r in ok) if ok else None,
        "frontend_cpu_s": cpu_s,
        "cpu_s_per_1k_tokens": (cpu_s / tokens * 1000) if (cpu_s is not None and tokens) else None,
        "frontend_cpu_us_per_token": (cpu_s / tokens * 1e6)
        if (cpu_s is not None and tokens)
        else None,
        "frontend_cores": cpu_s / run.wall_s if (cpu_s is not None and run.wall_s) else None,
        **_engine_figures(engine, run.wall_s),
        "ttft_samples_ms": [x * 1e3 for x in ttft],
    }
