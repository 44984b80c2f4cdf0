"""Smoke test of the bench CLI: correctness of the pipeline, no timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cli_runs_and_writes_json_markdown_and_plots(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--targets",
            "gateway-fake",
            "--concurrency",
            "1,4",
            "--requests",
            "8",
            "--rounds",
            "2",
            "--output-len",
            "5,7",
            "--rates",
            "50",
            "--no-ceiling",
            "--name",
            "smoke",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "smoke.json").read_text())
    rows = {(r["mode"], r.get("concurrency", r.get("rate"))): r for r in data["rows"]}
    assert set(rows) == {("closed", 1), ("closed", 4), ("poisson", 50.0)}
    for row in rows.values():
        assert row["errors"] == 0 and row["requests"] == 16 and row["rounds"] == 2
        assert 16 * 5 <= row["output_tokens"] <= 16 * 7  # every token of every request counted
        assert row["ttft_ms"]["p50"] > 0 and len(row["ttft_samples_ms"]) == 16
    assert "| gateway-fake | 4 |" in (tmp_path / "smoke.md").read_text()
    assert (tmp_path / "smoke_plots.png").stat().st_size > 10_000


def test_cuda_graphs_drop_enforce_eager_for_every_engine():
    from bench.targets import EngineSetup

    assert "--enforce-eager" in EngineSetup().flags
    gpu = EngineSetup(cuda_graphs=True)
    assert "--enforce-eager" not in gpu.flags
    assert "--enforce-eager" not in gpu.with_dp(2).flags
    assert gpu.with_dp(2).flags[-2:] == ["--data-parallel-size", "2"]
    assert "--max-model-len" in gpu.flags
