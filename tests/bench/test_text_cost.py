"""bench.text_cost's report: per-token CPU, the ratio to vLLM's HTTP frontend, throughput with
text on and off, and how many texts equal vLLM's, from the rounds it measured."""

import argparse

from bench.text_cost import report


def _round(tokens: int, wall_s: float, cpu_s: float, texts: dict[int, str]) -> dict:
    return {"tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s, "texts": texts}


def test_the_report_reads_the_rounds() -> None:
    texts = {0: "a", 1: "b"}
    results = {
        "gateway": {
            "off@64": [_round(1000, 1.0, 0.010, {}), _round(1000, 1.0, 0.030, {})],
            "on@64": [_round(1000, 1.0, 0.040, texts)],
            "off@256": [_round(2000, 1.0, 0.1, {})],
            "on@256": [_round(1800, 1.0, 0.1, texts)],
        },
        "http": [_round(1000, 2.0, 0.160, {0: "a", 1: "c"})],
    }
    args = argparse.Namespace(concurrency=64, requests=2, max_tokens=8, rounds=1)
    text, summary = report(results, args)
    assert summary["client_us_per_token_text_off"] == 20.0  # median of 10 and 30
    assert summary["client_us_per_token_text_on"] == 40.0
    assert summary["http_frontend_us_per_token"] == 160.0
    assert summary["same_text"] == "1/2"
    assert "| client with text on ÷ vLLM HTTP frontend | 0.25 |" in text
    assert "| gateway tok/s at c=256, text on | 1800 (0.90x) |" in text
    assert "| of which text (detokenization + stop strings) | 20.0 µs |" in text
