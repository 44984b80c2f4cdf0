"""bench/routing.py's report: the index's predictions beside vLLM's cached tokens."""

from __future__ import annotations

from bench.routing import markdown


def _row(policy: str, computed: int, predictions=None) -> dict:
    row = {
        "cache": "large",
        "workload": "multi_turn",
        "policy": policy,
        "hit_rate": 0.5,
        "ideal_hit_rate": 0.6,
        "computed_tokens": computed,
        "ttft_p50_ms": 1.0,
        "ttft_p99_ms": 2.0,
        "wall_s": 0.5,
        "requests_per_rank": [3, 3],
    }
    if predictions is not None:
        row["predictions"] = predictions
    return row


def test_each_row_shows_predicted_against_reported_cached_tokens():
    rows = [
        _row("approximate", 700, [96, 90, 6400, 6656]),
        _row("load", 1050, [0, 0, 0, 0]),
        _row("round-robin", 1050),  # rows from before the column: no predictions
    ]
    lines = markdown(rows).splitlines()
    assert "predicted / reported (exact)" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    approximate, load, plain = lines[2:]
    assert "| 1.50x fewer | 6400 / 6656 (90/96) |" in approximate
    assert "| 1.00x fewer | - |" in load and "| - |" in plain
