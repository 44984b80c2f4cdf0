"""Prometheus metrics: a collector that reads the gateway's counters at scrape time.

Rule: the hot path only increments plain ints (SessionTable.stats, Gateway
counters) and one histogram per engine step; nothing here runs per frame.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .sessions import SessionTable

__all__ = ["StepHistogram", "GatewayCollector", "start_metrics_server"]

_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class StepHistogram:
    """Seconds the gateway spends on one engine step's outputs (table, encode, sends)."""

    __slots__ = ("counts", "total", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1


class GatewayCounters(Protocol):
    """What the collector reads of a gateway (``server.Gateway`` has it): this module
    needs no import of the server, which imports ``StepHistogram`` from here."""

    table: SessionTable
    engine: object  # its routing_stats(), when it has one
    errors_by_code: Counter
    frames_sent: int
    frames_dropped: int
    step_histogram: StepHistogram


class GatewayCollector:
    """prometheus-client collector over one Gateway."""

    def __init__(self, gateway: GatewayCounters):
        self.gateway = gateway

    def collect(self) -> Iterator:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        gw = self.gateway
        table = gw.table
        stats = table.stats
        p = "engine_gateway_"
        yield CounterMetricFamily(
            p + "requests_accepted", "Generate requests accepted", value=stats.requests_accepted
        )
        finished = CounterMetricFamily(
            p + "requests_finished", "Samples finished, by reason", labels=["reason"]
        )
        for reason, n in stats.finished.items():
            finished.add_metric([reason.lower()], n)
        yield finished
        yield CounterMetricFamily(
            p + "output_tokens", "Output tokens streamed", value=stats.output_tokens
        )
        yield CounterMetricFamily(
            p + "aborts", "Requests aborted by their client", value=stats.aborted_by_client
        )
        yield CounterMetricFamily(
            p + "clients_expired",
            "Sessions ended by heartbeat timeout",
            value=stats.clients_expired,
        )
        yield CounterMetricFamily(
            p + "clients_left",
            "Sessions their client ended with Goodbye (a clean close)",
            value=stats.clients_left,
        )
        yield CounterMetricFamily(
            p + "pauses", "Pause control calls the engine carried out", value=stats.pause_calls
        )
        yield CounterMetricFamily(
            p + "process_stalls",
            "Times the gateway process did not run for over 0.25 s (host paused or"
            " CPU-throttled); heartbeat timeouts skip that time",
            value=stats.pauses_forgiven,
        )
        yield CounterMetricFamily(
            p + "timed_out", "Requests ended by deadline_s or stall_timeout_s", stats.timed_out
        )
        yield CounterMetricFamily(
            p + "stop_sequence_hits", "Samples ended by a stop sequence", stats.stop_sequence_hits
        )
        yield CounterMetricFamily(
            p + "late_outputs",
            "Engine outputs for samples already ended (dropped; the engine was told to stop)",
            stats.late_outputs,
        )
        errors = CounterMetricFamily(p + "errors", "Error frames sent, by code", labels=["code"])
        for code, n in gw.errors_by_code.items():
            errors.add_metric([code.name.lower()], n)
        yield errors
        overloaded = CounterMetricFamily(
            p + "overloaded", "Overloaded replies, by limit", labels=["limit"]
        )
        for limit, n in stats.overloaded.items():
            overloaded.add_metric([limit], n)
        yield overloaded
        yield CounterMetricFamily(p + "frames_sent", "Frames sent", value=gw.frames_sent)
        yield CounterMetricFamily(
            p + "frames_dropped", "Frames that could not be sent", value=gw.frames_dropped
        )
        yield GaugeMetricFamily(
            p + "in_flight_requests", "Accepted requests not yet ended", value=table.live_requests
        )
        yield GaugeMetricFamily(
            p + "queued_requests",
            "Samples beyond the engine's max_num_seqs (its queue)",
            value=table.queued_requests,
        )
        yield GaugeMetricFamily(p + "connected_clients", "Sessions", value=table.connected_clients)
        multimodal = table.multimodal_stats()
        if multimodal:
            yield from _multimodal_families(
                p, multimodal, getattr(gw.engine, "last_encoder_cache_counts", {})
            )
        routing_stats = getattr(gw.engine, "routing_stats", None)
        routing = routing_stats() if routing_stats is not None else None
        if routing is not None:
            yield from _routing_families(p, routing)
        hist = gw.step_histogram
        buckets, running = [], 0
        for bound, n in zip((*_BUCKETS, float("inf")), hist.counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        yield HistogramMetricFamily(
            p + "step_seconds",
            "Gateway time per engine step (table, encode, sends)",
            buckets=buckets,
            sum_value=hist.total,
        )


def _multimodal_families(p: str, m: dict, encoder: dict) -> Iterator:
    """Multimodal items: received, sent by hash alone, held; the engines' encoder cache."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for name, text, key in (
        ("multimodal_items", "Multimodal items of accepted requests", "multimodal_items"),
        ("multimodal_item_bytes", "Tensor bytes received in accepted requests' items",
         "multimodal_item_bytes"),
        ("multimodal_items_by_hash", "Items named by hash alone (tensors held here)",
         "multimodal_items_by_hash"),
        ("multimodal_unknown_hashes", "Hash-only items refused (MULTIMODAL_ITEM_UNKNOWN)",
         "multimodal_unknown_hashes"),
        ("multimodal_evictions", "Held items evicted (least recently used)",
         "multimodal_evictions"),
    ):  # fmt: skip
        yield CounterMetricFamily(p + name, text, value=m[key])
    yield GaugeMetricFamily(
        p + "multimodal_held_bytes", "Bytes of items held for resending by hash",
        value=m["multimodal_held_bytes"],
    )  # fmt: skip
    for name, text, key in (
        ("encoder_cache_hits", "Items whose encoder output the engines had cached (5 s lag)",
         "encoder_cache_hits"),
        ("encoder_runs", "Items the engines ran their encoder for (5 s lag)", "encoder_runs"),
    ):  # fmt: skip
        yield CounterMetricFamily(p + name, text, value=encoder.get(key, 0))


def _routing_families(p: str, r: dict) -> Iterator:
    """Rank routing (--routing): decisions by reason, the prefix index, its accuracy."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    decisions = CounterMetricFamily(
        p + "routing_decisions", "Unpinned requests placed, by reason", labels=["reason"]
    )
    for reason, n in r["decisions"].items():
        decisions.add_metric([reason], n)
    yield decisions
    policy = GaugeMetricFamily(
        p + "routing_policy", "1: the policy unpinned requests go by", labels=["policy"]
    )
    policy.add_metric([r["policy"]], 1)
    yield policy
    if r.get("index"):
        index = GaugeMetricFamily(
            p + "routing_prefix_index",
            "1: where cache routing reads which rank holds what (events, approximate)",
            labels=["kind"],
        )
        index.add_metric([r["index"]], 1)
        yield index
    per_rank = (
        (GaugeMetricFamily, "prefix_index_blocks", "Block hashes the index holds", "index_blocks"),
        (GaugeMetricFamily, "prefix_index_synced", "1: the index saw every event", "synced"),
        (GaugeMetricFamily, "kv_event_feed_connected", "1: connected to the rank's publisher",
         "feed_connected"),
        (CounterMetricFamily, "kv_event_feed_disconnects", "Connections to a publisher lost",
         "feed_disconnects"),
        (GaugeMetricFamily, "kv_event_rank_lag_seconds",
         "Receipt minus the engine's stamp, the rank's last batch", "feed_lag_s"),
        (CounterMetricFamily, "kv_event_gaps", "Sequence gaps in KV events", "gaps"),
        (CounterMetricFamily, "kv_event_restarts", "KV event streams restarted", "restarts"),
        (CounterMetricFamily, "prefix_index_resets", "Index cleared: gap not refilled", "resets"),
    )  # fmt: skip
    for kind, name, text, key in per_rank:
        family = kind(p + name, text, labels=["rank"])
        for rank, value in enumerate(r[key]):
            family.add_metric([str(rank)], float(value))
        yield family
    for name, text, key in (
        ("kv_event_batches", "KV event batches applied", "event_batches"),
        ("kv_event_replayed_batches", "Batches refilled from replay", "replayed_batches"),
        ("kv_event_malformed_batches", "Batches that could not be read", "malformed_batches"),
        ("routing_predictions", "Routed requests whose prefill was seen", "predictions"),
        ("routing_exact_predictions", "...whose cached tokens were predicted exactly",
         "exact_predictions"),
        ("routing_predicted_cached_tokens", "Cached prompt tokens the index predicted",
         "predicted_cached_tokens"),
        ("routing_reported_cached_tokens", "Cached prompt tokens vLLM then reported",
         "reported_cached_tokens"),
    ):  # fmt: skip
        yield CounterMetricFamily(p + name, text, value=r[key])
    yield GaugeMetricFamily(
        p + "kv_event_lag_seconds", "Now minus the engine's stamp on the last batch",
        value=r["event_lag_s"],
    )  # fmt: skip


def start_metrics_server(
    gateway: GatewayCounters | None, port: int, addr: str = "127.0.0.1"
) -> CollectorRegistry:
    """Serve /metrics on ``addr:port`` from a background thread (prometheus-client).

    With ``gateway`` None the port is bound now and serves nothing until
    ``registry.register(GatewayCollector(gateway))`` (the CLI binds before the
    engine starts). Raises OSError when the port cannot be bound.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    if gateway is not None:
        registry.register(GatewayCollector(gateway))
    start_http_server(port, addr=addr, registry=registry)
    return registry
