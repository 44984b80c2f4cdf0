"""Prefix-cache-aware routing over data-parallel ranks, against vLLM's balancer.

    python -m bench.routing --out bench/results/routing          # ~10 minutes on 2 cores
    python -m bench.routing --workloads multi_turn --policies cache,load --sizes large

Two CPU engines (``--data-parallel-size 2``, one core each), 32-token blocks, prompts of
hundreds of tokens and ``max_tokens`` <= 8, so prefill dominates. The gateway runs in this
process with ``--routing cache`` (vLLM's KV events on); each run swaps its router's policy
and starts from empty caches (ResetPrefixCache). Targets:

- ``cache``: the gateway's prefix-cache routing on the engines' KV events
  (``--routing-index events``, a gateway group's default; prefix weight 16, guard 1.5,8);
- ``approximate``: ``cache`` matching on the prompts the gateway placed and what they
  generated (``--routing-index approximate``, one gateway's default) instead of KV events;
- ``load``: vLLM's own DP balancer;
- ``round-robin``;
- ``hash``: the client pins each request by a hash of its routing key, or of its first block;
- ``cache:W:RATIO:SLACK``: ``cache`` with another prefix weight and balance guard (a sweep);
- ``ceiling``: one engine (DP=1) with the two ranks' KV blocks together: every request
  can reuse everything earlier requests left;
- ``pool`` and ``pool-load``: two single-engine gateways (one core each, each with one
  rank's blocks), the client a ``GatewayPool`` with ``policy="cache"`` (PrefixQuery on
  each gateway's default index: the prompts it served and what they generated) or
  ``"load"``; the "rank" is the gateway;
- ``ideal`` (analytic, per run): the whole-block prefix each request shares with the prompts
  and outputs of the requests sent before it, at most ``len - 1`` tokens (vLLM's rule).

Figures: prompt tokens computed (sum of prompt - cached, ``cached_tokens`` as vLLM reports
it) and the hit rate (cached / prompt): machine-independent; for ``cache`` and
``approximate``, the cached tokens the gateway's index predicted against those vLLM reported
(and the requests predicted exactly); TTFT p50/p99 and wall time;
the largest and smallest share of requests per rank. Each workload runs with a cache that
holds its working set (``large``: 4096 blocks a rank) and with one below twice it
(``small``: 160 blocks a rank, 5,120 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32
SIZES = {"large": 4096, "small": 160}  # KV blocks per rank
POLICIES = ("cache", "approximate", "load", "round-robin", "hash", "ceiling")
POOL_POLICIES = {"pool": "cache", "pool-load": "load"}  # (not run unless named)
WORKLOADS = ("shared_prefix", "multi_turn", "grpo", "zipf", "unique")
CONCURRENCY = 8
VOCAB = (4, 500)


@dataclass
class Sent:
    prompt_len: int
    cached: int
    ideal: int
    ttft: float
    rank: int | None
    output_ids: list[int]


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)
    wall_s: float = 0.0


Send = Callable[..., Awaitable[Sent]]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


# ------------------------------------------------------------------ workloads


async def _bounded(jobs: list[Callable[[], Awaitable[Any]]]) -> list[Any]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(job: Callable[[], Awaitable[Any]]) -> Any:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


async def shared_prefix(send: Send, rng: random.Random) -> None:
    """8 groups of 8: a 512-token prefix each, 64-token suffixes, in shuffled order."""
    prefixes = [tokens(rng, 512) for _ in range(8)]
    requests = [(g, prefixes[g] + tokens(rng, 64)) for g in range(8) for _ in range(8)]
    rng.shuffle(requests)
    await _bounded([lambda g=g, p=p: send(p, key=f"group-{g}") for g, p in requests])


async def multi_turn(send: Send, rng: random.Random) -> None:
    """16 sessions x 6 turns, each session at its own pace (0-20 ms between a reply and
    its next turn), at most 8 requests at once: a shared 128-token system prompt, then each
    turn extends the last (its prompt, its output, 48 new tokens)."""
    system = tokens(rng, 128)
    seeds = [rng.randrange(1 << 30) for _ in range(16)]
    gate = asyncio.Semaphore(CONCURRENCY)

    async def session(index: int) -> None:
        own = random.Random(seeds[index])  # its content and pace, whatever the others do
        history = system + tokens(own, 96)
        for _ in range(6):
            async with gate:
                done = await send(history, key=f"session-{index}")
            history = history + done.output_ids + tokens(own, 48)
            await asyncio.sleep(own.uniform(0.0, 0.02))

    await asyncio.gather(*(session(i) for i in range(16)))


async def grpo(send: Send, rng: random.Random) -> None:
    """3 steps of 8 prompts x n=8 samples: a shared 128-token system prompt and a 192-token
    question each (samples of one request share its prompt on one rank)."""
    system = tokens(rng, 128)
    for step in range(3):
        questions = [system + tokens(rng, 192) for _ in range(8)]
        keyed = [(q, f"step{step}-q{i}") for i, q in enumerate(questions)]
        await _bounded([lambda q=q, k=k: send(q, n=8, key=k) for q, k in keyed])


async def zipf(send: Send, rng: random.Random) -> None:
    """160 requests over 32 prefixes of 256 tokens, Zipf(1.2)-popular, 32-token suffixes."""
    prefixes = [tokens(rng, 256) for _ in range(32)]
    weights = [1 / (k + 1) ** 1.2 for k in range(32)]
    picks = [(k, prefixes[k] + tokens(rng, 32)) for k in rng.choices(range(32), weights, k=160)]
    await _bounded([lambda k=k, p=p: send(p, key=f"prefix-{k}") for k, p in picks])


async def unique(send: Send, rng: random.Random) -> None:
    """128 prompts of 320 tokens that share nothing: the control."""
    prompts = [tokens(rng, 320) for _ in range(128)]
    await _bounded([lambda p=p: send(p) for p in prompts])


async def unique_long(send: Send, rng: random.Random) -> None:
    """1,024 prompts of 320 tokens that share nothing, 8 at a time: the throughput control
    (run policies alternately, several times: ``--policies cache,load,cache,load``)."""
    prompts = [tokens(rng, 320) for _ in range(1024)]
    await _bounded([lambda p=p: send(p) for p in prompts])


WORKLOAD_FNS = {f.__name__: f for f in (shared_prefix, multi_turn, grpo, zipf, unique, unique_long)}


# ------------------------------------------------------------------ the ideal


class Ideal:
    """Whole-block prefixes of everything sent (and produced) so far."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, ...]] = set()

    def cached(self, prompt: list[int]) -> int:
        reusable = (len(prompt) - 1) // BLOCK
        best = 0
        for k in range(1, reusable + 1):
            if tuple(prompt[: k * BLOCK]) not in self.seen:
                break
            best = k
        return best * BLOCK

    def add(self, sequence: list[int]) -> None:
        for k in range(1, len(sequence) // BLOCK + 1):
            self.seen.add(tuple(sequence[: k * BLOCK]))


# ------------------------------------------------------------------ running


async def run_workload(
    client: Any, ranks: int, ranks_of: dict[str, int], name: str, policy: str, seed: int
) -> Run:
    """``ranks_of``: request id -> rank, filled as requests are submitted (a pool's
    requests are placed by the gateway they went to instead)."""
    from client import RequestOptions, SamplingParams

    rng = random.Random(seed)
    counter = itertools.count()
    ideal = Ideal()
    run = Run()
    gateways = [c.address for c in getattr(client, "clients", ())]

    async def send(prompt: list[int], n: int = 1, key: str | None = None) -> Sent:
        options = RequestOptions(routing_key=key)
        if policy == "hash" and ranks > 1:
            basis = key.encode() if key else bytes(str(prompt[:BLOCK]), "ascii")
            options = RequestOptions(data_parallel_rank=zlib.crc32(basis) % ranks)
        expected = ideal.cached(prompt)
        ideal.add(prompt)
        sampling = SamplingParams(
            temperature=0.0 if n == 1 else 1.0, seed=seed, max_tokens=8, ignore_eos=True, n=n
        )
        start = time.monotonic()
        first = None
        outputs: dict[int, list[int]] = {}
        cached = 0
        request_id = f"{name}-{policy}-{next(counter)}"
        stream = client.generate(prompt, sampling, request_id=request_id, options=options)
        async for out in stream:
            if first is None and out.new_token_ids:
                first = time.monotonic()
            outputs.setdefault(out.index, []).extend(out.new_token_ids)
            if out.finished is not None and out.index == 0:
                cached = out.finished.cached_tokens
        rank = ranks_of.pop(request_id, None)
        if gateways:
            rank = gateways.index(stream.gateway)
        sent = Sent(len(prompt), cached, expected, (first or start) - start, rank, outputs[0])
        for produced in outputs.values():
            ideal.add(prompt + produced)
        run.sent.append(sent)
        return sent

    start = time.monotonic()
    await WORKLOAD_FNS[name](send, rng)
    run.wall_s = time.monotonic() - start
    return run


def install_rank_recorder(engine: Any) -> dict[str, int]:
    """Client request id -> the rank vLLM's client sent it to (read as it is submitted).
    Wraps the engine's prepare and add_requests: call before the Gateway is made."""
    ranks_of: dict[str, int] = {}
    client_ids: dict[str, str] = {}  # engine request id -> client request id
    client = engine._client
    prepare, add_requests = engine.prepare, engine.add_requests
    engines = getattr(client, "core_engines", None)

    def recording_prepare(engine_request_id, request):  # noqa: ANN001, ANN202
        prepared = prepare(engine_request_id, request)
        for core in prepared:
            client_ids[core.request_id] = request.request_id
        return prepared

    async def recording_add(prepared):  # noqa: ANN001, ANN202
        await add_requests(prepared)
        for core in prepared:
            request_id = client_ids.pop(core.request_id, None)
            identity = getattr(client, "reqs_in_flight", {}).get(core.request_id)
            if request_id is None:
                continue
            if engines is not None and identity is not None:
                ranks_of.setdefault(request_id, engines.index(identity))
            else:
                ranks_of.setdefault(request_id, 0)

    engine.prepare = recording_prepare
    engine.add_requests = recording_add
    return ranks_of


def summarize(name: str, size: str, policy: str, run: Run, ranks: int) -> dict:
    prompt = sum(s.prompt_len for s in run.sent)
    cached = sum(s.cached for s in run.sent)
    ideal = sum(s.ideal for s in run.sent)
    ttfts = sorted(s.ttft for s in run.sent)
    shares: dict[int, int] = {}
    for s in run.sent:
        if s.rank is not None:
            shares[s.rank] = shares.get(s.rank, 0) + 1
    counts = [shares.get(r, 0) for r in range(ranks)]
    return {
        "workload": name,
        "cache": size,
        "policy": policy,
        "requests": len(run.sent),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ideal_hit_rate": ideal / prompt if prompt else 0.0,
        "ideal_computed_tokens": prompt - ideal,
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p99_ms": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1e3,
        "wall_s": run.wall_s,
        "requests_per_rank": counts,
        "max_min_share": (max(counts) / min(counts)) if min(counts) else None,
    }


async def _engine(ranks: int, blocks_per_rank: int, kv_events: bool = True) -> Any:
    from gateway.routing import RoutingConfig
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm import VllmEngine, default_engine_args, enable_kv_events

    args = default_engine_args(
        str(ensure_tiny_model()),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=1024,
        block_size=BLOCK,
        data_parallel_size=ranks,
        num_gpu_blocks_override=blocks_per_rank,
        seed=0,
    )
    if not kv_events:  # a single-engine gateway as `serve` starts one by default
        return await VllmEngine.start(args, routing=RoutingConfig("load", index="approximate"))
    enable_kv_events(args)
    return await VllmEngine.start(args, routing=RoutingConfig("cache"))


async def measure_pool(args: argparse.Namespace, size: str, policies: list[str]) -> list[dict]:
    """Two single-engine gateways (one core each) behind a GatewayPool per policy."""
    from client import GatewayPool
    from gateway.auth import ControlPolicy
    from gateway.server import Gateway
    from gateway.sessions import GatewayLimits

    rows, engines, gateways, serving = [], [], [], []
    limits = GatewayLimits(max_in_flight_per_client=100_000, max_in_flight_total=100_000)
    try:
        for core in range(2):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
            engine = await _engine(1, SIZES[size], kv_events=False)
            engines.append(engine)
            address = f"ipc:///tmp/eg-routing-pool-{os.getpid()}-{core}.sock"
            gateway = Gateway(engine, address, limits, control=ControlPolicy(open=True))
            gateways.append(gateway)
            serving.append(asyncio.ensure_future(gateway.serve()))
            await gateway.ready.wait()
        addresses = [g.addresses[0] for g in gateways]
        for name in args.workloads.split(","):
            for policy in policies:
                async with GatewayPool(addresses, policy=POOL_POLICIES[policy]) as pool:
                    for client in pool.clients:
                        await client.reset_prefix_cache()
                    run = await run_workload(pool, 2, {}, name, policy, args.seed)
                row = summarize(name, size, policy, run, 2)
                rows.append(row)
                _print_row(row)
    finally:
        for gateway in gateways:
            gateway.stop()
        await asyncio.gather(*serving, return_exceptions=True)
        for engine in engines:
            await engine.aclose()
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return rows


def _print_row(row: dict) -> None:
    print(
        f"{row['cache']:5} {row['workload']:13} {row['policy']:11} hit {row['hit_rate']:.3f}"
        f" (ideal {row['ideal_hit_rate']:.3f}) computed {row['computed_tokens']:6} TTFT p50"
        f" {row['ttft_p50_ms']:6.1f} ms  share {row['requests_per_rank']}"
        f"  decisions {row.get('decisions', {})}",
        flush=True,
    )


async def measure(args: argparse.Namespace) -> list[dict]:
    from client import AsyncClient
    from gateway.auth import ControlPolicy
    from gateway.routing import Router
    from gateway.server import Gateway
    from gateway.sessions import GatewayLimits

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    for size in args.sizes.split(","):
        per_rank = SIZES[size]
        layouts = []
        named = args.policies.split(",")
        pooled = [p for p in named if p in POOL_POLICIES]
        if pooled:
            rows += await measure_pool(args, size, pooled)
        policies = [p for p in named if p != "ceiling" and p not in POOL_POLICIES]
        if policies:
            layouts.append((2, per_rank, policies))
        if "ceiling" in named:
            layouts.append((1, 2 * per_rank, ["ceiling"]))
        for ranks, blocks, layout_policies in layouts:
            if ranks == 2:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
            else:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            engine = await _engine(ranks, blocks)
            ranks_of = install_rank_recorder(engine)
            address = f"ipc:///tmp/eg-routing-bench-{os.getpid()}.sock"
            limits = GatewayLimits(max_in_flight_per_client=100_000, max_in_flight_total=100_000)
            gateway = Gateway(engine, address, limits, control=ControlPolicy(open=True))
            serving = asyncio.ensure_future(gateway.serve())
            await gateway.ready.wait()
            try:
                async with AsyncClient(address, name="routing-bench") as client:
                    for name in args.workloads.split(","):
                        for policy in layout_policies:
                            engine.router = Router(ranks, _router_config(policy))
                            await client.reset_prefix_cache()
                            before = _predictions(engine)
                            run = await run_workload(
                                client, ranks, ranks_of, name, policy, args.seed
                            )
                            row = summarize(name, size, policy, run, ranks)
                            row["predictions"] = [
                                now - then
                                for now, then in zip(_predictions(engine), before, strict=True)
                            ]
                            row["decisions"] = {
                                reason: count
                                for reason, count in engine.router.decisions.items()
                                if count
                            }
                            rows.append(row)
                            _print_row(row)
            finally:
                gateway.stop()
                await asyncio.gather(serving, return_exceptions=True)
                await engine.aclose()
    return rows


def _predictions(engine: Any) -> tuple[int, int, int, int]:
    """The gateway's routing accuracy so far: requests whose prefill was seen, those
    predicted exactly, cached tokens predicted, cached tokens vLLM reported."""
    a = engine.routing_accuracy
    return a.requests, a.exact, a.predicted_tokens, a.cached_tokens


def _router_config(policy: str) -> Any:
    """``cache``, ``approximate``, ``load``, ``round-robin``; ``hash`` and ``ceiling`` leave
    the rank to the client or to the one engine; ``cache:W:RATIO:SLACK`` sets the prefix
    weight and guard."""
    from gateway.routing import RoutingConfig

    if policy in ("hash", "ceiling"):
        return RoutingConfig("load")
    if policy == "approximate":
        return RoutingConfig("cache", index="approximate")
    if policy.startswith("cache:"):
        weight, ratio, slack = (float(x) for x in policy.split(":")[1:])
        return RoutingConfig("cache", weight, ratio, slack)
    return RoutingConfig(policy)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| cache | workload | policy | hit rate | ideal | computed prompt tokens | vs load |"
        " cached tokens predicted / reported (exact) | TTFT p50 / p99 ms | wall s |"
        " requests per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    load = {(r["cache"], r["workload"]): r for r in rows if r["policy"] == "load"}
    for r in rows:
        base = load.get((r["cache"], r["workload"]))
        ratio = (
            f"{base['computed_tokens'] / r['computed_tokens']:.2f}x fewer"
            if base and r["computed_tokens"]
            else "-"
        )
        requests, exact, predicted, reported = r.get("predictions") or (0, 0, 0, 0)
        accuracy = f"{predicted} / {reported} ({exact}/{requests})" if requests else "-"
        lines.append(
            f"| {r['cache']} | {r['workload']} | {r['policy']} | {r['hit_rate']:.3f} |"
            f" {r['ideal_hit_rate']:.3f} | {r['computed_tokens']} | {ratio} | {accuracy} |"
            f" {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['wall_s']:.2f} |"
            f" {r['requests_per_rank']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Hit rate per workload and policy (bars), the ideal as a line, one panel per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["cache"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 4.5), squeeze=False)
    width = 0.8 / len(policies)
    for ax, size in zip(axes[0], sizes, strict=True):
        for i, policy in enumerate(policies):
            values = [
                next(
                    (r["hit_rate"] for r in rows
                     if (r["cache"], r["workload"], r["policy"]) == (size, w, policy)),
                    0.0,
                )
                for w in workloads
            ]  # fmt: skip
            ax.bar([x + i * width for x in range(len(workloads))], values, width, label=policy)
        ideal = [
            next(r["ideal_hit_rate"] for r in rows if (r["cache"], r["workload"]) == (size, w))
            for w in workloads
        ]
        for x, value in enumerate(ideal):
            ax.hlines(value, x - width / 2, x + 0.8 - width / 2, colors="black", linewidth=1)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
        ax.set_ylabel("prefix-cache hit rate (vLLM's cached_tokens / prompt tokens)")
        ax.set_title(f"cache {size} (black line: ideal)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--sizes", default="large,small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    import uvloop

    rows = uvloop.run(measure(args))
    report = markdown(rows)
    print(report)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        args.out.with_suffix(".md").write_text(
            "# Prefix-cache routing over two ranks (`python -m bench.routing`)\n\n" + report
        )
        plot(rows, args.out.parent / f"{args.out.name}_plots.png")
    return 0


if __name__ == "__main__":
    from gateway.quick_exit import exit_now

    exit_now(main())  # without the teardown: vLLM's imports made it slow and noisy
