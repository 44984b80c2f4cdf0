"""``engine-gateway bench --address ADDR``: load-test any running gateway.

    engine-gateway bench --address tcp://gw:5557 --concurrency 64 --num-prompts 1000
    engine-gateway bench --address tcp://gw:5557 --request-rate 20 --arrival constant \\
        --dataset prefix --prefix-groups 8 --prefix-len 512 --goodput ttft:200 tpot:50
    engine-gateway bench --address ipc:///run/gw.sock --dataset jsonl --jsonl-path reqs.jsonl \\
        --save-result --result-dir results/
    engine-gateway bench --address tcp://gw:5557 --flood      # one client alone, then flooded

Load: closed loop (``--concurrency N``: N requests always in flight), or open loop
(``--request-rate R``: Poisson or constant arrivals, optionally capped by
``--max-concurrency``). Datasets: random lengths (``--random-range-ratio``), fixed
lengths (ratio 0), a JSONL file, or shared-prefix groups. Results use the metric names
of ``vllm bench serve --save-result``. Exit status: 0 when every request finished, 1
when any failed (or no gateway answered), 2 for a bad command line or a dataset whose
prompts the gateway's model cannot take (checked against its HelloAck before any load).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import sys
import textwrap
import time
from pathlib import Path

from client import (
    AsyncClient,
    GatewayUnavailable,
    RequestFailed,
    RequestOverloaded,
    SamplingParams,
    SessionLost,
    load_client_keys,
)

from .datasets import (
    BenchRequest,
    DatasetError,
    check_fits,
    jsonl_requests,
    prefix_requests,
    random_requests,
)
from .serve_metrics import parse_goodput, serve_metrics
from .workload import RequestRecord, RunResult, closed_loop, open_loop

__all__ = ["main", "build_parser", "run_bench"]

EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine-gateway bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--address", required=True, help="the gateway (tcp:// or ipc://)")
    p.add_argument(
        "--connect-timeout", type=float, default=30.0, help="seconds to wait for the gateway"
    )
    p.add_argument("--curve-server-key", type=Path, help="server public key file (CURVE)")
    p.add_argument("--curve-client-key", type=Path, help="this client's .key_secret file")
    load = p.add_argument_group("load")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    mode.add_argument(
        "--request-rate", type=float, help="open loop: requests per second (inf: all at once)"
    )
    load.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    load.add_argument("--num-prompts", type=int, default=200, help="measured requests")
    load.add_argument("--warmup", type=int, default=0, help="requests run first, not measured")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("random", "fixed", "jsonl", "prefix"), default="random")
    data.add_argument("--input-len", type=int, default=128, help="prompt (or suffix) tokens")
    data.add_argument("--output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (random and prefix)",
    )
    data.add_argument("--prefix-groups", type=int, default=4)
    data.add_argument("--prefix-len", type=int, default=256)
    data.add_argument("--jsonl-path", type=Path)
    data.add_argument("--seed", type=int, default=0)
    sampling = p.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output lengths asked (default on)",
    )
    out = p.add_argument_group("results")
    out.add_argument(
        "--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft, tpot, e2el"
    )
    out.add_argument("--percentiles", default="50,90,99", help="comma list")
    out.add_argument("--save-result", action="store_true", help="write the result JSON")
    out.add_argument("--result-dir", type=Path, default=Path("."))
    out.add_argument("--result-filename", default=None)
    out.add_argument("--label", default="engine-gateway")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    flood = p.add_argument_group("flood impact")
    flood.add_argument(
        "--flood",
        action="store_true",
        help="run the load alone, then again while another client floods the gateway",
    )
    flood.add_argument("--flood-factor", type=int, default=10, help="x max_in_flight_per_client")
    flood.add_argument("--flood-max-tokens", type=int, default=1)
    flood.add_argument(
        "--flood-invalid",
        action="store_true",
        help="flood with invalid Generates only (refused before the engine)",
    )
    return p


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "prefix_groups", "prefix_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be at least 0")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError("--request-rate must be above 0")
    if args.dataset == "jsonl" and args.jsonl_path is None:
        raise ValueError("--dataset jsonl needs --jsonl-path")
    if (args.curve_server_key is None) != (args.curve_client_key is None):
        raise ValueError("--curve-server-key and --curve-client-key go together")
    args.goodput_slos = parse_goodput(args.goodput)
    args.percentile_list = [float(x) for x in args.percentiles.split(",") if x]
    if not all(0 < q <= 100 for q in args.percentile_list):
        raise ValueError("--percentiles: each in (0, 100]")


def make_requests(args: argparse.Namespace, count: int, vocab: int, salt: int) -> list:
    seed = args.seed * 1_000_003 + salt
    if args.dataset == "jsonl":
        return jsonl_requests(args.jsonl_path, vocab, count=count, seed=seed)
    if args.dataset == "prefix":
        return prefix_requests(
            count,
            args.prefix_groups,
            args.prefix_len,
            args.input_len,
            args.output_len,
            vocab,
            range_ratio=args.random_range_ratio,
            seed=seed,
        )
    ratio = 0.0 if args.dataset == "fixed" else args.random_range_ratio
    return random_requests(
        count, args.input_len, args.output_len, vocab, range_ratio=ratio, seed=seed
    )


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, RequestOverloaded):
        return "OVERLOADED"
    if isinstance(exc, RequestFailed):
        return exc.code.name
    if isinstance(exc, SessionLost):
        return "SESSION_LOST"
    if isinstance(exc, GatewayUnavailable):
        return "GATEWAY_UNAVAILABLE"
    if isinstance(exc, TimeoutError):
        return "TIMEOUT"
    return type(exc).__name__


class _Progress:
    """A tqdm bar when wanted and installed; otherwise nothing."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is a nicety: `pip install tqdm` for it
                return
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _run_load(
    client: AsyncClient, args: argparse.Namespace, requests: list[BenchRequest], desc: str
) -> RunResult:
    sampling = {
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
    }
    progress = _Progress(len(requests), not args.no_progress, desc)

    async def stream(prompt: list[int], max_tokens: int) -> RequestRecord:
        record = RequestRecord(start=time.monotonic(), prompt_len=len(prompt))
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        try:
            async with asyncio.timeout(args.request_timeout):
                async for out in client.generate(prompt, params):
                    record.got(len(out.new_token_ids))
        except Exception as exc:  # counted, not raised: a benchmark reports errors
            record.error = _error_name(exc)
            record.error_message = str(exc)
        record.end = time.monotonic()
        progress.update()
        return record

    pairs = [(r.prompt, r.max_tokens) for r in requests]
    try:
        if args.request_rate is not None:
            run = await open_loop(
                stream,
                pairs,
                args.request_rate,
                seed=args.seed,
                arrival=args.arrival,
                max_concurrency=args.max_concurrency,
            )
        else:
            run = await closed_loop(stream, pairs, args.concurrency or 1)
    finally:
        progress.close()
    run.records.sort(key=lambda r: r.start)
    return run


async def run_bench(args: argparse.Namespace) -> dict:
    """Connect, warm up, run the load (and the flooded run); the result dict."""
    keys = None
    if args.curve_server_key is not None:
        keys = load_client_keys(args.curve_server_key, args.curve_client_key)
    async with AsyncClient(
        args.address, name="bench", connect_timeout_s=args.connect_timeout, curve_keys=keys
    ) as client:
        ack = client.hello_ack
        assert ack is not None
        vocab = ack.model.vocab_size
        warmup = make_requests(args, args.warmup, vocab, 1) if args.warmup else []
        requests = make_requests(args, args.num_prompts, vocab, 0)
        warning = check_fits(
            warmup + requests, ack.model.max_model_len, ack.limits.max_prompt_tokens
        )
        if warning:
            print(f"engine-gateway bench: warning: {warning}", file=sys.stderr)
        if warmup:
            await _run_load(client, args, warmup, "warm-up")
        run = await _run_load(client, args, requests, "bench")
        result = _result(args, ack, run)
        if args.flood:
            result["flood"] = await _flood_run(client, args, requests, result, keys)
    return result


def _result(args: argparse.Namespace, ack, run: RunResult) -> dict:  # noqa: ANN001
    rate = args.request_rate if args.request_rate is not None else math.inf
    metrics = serve_metrics(
        run.records,
        run.wall_s,
        percentiles=args.percentile_list,
        goodput=args.goodput_slos or None,
    )
    return {
        "date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "engine-gateway",
        "label": args.label,
        "model_id": ack.model.name,
        "tokenizer_id": None,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if rate == math.inf else rate,
        "burstiness": 1.0 if args.arrival == "poisson" else None,
        "max_concurrency": args.concurrency or args.max_concurrency,
        "endpoint_type": "engine-gateway",
        "address": args.address,
        "gateway_version": ack.gateway_version,
        "load": "closed" if args.request_rate is None else args.arrival,
        "dataset": args.dataset,
        "warmup": args.warmup,
        "goodput_slos_ms": args.goodput_slos or None,
        **metrics,
    }


async def _flood_run(
    client: AsyncClient,
    args: argparse.Namespace,
    requests: list[BenchRequest],
    alone: dict,
    keys: tuple[bytes, bytes, bytes] | None,
) -> dict:
    """The same load again while a Flooder (with the same CURVE ``keys``) hammers the
    gateway; per-token latency ratios."""
    from .flood import Flooder

    stop = asyncio.Event()
    flooder = Flooder(
        args.address,
        factor=args.flood_factor,
        max_tokens=args.flood_max_tokens,
        invalid=args.flood_invalid,
        seed=args.seed,
        curve_keys=keys,
    )
    flooding = asyncio.ensure_future(flooder.run(stop))
    try:
        while flooder.stats.bursts < 1 and not flooding.done():
            await asyncio.sleep(0.01)  # the flood is on before the probe starts
        run = await _run_load(client, args, requests, "flooded")
    finally:
        stop.set()
    stats = await flooding
    flooded = serve_metrics(run.records, run.wall_s, percentiles=(50, 99))
    table = {}
    for metric in ("itl", "tpot", "ttft"):
        for p in ("p50", "p99"):
            key = f"{p}_{metric}_ms"
            before, after = alone.get(key), flooded[key]
            table[key] = {
                "alone": before,
                "flooded": after,
                "ratio": (after / before) if before else None,
            }
    return {
        "flooder": stats.as_dict(),
        "flood_factor": args.flood_factor,
        "flood_max_tokens": args.flood_max_tokens,
        "flood_invalid": args.flood_invalid,
        "probe_failed": flooded["failed"],
        "probe_errors_by_code": flooded["errors_by_code"],
        "latency_ms": table,
    }


def print_summary(result: dict, percentiles: list[float]) -> None:
    """The run in vLLM's `bench serve` layout (stdout)."""
    line = "{:<40} {:<10}".format
    print("{s:{c}^{n}}".format(s=" engine-gateway bench result ", n=52, c="="))
    print(line("Successful requests:", result["completed"]))
    print(line("Failed requests:", result["failed"]))
    first = result["first_error_by_code"]
    for code, n in sorted(result["errors_by_code"].items()):
        print(line(f"  {code}:", n))
        if first.get(code):
            print(f"    first: {textwrap.shorten(first[code], 200)}")
    print(line("Benchmark duration (s):", f"{result['duration']:.2f}"))
    print(line("Total input tokens:", result["total_input_tokens"]))
    print(line("Total generated tokens:", result["total_output_tokens"]))
    print(line("Request throughput (req/s):", f"{result['request_throughput']:.2f}"))
    if result["request_goodput"] is not None:
        print(line("Request goodput (req/s):", f"{result['request_goodput']:.2f}"))
    print(line("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        print(f"{f' {title} (ms) ':-^52}")
        print(line("Mean:", f"{result[f'mean_{name}_ms']:.2f}"))
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            print(line(f"P{word}:", f"{result[f'p{word}_{name}_ms']:.2f}"))
    flood = result.get("flood")
    if flood:
        print(f"{' flood impact (one client, alone vs flooded) ':-^52}")
        for key, row in flood["latency_ms"].items():
            ratio = "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            print(f"{key:<16} {row['alone']:>9.2f} -> {row['flooded']:>9.2f}  {ratio}")
        f = flood["flooder"]
        print(
            f"flooder: {f['generates_sent']} Generates ({f['generates_per_s']:.0f}/s),"
            f" {f['overloaded']} Overloaded, {f['accepted_finished']} finished,"
            f" {f['malformed_sent']} malformed frames, errors {f['errors']}"
        )
    print("=" * 52)


def _result_path(args: argparse.Namespace, result: dict) -> Path:
    if args.result_filename:
        return args.result_dir / args.result_filename
    load = f"c{args.concurrency or 1}" if args.request_rate is None else f"{args.request_rate}qps"
    model = Path(str(result["model_id"])).name
    return args.result_dir / f"engine-gateway-{load}-{model}-{result['date']}.json"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        print(f"engine-gateway bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = asyncio.run(run_bench(args))
    except GatewayUnavailable as exc:
        print(f"engine-gateway bench: no gateway at {args.address}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (DatasetError, OSError) as exc:
        print(f"engine-gateway bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print_summary(result, args.percentile_list)
    if args.save_result:
        path = _result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"saved {path}")
    failed = result["failed"] + (result.get("flood", {}).get("probe_failed") or 0)
    if failed:
        print(f"engine-gateway bench: {failed} requests failed", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
