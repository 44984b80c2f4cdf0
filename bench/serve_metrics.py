"""A run's metrics under the names ``vllm bench serve --save-result`` writes, so files compare.

TTFT, TPOT (per output token after the first), ITL (gap between streamed
outputs) and E2EL (end-to-end latency): mean, median, std and the chosen
percentiles, in ms, with numpy's default (linear) percentile; goodput counts
requests within every SLO given (ms), as vLLM's ``--goodput ttft:X tpot:Y e2el:Z``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from .stats import percentile
from .workload import RequestRecord

__all__ = ["serve_metrics", "parse_goodput", "SLO_METRICS"]

SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput {item!r}: {value!r} is not a number") from None
        if slos[name] <= 0:
            raise ValueError(f"goodput {item!r}: must be above 0")
    return slos


def _tpot(record: RequestRecord) -> float:
    """Seconds per output token after the first (0 for one token, as vLLM counts it)."""
    if record.output_tokens <= 1 or record.ttft is None or record.end is None:
        return 0.0
    return (record.end - record.start - record.ttft) / (record.output_tokens - 1)


def _summary(name: str, seconds: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = seconds or [0.0]
    out = {
        f"mean_{name}_ms": statistics.fmean(values) * 1e3,
        f"median_{name}_ms": statistics.median(values) * 1e3,
        f"std_{name}_ms": statistics.pstdev(values) * 1e3,
    }
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = (percentile(values, p / 100) or 0.0) * 1e3
    return out


def _first_error_by_code(records: Sequence[RequestRecord]) -> dict[str, str]:
    """Each failure code's first message, in request order."""
    first: dict[str, str] = {}
    for r in records:
        if r.error is not None and r.error not in first:
            first[r.error] = r.error_message
    return first


def serve_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    percentiles: Sequence[float] = (50, 90, 99),
    goodput: dict[str, float] | None = None,
) -> dict:
    """The result dict of one run, in request order (``records[i]`` is request i)."""
    ok = [r for r in records if r.error is None and r.end is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [_tpot(r) for r in ok if r.output_tokens > 1]
    itls = [gap for r in ok for gap in r.itls]
    e2els = [r.end - r.start for r in ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    good = None
    if goodput:
        good = 0
        for r in ok:
            observed = {"ttft": r.ttft or 0.0, "tpot": _tpot(r), "e2el": r.end - r.start}
            if all(observed[k] * 1e3 <= slo for k, slo in goodput.items()):
                good += 1
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    result: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) * per_s,
        "request_goodput": None if good is None else good * per_s,
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.error is None else 0 for r in records],
        "ttfts": [(r.ttft or 0.0) if r.error is None else 0.0 for r in records],
        "itls": [r.itls if r.error is None else [] for r in records],
        "latencies": [
            (r.end - r.start) if r.error is None and r.end is not None else 0.0 for r in records
        ],
        "errors": [r.error or "" for r in records],
        "errors_by_code": dict(Counter(r.error for r in records if r.error is not None)),
        "first_error_by_code": _first_error_by_code(records),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_summary(name, values, percentiles))
    return result
