"""Markdown table and PNG plots from a results dict (bench/results/<name>.*)."""

from __future__ import annotations

from pathlib import Path

from .targets import scaled_target


def _f(value: float | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def _range(row: dict) -> str:
    lo_hi = row.get("output_tok_s_range")
    return "" if not lo_hi or row.get("rounds", 1) < 2 else f" ({lo_hi[0]:.0f}–{lo_hi[1]:.0f})"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if not value or not base else f"{value / base:.2f}x"


def _scale_lines(rows: list[dict], base: dict, baseline: str) -> list[str]:
    """Targets with N data-parallel engines against N times one engine's ceiling (the
    baseline, one engine, at the same concurrency): what the frontend lets through."""
    scaled = [(r, scaled_target(r["target"])) for r in rows]
    scaled = [(r, s[1]) for r, s in scaled if s is not None and s[1] > 1]
    if not scaled:
        return []
    lines = [
        "",
        f"Scale-out: each target's throughput against its engines' summed ceiling (N x "
        f"`{baseline}`'s tok/s on one engine, same concurrency), and its frontend cores.",
        "",
        "| target | conc | engines | output tok/s | vs N x one engine | frontend cores |",
        "|---|---|---|---|---|---|",
    ]
    for r, engines in sorted(scaled, key=lambda item: (item[0]["concurrency"], item[0]["target"])):
        one = base.get(r["concurrency"], {}).get("output_tok_s")
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {engines} | "
            f"{_f(r['output_tok_s'], '.0f')} | {_ratio(r['output_tok_s'], one and one * engines)} "
            f"| {_f(r.get('frontend_cores'), '.2f')} |"
        )
    return lines


def write_report(results: dict, stem: Path) -> str:
    """Write <stem>.md and plots; return the markdown."""
    rows = [r for r in results["rows"] if r["mode"] == "closed"]
    baseline = results["settings"].get("baseline", "direct")
    direct = {r["concurrency"]: r for r in rows if r["target"] == baseline}
    lines = [
        f"# Benchmark `{results['name']}` ({results['when']})",
        "",
        f"Versions: {', '.join(f'{k} {v}' for k, v in results['versions'].items())}.",
        f"Settings: {results['settings']}.",
        "",
        "Closed loop; every target runs at every level in each round, in a shuffled order, "
        f"{results['settings'].get('rounds', 1)} rounds; figures are medians over the rounds "
        f"(throughput range in brackets). Ratios are against `{baseline}` at the "
        "same concurrency, in the same run. Frontend CPU: the gateway process(es), vLLM's API "
        "server process(es), or the benchmark process for the direct client (engine-core, "
        "worker and DP-coordinator processes excluded).",
        "",
        f"| target | conc | output tok/s | vs {baseline} | req/s | TTFT p50 / p99 ms | "
        f"ITL p50 / p99 ms | E2E p50 ms | CPU s / 1k tok | CPU vs {baseline} | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["target"])):
        d = direct.get(r["concurrency"], {})
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {_f(r['output_tok_s'], '.0f')}{_range(r)} | "
            f"{_ratio(r['output_tok_s'], d.get('output_tok_s'))} | {_f(r['req_s'], '.2f')} | "
            f"{_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p99'])} | "
            f"{_f(r['itl_ms']['p50'], '.2f')} / {_f(r['itl_ms']['p99'], '.2f')} | "
            f"{_f(r['e2e_ms']['p50'], '.0f')} | {_f(r['cpu_s_per_1k_tokens'], '.4f')} | "
            f"{_ratio(r['cpu_s_per_1k_tokens'], d.get('cpu_s_per_1k_tokens'))} | {r['errors']} |"
        )
    if any(r.get("engine_cores") is not None for r in rows):
        lines += [
            "",
            "Where the CPU goes (medians over the rounds): frontend µs of CPU per output token "
            "and cores busy, the engine processes' cores busy (engine core, workers, DP "
            "coordinator), engine steps per second (zero-compute executor only), the ms per "
            "second the engine core's main thread (its busy loop) sat runnable without a core, "
            "the times per second the kernel took its core from it, and the context switches of "
            "the whole machine per engine step (each wake-up of any thread: a frontend's loop, "
            "a ZeroMQ I/O thread, the load generator).",
            "",
            "| target | conc | output tok/s | frontend µs/token | frontend cores | "
            "engine cores | engine steps/s | engine wait ms/s | engine preempted /s | "
            "machine switches / step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["concurrency"], r["target"])):
            lines.append(
                f"| {r['target']} | {r['concurrency']} | {_f(r['output_tok_s'], '.0f')} | "
                f"{_f(r.get('frontend_cpu_us_per_token'), '.1f')} | "
                f"{_f(r.get('frontend_cores'), '.2f')} | {_f(r.get('engine_cores'), '.2f')} | "
                f"{_f(r.get('engine_steps_per_s'), '.0f')} | "
                f"{_f(r.get('engine_wait_ms_per_s'), '.0f')} | "
                f"{_f(r.get('engine_preemptions_per_s'), '.0f')} | "
                f"{_f(r.get('machine_switches_per_step'), '.1f')} |"
            )
    lines += _scale_lines(rows, direct, baseline)
    poisson = [r for r in results["rows"] if r["mode"] == "poisson"]
    if poisson:
        lines += [
            "",
            "Open loop (Poisson arrivals):",
            "",
            "| target | rate req/s | output tok/s | TTFT p50 / p99 ms | E2E p50 ms | "
            "CPU s / 1k tok |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(poisson, key=lambda r: (r["rate"], r["target"])):
            lines.append(
                f"| {r['target']} | {r['rate']} | {_f(r['output_tok_s'], '.0f')} | "
                f"{_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p99'])} | "
                f"{_f(r['e2e_ms']['p50'], '.0f')} | {_f(r['cpu_s_per_1k_tokens'], '.4f')} |"
            )
    ceiling = results.get("ceiling")
    if ceiling:
        lines += [
            "",
            "Gateway ceiling with the fake engine (no engine cost):",
            "",
            "| streams | output tok/s | gateway CPU util | tok/s per gateway core |",
            "|---|---|---|---|",
        ]
        for c in ceiling["throughput"]:
            lines.append(
                f"| {c['streams']} | {_f(c['output_tok_s'], '.0f')} | "
                f"{_f(c['gateway_cpu_utilization'], '.2f')} | "
                f"{_f(c['tok_s_per_gateway_core'], '.0f')} |"
            )
        lat = ceiling.get("latency")
        if lat:
            base = lat.get("transport_baseline") or {}
            proc = lat.get("processing") or {}
            raw = lat.get("raw_client") or {}
            lines += [
                "",
                "Latency per output frame (fake engine stepping every 2 ms, one stream, ipc):",
                "",
                "| measure | p50 µs | p99 µs |",
                "|---|---|---|",
                "| engine step → AsyncClient consumer (gateway + ZeroMQ + client library) | "
                f"{_f(lat['added_us_p50'], '.0f')} | {_f(lat['added_us_p99'], '.0f')} |",
                "| engine step → a bare protocol client (zmq.asyncio DEALER + codec, no library) | "
                f"{_f(raw.get('added_us_p50'), '.0f')} | {_f(raw.get('added_us_p99'), '.0f')} |",
                "| bare pyzmq ROUTER → DEALER one-way, same cadence (transport floor) | "
                f"{_f(base.get('one_way_us_p50'), '.0f')} | "
                f"{_f(base.get('one_way_us_p99'), '.0f')} |",
                "| gateway processing per frame (on_step + encode + send), in process | "
                f"{_f(proc.get('us_per_frame'), '.1f')} | – |",
            ]
        for error in ceiling.get("errors", []):
            lines.append(f"\nCeiling error: {error}")
    plots = _plots(results, stem)
    if plots:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    md = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(md)
    return md


def _plots(results: dict, stem: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in results["rows"] if r["mode"] == "closed"]
    targets = sorted({r["target"] for r in rows})
    out = []
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for t in targets:
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in rows if r["target"] == t)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
    ax.set_xscale("log", base=2)
    ax.set(title="Output throughput", xlabel="concurrency", ylabel="tokens/s")
    ax.legend()
    ax = axes[1]
    top = max((r["concurrency"] for r in rows), default=1)
    for t in targets:
        for r in rows:
            if r["target"] == t and r["concurrency"] == top and r["ttft_samples_ms"]:
                xs = sorted(r["ttft_samples_ms"])
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=t)
    ax.set(title=f"TTFT CDF at concurrency {top}", xlabel="ms", ylabel="fraction")
    ax.legend()
    ax = axes[2]
    concs = sorted({r["concurrency"] for r in rows})
    width = 0.8 / max(len(targets), 1)
    for i, t in enumerate(targets):
        vals = [
            next(
                (
                    r["cpu_s_per_1k_tokens"] or 0
                    for r in rows
                    if r["target"] == t and r["concurrency"] == c
                ),
                0,
            )
            for c in concs
        ]
        ax.bar([j + i * width for j in range(len(concs))], vals, width, label=t)
    ax.set_xticks(
        [j + width * (len(targets) - 1) / 2 for j in range(len(concs))], [str(c) for c in concs]
    )
    ax.set(
        title="Frontend CPU seconds per 1k output tokens",
        xlabel="concurrency",
        ylabel="CPU s / 1k tokens",
    )
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    path = stem.with_name(stem.name + "_plots.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    out.append(path)
    return out
