"""`engine-gateway bench`: datasets and metrics exactly (unit), then the installed command
against a gateway on the real engine (results file, errors by code, exit status, flood)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from bench.datasets import (
    BenchRequest,
    DatasetError,
    check_fits,
    jsonl_requests,
    length_range,
    prefix_requests,
    random_requests,
)
from bench.serve_metrics import parse_goodput, serve_metrics
from bench.workload import RequestRecord
from gateway.sessions import GatewayLimits
from tests.conftest import TEST_MAX_MODEL_LEN, running_gateway

ROOT = Path(__file__).resolve().parents[2]
COMMAND = shutil.which("engine-gateway", path=str(Path(sys.executable).parent))


# ------------------------------------------------------------ datasets


def test_random_and_fixed_lengths_stay_in_range_and_are_seeded():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.5) == (50, 150)
    reqs = random_requests(200, 100, 20, vocab_size=7, range_ratio=0.5, seed=3)
    assert all(50 <= len(r.prompt) <= 150 and 10 <= r.max_tokens <= 30 for r in reqs)
    assert len({len(r.prompt) for r in reqs}) > 10  # really random lengths
    assert all(0 <= t < 7 for r in reqs for t in r.prompt)
    assert reqs == random_requests(200, 100, 20, vocab_size=7, range_ratio=0.5, seed=3)
    fixed = random_requests(20, 33, 9, vocab_size=50)
    assert {len(r.prompt) for r in fixed} == {33} and {r.max_tokens for r in fixed} == {9}
    with pytest.raises(DatasetError):
        length_range(10, 1.0)


def test_prefix_groups_share_exact_prefixes_and_differ_after_them():
    reqs = prefix_requests(12, 3, 40, 10, 5, vocab_size=1000, seed=1)
    prefixes = [tuple(r.prompt[:40]) for r in reqs]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[0] != prefixes[1]
    assert all(len(r.prompt) == 50 for r in reqs)
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 12


def test_jsonl_takes_ids_or_lengths_cycles_and_names_bad_lines(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text(
        '{"prompt_token_ids": [5, 6, 7], "max_tokens": 4}\n\n{"input_len": 9, "output_len": 2}\n'
    )
    reqs = jsonl_requests(path, vocab_size=100, count=5)
    assert [r.prompt for r in reqs[::2]][:2] == [[5, 6, 7], reqs[2].prompt]
    assert reqs[0].prompt == [5, 6, 7] and reqs[0].max_tokens == 4
    assert len(reqs[1].prompt) == 9 and reqs[1].max_tokens == 2
    assert len(reqs) == 5 and reqs[4] == reqs[0]
    path.write_text('{"prompt_token_ids": [1], "max_tokens": 1}\n{"prompt_token_ids": [-1]}\n')
    with pytest.raises(DatasetError, match=r"reqs.jsonl:2: prompt_token_ids"):
        jsonl_requests(path, vocab_size=100)
    path.write_text('{"input_len": 0, "output_len": 1}\n')
    with pytest.raises(DatasetError, match=r":1: input_len"):
        jsonl_requests(path, vocab_size=100)


# ------------------------------------------------------------ metrics


def record(start, first, token_times, end, prompt_len=10, tokens=None, error=None):
    r = RequestRecord(start=start, prompt_len=prompt_len, first_token=first, end=end)
    r.token_times = list(token_times)
    r.output_tokens = len(token_times) if tokens is None else tokens
    r.error = error
    return r


def test_check_fits_refuses_prompts_the_gateway_refuses_and_warns_of_capped_outputs():
    def reqs(*shapes: tuple[int, int]) -> list[BenchRequest]:
        return [BenchRequest([5] * plen, out) for plen, out in shapes]

    assert check_fits(reqs((63, 1), (10, 54)), max_model_len=64, max_prompt_tokens=64) is None
    assert check_fits([], max_model_len=64, max_prompt_tokens=64) is None
    # A prompt must leave one token of context: 64 of 64 is refused, as vLLM refuses it.
    with pytest.raises(DatasetError, match=r"1 of 2 prompts .* \(longest 64 tokens; .* at most 63"):
        check_fits(reqs((64, 1), (3, 1)), max_model_len=64, max_prompt_tokens=64)
    # max_prompt_tokens below the context is the tighter limit.
    with pytest.raises(DatasetError, match=r"2 of 2 prompts .* at most 20.*max_prompt_tokens 20"):
        check_fits(reqs((21, 1), (30, 1)), max_model_len=64, max_prompt_tokens=20)
    warning = check_fits(reqs((60, 5), (10, 5), (63, 2)), max_model_len=64, max_prompt_tokens=64)
    assert warning is not None
    assert warning.startswith("2 of 3 requests ask for more tokens") and "up to 65" in warning


def test_serve_metrics_match_vllm_definitions_and_names():
    records = [
        # ttft 0.1, then 4 more tokens over 0.4 s: tpot = 0.4/4 = 0.1, itls 0.1 each
        record(0.0, 0.1, [0.1, 0.2, 0.3, 0.4, 0.5], 0.5),
        # ttft 0.3, one frame carrying 3 tokens at the end: tpot (0.6-0.3)/2 = 0.15
        record(1.0, 1.3, [1.3, 1.6], 1.6, tokens=3),
        record(2.0, None, [], 2.2, error="OVERLOADED"),
    ]
    m = serve_metrics(records, 2.0, percentiles=(50, 99), goodput={"ttft": 200, "tpot": 120})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["errors_by_code"] == {"OVERLOADED": 1}
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 8
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets both SLOs
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    assert m["mean_tpot_ms"] == pytest.approx(125.0)
    assert m["p50_itl_ms"] == pytest.approx(100.0)  # gaps: 0.1 x4 and 0.3
    assert m["mean_e2el_ms"] == pytest.approx(550.0)
    assert m["output_lens"] == [5, 3, 0] and m["input_lens"] == [10, 10, 10]
    assert m["errors"] == ["", "", "OVERLOADED"] and m["ttfts"][2] == 0.0
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{name}_ms" in m


def test_goodput_parsing_refuses_unknown_metrics_and_bad_numbers():
    assert parse_goodput(["ttft:200", "e2el:1000.5"]) == {"ttft": 200.0, "e2el": 1000.5}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


# ------------------------------------------------------------ the command, real engine


async def run_command(*argv: str, timeout: float = 240) -> tuple[int, str, str]:
    """Run `engine-gateway bench` without blocking the loop that serves the gateway."""
    proc = await asyncio.create_subprocess_exec(
        COMMAND, "bench", *argv, cwd=ROOT, stdout=-1, stderr=-1
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.engine
async def test_bench_command_writes_vllm_named_results_for_a_running_gateway(
    real_gateway, tmp_path
):
    address = real_gateway.addresses[0]
    code, out, err = await run_command(
        "--address", address, "--concurrency", "4", "--num-prompts", "12", "--warmup", "2",
        "--dataset", "prefix", "--prefix-groups", "2", "--prefix-len", "16",
        "--input-len", "8", "--output-len", "6", "--goodput", "ttft:60000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "Successful requests:" in out and "P99:" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["output_lens"] == [6] * 12 and result["total_output_tokens"] == 72
    assert result["input_lens"] == [24] * 12
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["model_id"] == real_gateway.engine.info.model_name
    for key in ("duration", "mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms"):
        assert result[key] > 0, key
    assert all(len(gaps) == 5 for gaps in result["itls"])  # streamed token by token


@pytest.mark.engine
async def test_bench_command_counts_failures_by_code_and_exits_1(real_gateway, tmp_path):
    address = real_gateway.addresses[0]
    code, out, err = await run_command(
        "--address", address, "--request-rate", "50", "--arrival", "constant",
        "--num-prompts", "6", "--input-len", "4", "--output-len", "2", "--temperature", "-1",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--no-progress",
    )  # fmt: skip
    assert code == 1 and "6 requests failed" in err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["errors_by_code"] == {"INVALID_REQUEST": 6} and result["completed"] == 0
    # What the gateway said (vLLM's own message) is kept and shown, once per code.
    said = result["first_error_by_code"]["INVALID_REQUEST"]
    assert "temperature must be non-negative" in said and said in out
    code, _, err = await run_command(
        "--address", "ipc:///tmp/eg-nobody-here.sock", "--connect-timeout", "0.5"
    )
    assert code == 1 and "no gateway at" in err
    code, _, err = await run_command("--address", address, "--goodput", "itl:5")
    assert code == 2 and "goodput" in err


@pytest.mark.engine
async def test_flood_mode_reports_alone_and_flooded_latency_and_loses_nothing(
    real_gateway, tmp_path
):
    """Invalid Generates and malformed frames are all refused; the probe's requests finish."""
    code, out, err = await run_command(
        "--address", real_gateway.addresses[0], "--concurrency", "2", "--num-prompts", "6",
        "--input-len", "8", "--output-len", "8", "--flood", "--flood-invalid", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "f.json", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    flood = json.loads((tmp_path / "f.json").read_text())["flood"]
    assert flood["probe_failed"] == 0 and flood["flood_invalid"]
    flooder = flood["flooder"]
    sent = flooder["generates_sent"]
    assert flooder["bursts"] >= 1 and sent == flooder["bursts"] * 10 * 1024
    assert flooder["errors"]["INVALID_REQUEST"] == sent  # every one refused, none ran
    assert flooder["accepted_finished"] == 0
    for code_name in ("MALFORMED", "UNSUPPORTED_VERSION", "BAD_FRAME_COUNT", "UNKNOWN_MESSAGE"):
        assert flooder["errors"][code_name] == flooder["malformed_sent"] // 4
    row = flood["latency_ms"]["p50_itl_ms"]
    assert row["alone"] > 0 and row["flooded"] > 0 and row["ratio"] > 0
    assert "flood impact" in out
    assert real_gateway.table.live_requests == 0


async def test_flooder_counts_overloaded_and_accepted_requests():
    """Unit test of the flooder's bookkeeping (fake engine, small admission limit)."""
    from bench.flood import Flooder
    from gateway.fake_engine import FakeEngine

    async with running_gateway(FakeEngine(), GatewayLimits(max_in_flight_per_client=8)) as gw:
        flooder = Flooder(gw.addresses[0], factor=10, max_tokens=2, malformed_per_burst=8)
        stop = asyncio.Event()
        task = asyncio.ensure_future(flooder.run(stop))
        while flooder.stats.bursts < 3:
            await asyncio.sleep(0.01)
        stop.set()
        stats = await asyncio.wait_for(task, 30)
    answered = stats.overloaded + stats.accepted_finished
    assert stats.generates_sent == stats.bursts * 80 and answered == stats.generates_sent
    assert stats.accepted_finished >= stats.bursts * 8 and stats.overloaded > 0
    assert sum(stats.errors.values()) == stats.malformed_sent == stats.bursts * 8


async def test_flooder_reads_every_refusal_however_small_the_send_queue():
    """A burst of invalid Generates outnumbers the gateway's per-client send queue (8 frames)
    eighty to one; the flooder keeps half of that queue's worth unanswered at most, so it is
    never a slow consumer and sees every refusal (without the window it fails most runs)."""
    from bench.flood import Flooder
    from codec import ErrorCode
    from gateway.fake_engine import FakeEngine

    limits = GatewayLimits(max_in_flight_per_client=64, client_send_hwm=8)
    async with running_gateway(FakeEngine(), limits) as gw:
        flooder = Flooder(gw.addresses[0], factor=10, malformed_per_burst=8, invalid=True)
        stop = asyncio.Event()
        task = asyncio.ensure_future(flooder.run(stop))
        while flooder.stats.bursts < 3 and not task.done():
            await asyncio.sleep(0.01)
        stop.set()
        stats = await asyncio.wait_for(task, 30)
        assert gw.frames_dropped == 0 and gw.errors_by_code[ErrorCode.SLOW_CONSUMER] == 0
    assert stats.bursts >= 3 and stats.generates_sent == stats.bursts * 640
    assert stats.errors["INVALID_REQUEST"] == stats.generates_sent
    assert sum(stats.errors.values()) == stats.generates_sent + stats.malformed_sent


@pytest.mark.engine
async def test_bench_command_checks_the_dataset_against_the_gateways_model(real_gateway):
    """Prompts the gateway would refuse stop the run before any request is sent (exit 2,
    naming the limit); outputs that overrun the context only warn."""
    address = real_gateway.addresses[0]
    accepted = real_gateway.table.stats.requests_accepted
    code, out, err = await run_command(
        "--address", address, "--num-prompts", "3", "--warmup", "1",
        "--input-len", str(TEST_MAX_MODEL_LEN), "--output-len", "2", "--no-progress",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert f"4 of 4 prompts are longer than this gateway takes (longest {TEST_MAX_MODEL_LEN}" in err
    assert f"at most {TEST_MAX_MODEL_LEN - 1}" in err
    assert real_gateway.table.stats.requests_accepted == accepted  # nothing was sent
    code, out, err = await run_command(
        "--address", address, "--num-prompts", "2", "--input-len", str(TEST_MAX_MODEL_LEN - 4),
        "--output-len", "10", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "warning: 2 of 2 requests ask for more tokens than the model's context holds" in err
    assert "Total generated tokens:                  8 " in out  # 4 each: the context's end
