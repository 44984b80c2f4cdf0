"""The queries a session table answers without changing a request: model info, health,
PrefixQuery, and its counts for StatsReply and /metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from codec import (
    Error,
    ErrorCode,
    GetHealth,
    GetModelInfo,
    HealthReply,
    ModelInfoReply,
    PrefixQuery,
    PrefixReply,
)

from .admission import isolated_options, take_rate_token
from .errors import RequestRejected
from .session_model import Effects, GatewayState

if TYPE_CHECKING:
    from .sessions import SessionTable

__all__ = ["gateway_stats", "get_health", "get_model_info", "multimodal_stats", "prefix_query"]

# What a PrefixQuery without a session is told (each query hashes the whole prompt: no work
# for strangers).
PREFIX_QUERY_HELLO_FIRST = "send Hello before PrefixQuery"


def get_model_info(table: SessionTable, client_id: bytes, msg: GetModelInfo) -> Effects:
    reply = ModelInfoReply(msg.call_id, table.model_info, table.wire_limits)
    return Effects(replies=[(client_id, reply)])


def get_health(table: SessionTable, client_id: bytes, msg: GetHealth) -> Effects:
    reply = HealthReply(
        call_id=msg.call_id,
        ready=table.state is GatewayState.SERVING,
        state=table.state.value,
        live_requests=table.live_requests,
        connected_clients=table.connected_clients,
        paused=table.paused,
        engines=table.engine_load(),
    )
    return Effects(replies=[(client_id, reply)])


def prefix_query(table: SessionTable, client_id: bytes, msg: PrefixQuery, now: float) -> Effects:
    """How much of the prompt each rank holds (the engine's answer), for a client with a
    session and a rate token, a prompt a Generate could carry; its options' LoRA and salt
    (under cache isolation, the client's) are part of the hash."""
    prompt, call_id = msg.prompt_token_ids, msg.call_id
    limit = table.wire_limits.max_prompt_tokens
    if table.prefix_query_fn is None:
        error = Error(None, ErrorCode.UNSUPPORTED, "this gateway has no engine", call_id)
        return Effects(replies=[(client_id, error)])
    client = table.client(client_id)
    if client is None:
        error = Error(None, ErrorCode.HANDSHAKE_REQUIRED, PREFIX_QUERY_HELLO_FIRST, call_id)
        return Effects(replies=[(client_id, error)])
    if not take_rate_token(table, client, now):
        rate = table.limits.max_request_rate_per_client
        error = Error(
            None,
            ErrorCode.RATE_LIMITED,
            f"PrefixQuery over max_request_rate_per_client ({rate:g}/s, shared with"
            " Generate): retry later",
            call_id,
        )
        return Effects(replies=[(client_id, error)])
    if not prompt or len(prompt) > limit:
        message = f"prompt_token_ids must hold 1 to {limit} ids, got {len(prompt)}"
        error = Error(None, ErrorCode.INVALID_REQUEST, message, call_id)
        return Effects(replies=[(client_id, error)])
    options = msg.options
    if options is not None and options.kv_transfer_params is not None:  # not hashed
        options = msgspec.structs.replace(options, kv_transfer_params=None)
    if table.cache_isolation:
        options = isolated_options(client, options)
    try:
        matched, block_size, policy = table.prefix_query_fn(prompt, options)
    except RequestRejected as exc:
        return Effects(replies=[(client_id, Error(None, exc.code, exc.message, call_id))])
    return Effects(replies=[(client_id, PrefixReply(call_id, block_size, matched, policy))])


def gateway_stats(table: SessionTable) -> dict[str, int]:
    """The gateway's own counts, for StatsReply."""
    stats = table.stats
    return {
        "live_requests": table.live_requests,
        "live_samples": table.live_samples,
        "queued_requests": table.queued_requests,
        "connected_clients": table.connected_clients,
        "requests_accepted": stats.requests_accepted,
        "output_tokens": stats.output_tokens,
        "aborted_by_client": stats.aborted_by_client,
        "timed_out": stats.timed_out,
        "stop_sequence_hits": stats.stop_sequence_hits,
        "clients_expired": stats.clients_expired,
        "clients_left": stats.clients_left,
        "pauses_forgiven": stats.pauses_forgiven,
        "slow_consumers": stats.slow_consumers,
        **multimodal_stats(table),
    }


def multimodal_stats(table: SessionTable) -> dict[str, int]:
    """Multimodal items of accepted requests (none without a multimodal model)."""
    store = table.multimodal
    if store is None:
        return {}
    s = store.stats
    return {
        "multimodal_items": s.items,
        "multimodal_item_bytes": s.item_bytes,
        "multimodal_items_by_hash": s.items_by_hash,
        "multimodal_unknown_hashes": s.unknown_hashes,
        "multimodal_evictions": s.evictions,
        "multimodal_held_items": len(store),
        "multimodal_held_bytes": store.held_bytes,
    }
