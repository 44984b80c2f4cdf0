"""Smoke test of the bench CLI: correctness of the pipeline, no timing assertions."""

from __future__ import annotations

import asyncio
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
    short = EngineSetup(cuda_graphs=True, max_model_len=300).with_dp(2)
    assert short.flags[short.flags.index("--max-model-len") + 1] == "300"
    assert short.cuda_graphs and short.data_parallel_size == 2


def test_prompts_are_drawn_from_the_models_vocabulary(tmp_path):
    from bench.random_model import SHAPES
    from bench.workload import Workload, model_shape
    from gateway.tiny_model import ensure_tiny_model
    from tests.helpers import tiny_model_variant

    assert model_shape(str(ensure_tiny_model())) == (512, 2048)
    small = tiny_model_variant(tmp_path / "small", config={"max_position_embeddings": 300})
    assert model_shape(str(small)) == (512, 300)
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "config.json").write_text(json.dumps(SHAPES["llama-3.2-1b"]))
    vocab, context = model_shape(str(tmp_path / "llama3"))
    assert (vocab, context) == (128256, 131072)
    requests = Workload((64, 64), (1, 1), vocab_size=vocab).requests(50)
    ids = [i for prompt, _ in requests for i in prompt]
    assert max(ids) < vocab and max(ids) > 65535


class _SlowStart:
    """A target whose start takes a moment and records when it ran."""

    def __init__(self, name: str, log: list[tuple[str, str]]):
        self.name = name
        self.log = log

    async def start(self) -> None:
        self.log.append(("begin", self.name))
        await asyncio.sleep(0.01)
        self.log.append(("end", self.name))


def test_gpu_targets_start_one_after_another_and_cpu_targets_together():
    from bench.cli import start_targets

    for one_at_a_time, expected in (
        (True, [("begin", "a"), ("end", "a"), ("begin", "b"), ("end", "b")]),
        (False, [("begin", "a"), ("begin", "b"), ("end", "a"), ("end", "b")]),
    ):
        log: list[tuple[str, str]] = []
        targets = [_SlowStart("a", log), _SlowStart("b", log)]
        asyncio.run(start_targets(targets, one_at_a_time=one_at_a_time))
        assert log == expected


def test_the_bench_freezes_what_it_holds_before_each_measurement():
    """The clients of in-process targets share the bench's heap: each measurement starts
    with everything held before it (here: the previous measurement's garbage-collected
    objects) frozen, out of the collector's full walks."""
    import argparse
    import gc

    from bench.cli import _interleaved
    from bench.workload import RequestRecord, RunResult, Workload

    class HoldingTarget:
        name = "holding"

        def __init__(self) -> None:
            self.held: list[list[float]] = []
            self.frozen_at_start: list[tuple[int, int]] = []

        async def measure(self, workload, mode, level, count, salt):
            self.frozen_at_start.append((gc.get_freeze_count(), len(self.held)))
            self.held += [[float(i)] for i in range(1000)]  # kept, like records
            record = RequestRecord(start=0.0)
            record.got(1)
            record.end = record.token_times[0]
            return RunResult([record], 1.0), 0.0

    target = HoldingTarget()
    args = argparse.Namespace(rounds=2, seed=0, requests=1)
    gc.unfreeze()
    try:
        asyncio.run(_interleaved([target], Workload((4, 4), (1, 1)), args, [1, 2], []))
    finally:
        gc.unfreeze()
    assert len(target.frozen_at_start) == 4
    for frozen, held in target.frozen_at_start:
        assert frozen >= held


def test_scaled_targets_name_their_engines_and_frontends_and_report_against_the_sum():
    from bench.report import _scale_lines
    from bench.targets import scaled_target, target_routing_flags

    assert scaled_target("gateway-dp8-x2") == ("gateway", 8, 2)
    assert scaled_target("vllm-http-dp4-x4") == ("vllm-http", 4, 4)
    assert scaled_target("gateway-x2") == ("gateway", 1, 2)
    assert scaled_target("vllm-http-dp2") == ("vllm-http", 2, 1)
    assert scaled_target("gateway-dp2-load") == ("gateway", 2, 1)
    assert target_routing_flags("gateway-dp2-x2-load") == ("--routing", "load")
    assert target_routing_flags("gateway-dp2") == ()  # the gateway's default
    assert target_routing_flags("gateway-dp2-approximate") == (
        "--routing", "cache", "--routing-index", "approximate",
    )  # fmt: skip
    assert target_routing_flags("gateway-dp2-events") == (
        "--routing", "cache", "--routing-index", "events",
    )  # fmt: skip
    for plain in ("gateway-ipc", "vllm-http", "direct", "gateway-dp1", "gateway-dp8-y2"):
        assert scaled_target(plain) is None
    for wrong in ("vllm-http-dp2-load", "gateway-dp2-hash", "gateway-load"):
        assert scaled_target(wrong) is None
    rows = [
        {"target": "direct", "concurrency": 1024, "output_tok_s": 40_000.0},
        {"target": "gateway-dp8", "concurrency": 1024, "output_tok_s": 304_000.0},
        {"target": "vllm-http-dp8-x2", "concurrency": 1024, "output_tok_s": 80_000.0},
    ]
    lines = _scale_lines(rows, {1024: rows[0]}, "direct")
    (gateway,) = [line for line in lines if line.startswith("| gateway-dp8 ")]
    assert "| 8 | 304000 | 0.95x |" in gateway
    (http,) = [line for line in lines if line.startswith("| vllm-http-dp8-x2 ")]
    assert "| 8 | 80000 | 0.25x |" in http
