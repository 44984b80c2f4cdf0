"""Admission: every limit and policy a Generate meets before the session table accepts it.

One ordered pipeline (``PIPELINE``); its order is the documented order of refusals
(PROTOCOL.md sections 9 and 10): the first check that fails answers, and nothing after it
runs (nothing is taken from a client's budgets by a request refused earlier). A check reads
the table's state and the candidate and returns the refusal, or None; it changes nothing but
the candidate (what the engine will get) and the counts its refusal is reported in.
After the pipeline, ``rewrite`` makes what the gateway enforces on every accepted request:
each client's routing keys its own, and under cache isolation its cache and items too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from codec import (
    Error,
    ErrorCode,
    Generate,
    Overloaded,
    RequestOptions,
    prompt_too_long,
)
from codec.bounds import decode_kv_params, kv_params_given
from codec.framing import cache_salt_problem

from .multimodal_store import ItemProblem, isolated_id
from .session_model import Client, Effects, GatewayState
from .stop_sequences import check_stop_sequences

if TYPE_CHECKING:
    from .sessions import SessionTable

__all__ = [
    "Candidate",
    "KV_REFUSED",
    "MAX_ROUTING_KEY_LEN",
    "PIPELINE",
    "admit",
    "isolated_options",
    "overloaded",
    "refuse",
    "take_rate_token",
]

MAX_ROUTING_KEY_LEN = 256  # RequestOptions.routing_key (PROTOCOL.md section 3)

KV_REFUSED = (
    "kv_transfer_params has the engine's KV connector load or hand out KV-cache blocks (from"
    " the engine or host the params name), and what it loads serves other clients' requests"
    " too; this client is not allowed to send it (the operator allows clients with"
    " --control-key or --control-open)"
)


@dataclass(slots=True)
class Candidate:
    """A Generate on its way through admission: who sent it, and what the engine will get
    (``submitted``, rewritten by the checks that resolve its fields)."""

    client: Client
    client_id: bytes
    msg: Generate
    now: float
    submitted: Generate
    multimodal_bytes: int = 0  # its items' tensor bytes as the engine holds them
    resolved: list | None = None  # its items as the store keeps them (by content id)

    @property
    def request_id(self) -> str:
        return self.msg.request_id


Check = Callable[["SessionTable", Candidate], Effects | None]


def refuse(client_id: bytes, request_id: str, code: ErrorCode, message: str) -> Effects:
    """A Generate's refusal: one Error naming it."""
    return Effects(replies=[(client_id, Error(request_id, code, message))])


def overloaded(
    table: SessionTable, client_id: bytes, request_id: str, limit: str, value: int, current: int
) -> Effects:
    """A Generate refused by a load limit (counted by limit for /metrics)."""
    table.stats.overloaded[limit] += 1
    message = f"{limit} is {value} and the current load is {current}; retry later"
    return Effects(replies=[(client_id, Overloaded(request_id, limit, value, current, message))])


def take_rate_token(table: SessionTable, client: Client, now: float) -> bool:
    """One of the client's request-rate tokens (Generate and PrefixQuery share them);
    False when it has none left (``max_request_rate_per_client``)."""
    rate = table.limits.max_request_rate_per_client
    if rate <= 0:
        return True
    burst = table.limits.request_rate_burst
    client.rate_tokens = min(burst, client.rate_tokens + (now - client.rate_updated) * rate)
    client.rate_updated = now
    if client.rate_tokens < 1.0:
        return False
    client.rate_tokens -= 1.0
    return True


# ---------------------------------------------------------------- the checks, in order


def _unique_id(table: SessionTable, c: Candidate) -> Effects | None:
    if c.request_id in c.client.requests:
        return refuse(
            c.client_id,
            c.request_id,
            ErrorCode.DUPLICATE_REQUEST_ID,
            f"request id {c.request_id!r} is already live for this client; the live"
            " request is unaffected",
        )
    return None


def _serving(table: SessionTable, c: Candidate) -> Effects | None:
    state = table.state
    if state is GatewayState.SERVING:
        return None
    code = ErrorCode.DRAINING if state is GatewayState.DRAINING else ErrorCode.ENGINE_DEAD
    message = f"gateway is {state.value}; no new requests are accepted"
    return refuse(c.client_id, c.request_id, code, message)


def _request_rate(table: SessionTable, c: Candidate) -> Effects | None:
    if take_rate_token(table, c.client, c.now):
        return None
    rate = int(table.limits.max_request_rate_per_client)
    return overloaded(table, c.client_id, c.request_id, "max_request_rate_per_client", rate, rate)


def _in_flight(table: SessionTable, c: Candidate) -> Effects | None:
    """Per client, then in all; then the engine's queue (samples beyond max_num_seqs)."""
    limits = table.wire_limits
    queued = table.live_samples - table.info.max_num_seqs
    for limit, value, current in (
        ("max_in_flight_per_client", limits.max_in_flight_per_client, len(c.client.requests)),
        ("max_in_flight_total", limits.max_in_flight_total, table.live_requests),
        ("max_queued_requests", limits.max_queued_requests, queued),
    ):
        if current >= value:
            return overloaded(table, c.client_id, c.request_id, limit, value, current)
    return None


def _prompt_length(table: SessionTable, c: Candidate) -> Effects | None:
    tokens, limit = len(c.msg.prompt_token_ids), table.wire_limits.max_prompt_tokens
    if tokens > limit:
        return refuse(
            c.client_id, c.request_id, ErrorCode.INVALID_REQUEST, prompt_too_long(tokens, limit)
        )
    return None


def _gateway_fields(table: SessionTable, c: Candidate) -> Effects | None:
    """The fields the gateway (not vLLM's engine) acts on: stop sequences, timeouts, routing
    key; and the cache salt, which vLLM checks in its frontend, not its engine."""
    problem = _stop_sequences_problem(table, c.msg) or _options_problem(c.msg.options)
    if problem is None:
        return None
    return refuse(c.client_id, c.request_id, ErrorCode.INVALID_REQUEST, problem)


def _stop_sequences_problem(table: SessionTable, msg: Generate) -> str | None:
    sequences = msg.sampling.stop_token_sequences
    if not sequences:
        return None
    limits = table.wire_limits
    return check_stop_sequences(
        sequences, table.info.vocab_size, limits.max_stop_sequences, limits.max_stop_sequence_len
    )


def _options_problem(options: RequestOptions | None) -> str | None:
    if options is None:
        return None
    for name in ("deadline_s", "stall_timeout_s"):
        value = getattr(options, name)
        if value is not None and not 0 < value < 1e9:  # nan and inf fail too
            return f"{name} must be a number of seconds above 0, got {value}."
    if options.cache_salt is not None and (problem := cache_salt_problem(options.cache_salt)):
        return problem  # vLLM's frontend check, in its words
    key = options.routing_key
    if key is not None and len(key) > MAX_ROUTING_KEY_LEN:
        return f"routing_key must be at most {MAX_ROUTING_KEY_LEN} characters, got {len(key)}."
    return None


def _kv_transfer(table: SessionTable, c: Candidate) -> Effects | None:
    """kv_transfer_params only from clients the policy allows, read only then (the
    gateway's decoder reads over them: codec.bounds); an explicit nil is dropped."""
    options = c.submitted.options
    if options is None or options.kv_transfer_params is None:
        return None
    params = None
    if kv_params_given(options):
        if not table.kv_transfer_allowed(c.client.key):
            return refuse(c.client_id, c.request_id, ErrorCode.UNAUTHORIZED, KV_REFUSED)
        try:
            params = decode_kv_params(options.kv_transfer_params)
        except ValueError as exc:
            return refuse(c.client_id, c.request_id, ErrorCode.INVALID_REQUEST, str(exc))
    options = msgspec.structs.replace(options, kv_transfer_params=params)
    c.submitted = msgspec.structs.replace(c.submitted, options=options)
    return None


def _multimodal_items(table: SessionTable, c: Candidate) -> Effects | None:
    """Items resolved (named by hash: the ones this session sent) and checked, then their
    tensor bytes against the client's and everyone's in flight."""
    if not c.msg.multimodal:
        return None
    store = table.multimodal
    if store is None:
        message = f"model {table.info.model_name!r} takes no multimodal items"
        return refuse(c.client_id, c.request_id, ErrorCode.UNSUPPORTED, message)
    try:
        items = store.resolve(c.client.session_id, c.msg.multimodal, len(c.msg.prompt_token_ids))
    except ItemProblem as exc:
        return refuse(c.client_id, c.request_id, exc.code, exc.message)
    nbytes = store.engine_bytes(items)
    limits = table.wire_limits
    for limit, value, current in (
        (
            "max_multimodal_bytes_in_flight_per_client",
            limits.max_multimodal_bytes_in_flight_per_client,
            c.client.multimodal_bytes,
        ),
        (
            "max_multimodal_bytes_in_flight",
            limits.max_multimodal_bytes_in_flight,
            table.live_multimodal_bytes,
        ),
    ):
        if current + nbytes > value:
            return overloaded(table, c.client_id, c.request_id, limit, value, current)
    c.multimodal_bytes, c.resolved = nbytes, items
    c.submitted = msgspec.structs.replace(c.submitted, multimodal=items)
    return None


PIPELINE: tuple[Check, ...] = (
    _unique_id,
    _serving,
    _request_rate,
    _in_flight,
    _prompt_length,
    _gateway_fields,
    _kv_transfer,
    _multimodal_items,
)
"""The checks a Generate meets, in the order its refusals are documented."""


def admit(
    table: SessionTable, client: Client, client_id: bytes, msg: Generate, now: float
) -> Candidate | Effects:
    """Run ``msg`` through the pipeline: its refusal, or the candidate to prepare, with
    what the gateway enforces on it (``rewrite``) done."""
    candidate = Candidate(client, client_id, msg, now, msg)
    for check in PIPELINE:
        refusal = check(table, candidate)
        if refusal is not None:
            return refusal
    rewrite(table, candidate)
    return candidate


# ---------------------------------------------------------------- what every request gets


def rewrite(table: SessionTable, c: Candidate) -> None:
    """Each client's routing keys its own (no client can re-point or evict another's);
    under cache isolation its cache salt and its items' ids too."""
    options = c.submitted.options
    if options is not None and options.routing_key is not None:
        # Hex (no ":"), whichever identity: the router reads the owner up to the first
        # ":" (a Z85 CURVE key may hold one: two such keys would share one budget).
        owner = (c.client.key.encode() if c.client.key else c.client_id).hex()
        options = msgspec.structs.replace(options, routing_key=f"{owner}:{options.routing_key}")
        c.submitted = msgspec.structs.replace(c.submitted, options=options)
    if not table.cache_isolation:
        return
    c.submitted = msgspec.structs.replace(
        c.submitted, options=isolated_options(c.client, c.submitted.options)
    )
    if c.resolved:  # the engine's encoder cache is keyed by the item's id: the tenant's
        owner = tenant(c.client)
        items = [msgspec.structs.replace(i, hash=isolated_id(owner, i.hash)) for i in c.resolved]
        c.submitted = msgspec.structs.replace(c.submitted, multimodal=items)


def tenant(client: Client) -> str:
    """Whose cache a client's requests use under cache isolation: its CURVE key (its
    routing id without CURVE)."""
    return f"key:{client.key}" if client.key else f"id:{client.client_id.hex()}"


def isolated_options(client: Client, options: RequestOptions | None) -> RequestOptions:
    """``options`` with the cache salt the gateway enforces under cache isolation: the
    client's CURVE key (its routing id without CURVE), then the client's own salt.
    vLLM hashes the salt into every block, so no other key's request can hit (or
    probe) these blocks. A key is 40 characters and an id hex digits: the ``/`` after
    either ends it, so no client's own salt can pass for another client's."""
    options = options or RequestOptions()
    salt = f"{tenant(client)}/{options.cache_salt or ''}"
    return msgspec.structs.replace(options, cache_salt=salt)
