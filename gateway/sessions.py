"""SessionTable: every client's session and every live request; sans-IO.

Rules (this is the one place they live):
- Methods take one decoded message or one engine step plus ``now`` and return
  effects (replies per client, engine requests to submit, engine ids to abort).
  No awaits, sockets or clock reads.
- Requests are keyed by (client_id, request_id); engine ids come from one
  process-wide counter and are never reused.
- A request is in the table exactly while it is live. Each of its samples gets
  exactly one terminal output (a RequestOutput with ``finished``, or an Error),
  and the request leaves the table when its last sample's terminal is produced.
  Engine outputs for ids no longer in the table are dropped, so nothing is ever
  sent for a request after its terminal output, even when outputs race an abort.
- Every way a request ends (engine finish aside) goes through ``_end_requests``,
  which takes the samples to end and why; callers only choose which and why.
- Requests may carry stop sequences (matched here, per sample: stop_sequences.py)
  and timeouts (``expire``); both end samples through the same paths as the
  engine or an abort, and tell the engine to stop.
- A client whose send pipe is full (the server reports it) is a slow consumer:
  its requests end with SLOW_CONSUMER and it may not open a new session until
  the frames already owed to it were delivered (``on_send_unblocked``).
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import msgspec

from codec import (
    CONTROL_MESSAGES,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    AbortSamples,
    ClientMessage,
    EngineLoad,
    Error,
    ErrorCode,
    Finished,
    FinishReason,
    FinishWeightUpdate,
    Generate,
    GetHealth,
    GetModelInfo,
    HealthReply,
    Hello,
    HelloAck,
    Limits,
    Logprobs,
    ModelInfo,
    ModelInfoReply,
    Outputs,
    Overloaded,
    Pause,
    Ping,
    Pong,
    PrefixQuery,
    PrefixReply,
    ProtocolError,
    ReloadWeights,
    RequestOptions,
    RequestOutput,
    RequestTimings,
    ServerMessage,
    SetWeightVersion,
    StartWeightUpdate,
    WeightVersionSpan,
    prompt_too_long,
    wire_type,
)
from codec.bounds import decode_kv_params, kv_params_given

from .engine import EngineInfo, PreparedRequest, StepOutput, sample_engine_request_id
from .errors import RequestRejected
from .multimodal_store import ItemProblem, MultimodalStore, isolated_id
from .stop_sequences import StopMatcher, check_stop_sequences

__all__ = ["GatewayLimits", "GatewayState", "Effects", "SessionTable", "Reply"]

Reply = tuple[bytes, ServerMessage]
logger = logging.getLogger("engine_gateway")

# PrefixQuery: (prompt ids, options) -> (matched tokens per rank, block size, policy).
PrefixQueryFn = Callable[[list[int], RequestOptions | None], tuple[list[int | None], int, str]]

MAX_ROUTING_KEY_LEN = 256  # RequestOptions.routing_key (PROTOCOL.md section 3)
# What a message that needs a session is told without one (HANDSHAKE_REQUIRED).
_HELLO_FIRST = {
    Generate: "send Hello before Generate (or again after a heartbeat timeout)",
    Abort: "send Hello before Abort",
    AbortSamples: "send Hello before AbortSamples",
    PrefixQuery: "send Hello before PrefixQuery",
    **{kind: "send Hello before control calls" for kind in CONTROL_MESSAGES},
}


def frame_limit_for(max_model_len: int) -> int:
    """The default ``max_frame_bytes``: room for the largest valid Generate of a model with
    this context (a prompt of ``max_model_len`` ids at up to 5 msgpack bytes each) plus
    64 KiB for sampling fields and options. A frame's decode holds the event loop (every
    list is bounded from its header, codec.bounds; what is left scales with the frame), so
    the limit grows with what the model can take, no further."""
    return 5 * max_model_len + 64 * 1024


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """Configurable limits; all reported to clients in HelloAck.limits."""

    max_frame_bytes: int | None = None  # None: frame_limit_for(the model's max_model_len)
    max_prompt_tokens: int | None = None  # None: the model's max_model_len
    max_in_flight_per_client: int = 1024
    max_in_flight_total: int = 4096
    max_abort_ids: int = 4096
    max_queued_requests: int = 4096  # samples beyond the engine's max_num_seqs
    max_request_rate_per_client: float = 0.0  # Generates per second; 0: unlimited
    request_rate_burst: int = 256
    client_send_hwm: int = 10_000  # frames queued to one client before it is a slow consumer
    max_clients: int = 4096  # sessions at once (and slow consumers still owed frames)
    max_stop_sequences: int = 32  # SamplingParams.stop_token_sequences per request
    max_stop_sequence_len: int = 64  # tokens in one stop sequence
    max_bad_words: int = 1024  # SamplingParams.bad_words_token_ids per request
    max_bad_word_len: int = 64  # tokens in one bad word
    # Multimodal items (models with modalities only; PROTOCOL.md §7.16).
    max_multimodal_items: int = 16  # per request
    max_multimodal_item_bytes: int = 32 * 1024 * 1024
    max_multimodal_request_bytes: int = 64 * 1024 * 1024
    multimodal_cache_bytes: int = 1024 * 1024 * 1024  # items held for resending by hash
    # Tensor bytes (as the engine holds them) of accepted requests not yet finished.
    max_multimodal_bytes_in_flight_per_client: int = 1024 * 1024 * 1024
    max_multimodal_bytes_in_flight: int = 4 * 1024 * 1024 * 1024
    default_heartbeat_interval_s: float = 5.0
    min_heartbeat_interval_s: float = 0.05
    max_heartbeat_interval_s: float = 300.0
    heartbeat_timeout_factor: float = 3.0

    def for_model(self, max_model_len: int, multimodal: bool = False) -> GatewayLimits:
        """These limits with every default that follows the model filled in (a multimodal
        model's frames hold a request's tensors too)."""
        if self.max_frame_bytes is not None:
            return self
        frame = frame_limit_for(max_model_len)
        if multimodal:
            frame += self.max_multimodal_request_bytes + 64 * self.max_multimodal_items * 1024
        return replace(self, max_frame_bytes=frame)


@dataclass(slots=True)
class TableStats:
    """Running counts, read by the metrics collector at scrape time (no I/O here)."""

    requests_accepted: int = 0
    output_tokens: int = 0
    aborted_by_client: int = 0
    clients_expired: int = 0
    pauses_forgiven: int = 0  # times this process did not run for a while (see forgive)
    slow_consumers: int = 0
    timed_out: int = 0  # requests ended by deadline_s or stall_timeout_s
    stop_sequence_hits: int = 0  # samples ended by a stop sequence
    late_outputs: int = 0  # engine outputs for samples the gateway had already ended
    finished: Counter[str] = field(default_factory=Counter)  # by FinishReason name
    overloaded: Counter[str] = field(default_factory=Counter)  # by limit name


class GatewayState(Enum):
    SERVING = "serving"
    DRAINING = "draining"
    ENGINE_DEAD = "engine_dead"


@dataclass(slots=True)
class Effects:
    """What the server must do after a table method returns, in this order."""

    replies: list[Reply] = field(default_factory=list)
    submit: list[PreparedRequest] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    control: list[tuple[bytes, ClientMessage]] = field(default_factory=list)  # engine calls


@dataclass(slots=True)
class _Sample:
    engine_request_id: str
    index: int
    output_tokens: int = 0  # delivered (or to be delivered) to the client
    cached_tokens: int = 0
    external_cached_tokens: int = 0
    done: bool = False
    # Only for stream=False: everything produced so far.
    token_ids: list[int] | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # Stop sequences: the matcher, and streamed tokens held back (not sent yet).
    matcher: StopMatcher | None = None
    held_ids: list[int] = field(default_factory=list)
    held_logprobs: Logprobs | None = None
    # Monotonic times (engine events share the host's monotonic clock).
    queued_at: float | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    # Weight versions of the tokens produced: (version, first token) where each began;
    # spans' lengths follow from the next start and the final output_tokens.
    version: str | None = None
    versions: list[tuple[str, int]] = field(default_factory=list)
    # The version the client was last told (RequestOutput.weight_version): behind
    # ``version`` while the tokens of a new version are all held back.
    sent_version: str | None = None


@dataclass(slots=True, eq=False)
class _Request:
    client_id: bytes
    request_id: str
    stream: bool
    prompt_tokens: int
    samples: list[_Sample]
    live_samples: int
    accepted_at: float = 0.0
    last_output_at: float = 0.0
    deadline_at: float | None = None
    stall_timeout_s: float | None = None
    multimodal_bytes: int = 0  # its items' tensor bytes as the engine holds them


@dataclass(slots=True)
class _Client:
    client_id: bytes
    name: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    last_seen: float
    requests: dict[str, _Request] = field(default_factory=dict)
    rate_tokens: float = 0.0
    rate_updated: float = 0.0
    session_id: int = 0
    key: str | None = None  # the CURVE public key that opened it, when CURVE is on
    fresh: bool = True  # nothing but its Hello received yet (a repeated Hello keeps it)
    multimodal_bytes: int = 0  # of its live requests (_Request.multimodal_bytes)


KV_REFUSED = (
    "kv_transfer_params has the engine's KV connector load or hand out KV-cache blocks (from"
    " the engine or host the params name), and what it loads serves other clients' requests"
    " too; this client is not allowed to send it (the operator allows clients with"
    " --control-key or --control-open)"
)


class SessionTable:
    """All sessions and live requests of one gateway. See the module docstring."""

    def __init__(
        self,
        info: EngineInfo,
        prepare: Callable[[str, Generate], Sequence[PreparedRequest]],
        limits: GatewayLimits = GatewayLimits(),
        gateway_version: str = "0",
        engine_load: Callable[[], list[EngineLoad]] | None = None,
        engine_id_prefix: str = "g",
        prefix_query: PrefixQueryFn | None = None,
        cache_isolation: bool = False,
        kv_transfer_allowed: Callable[[str | None], bool] = lambda key: False,
    ):
        """``engine_id_prefix``: engine request ids are PREFIX1, PREFIX2, ...; gateways
        sharing one engine group need distinct prefixes (vLLM refuses duplicate ids).
        ``prefix_query``: the engine's answer to PrefixQuery (None: UNSUPPORTED).
        ``cache_isolation``: each client's prefix cache is its own (``_isolated``).
        ``kv_transfer_allowed``: whether a session's CURVE key (None without CURVE) may send
        ``kv_transfer_params`` (the server's control policy; default: nobody)."""
        self.cache_isolation = cache_isolation
        self.kv_transfer_allowed = kv_transfer_allowed
        self.info = info
        self._engine_load = engine_load or list
        self._prefix_query = prefix_query
        self.limits = limits
        self.state = GatewayState.SERVING
        self.paused = False  # the engine's scheduler, by Pause until Resume
        self._prepare = prepare
        # Session ids: from a random start, so that a restarted gateway's differ.
        self._session_ids = itertools.count(secrets.randbits(62) + 1)
        self._gateway_version = gateway_version
        self._clients: dict[bytes, _Client] = {}
        # Slow consumers whose owed frames are not delivered yet: no new session.
        self._blocked: set[bytes] = set()
        self._engine_ids = itertools.count(1)
        self._engine_id_prefix = engine_id_prefix
        self._by_engine_id: dict[str, tuple[_Request, _Sample]] = {}
        self._live_requests = 0
        self._live_multimodal_bytes = 0  # of every live request (_Request.multimodal_bytes)
        self._live_samples = 0
        # Requests with a deadline or stall timeout, in acceptance order (a dict as an
        # ordered set: _Request hashes by identity).
        self._timed: dict[_Request, None] = {}
        self.stats = TableStats()
        max_prompt = limits.max_prompt_tokens or info.max_model_len
        self.model_info = ModelInfo(
            name=info.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            cpu_attention=info.cpu_attention,
            modalities=list(info.modalities),
            multimodal=dict(info.multimodal),
        )
        # Items held for resending by hash, and the model-free item checks.
        self.multimodal = (
            MultimodalStore(
                limits.multimodal_cache_bytes,
                limits.max_multimodal_items,
                limits.max_multimodal_item_bytes,
                limits.max_multimodal_request_bytes,
                info.multimodal,
            )
            if info.modalities
            else None
        )
        mm = self.multimodal is not None
        self.wire_limits = Limits(
            max_prompt_tokens=min(max_prompt, info.max_model_len),
            max_in_flight_per_client=limits.max_in_flight_per_client,
            max_in_flight_total=limits.max_in_flight_total,
            max_frame_bytes=limits.max_frame_bytes,
            max_abort_ids=limits.max_abort_ids,
            max_logprobs=info.max_logprobs,
            max_queued_requests=limits.max_queued_requests,
            max_request_rate_per_client=limits.max_request_rate_per_client,
            client_send_hwm=limits.client_send_hwm,
            max_clients=limits.max_clients,
            max_stop_sequences=limits.max_stop_sequences,
            max_stop_sequence_len=limits.max_stop_sequence_len,
            max_bad_words=limits.max_bad_words,
            max_bad_word_len=limits.max_bad_word_len,
            max_multimodal_items=limits.max_multimodal_items if mm else 0,
            max_multimodal_item_bytes=limits.max_multimodal_item_bytes if mm else 0,
            max_multimodal_request_bytes=limits.max_multimodal_request_bytes if mm else 0,
            multimodal_cache_bytes=limits.multimodal_cache_bytes if mm else 0,
            max_multimodal_bytes_in_flight_per_client=(
                limits.max_multimodal_bytes_in_flight_per_client if mm else 0
            ),
            max_multimodal_bytes_in_flight=limits.max_multimodal_bytes_in_flight if mm else 0,
        )
        self._handlers: dict[type, Callable[[bytes, object, float], Effects]] = {
            Hello: self._on_hello,
            Generate: self._on_generate,
            Abort: self._on_abort,
            AbortSamples: self._on_abort_samples,
            Ping: self._on_ping,
            GetModelInfo: self._on_get_model_info,
            GetHealth: self._on_get_health,
            PrefixQuery: self._on_prefix_query,
            # Control calls reach on_control (authorized or not) from the server; sent
            # through on_message they are refused.
            **{kind: self._on_unauthorized_control for kind in CONTROL_MESSAGES},
        }

    # ------------------------------------------------------------ queries

    @property
    def live_requests(self) -> int:
        return self._live_requests

    @property
    def connected_clients(self) -> int:
        return len(self._clients)

    def live_engine_request_ids(self) -> list[str]:
        return [eid for eid, (_, s) in self._by_engine_id.items() if not s.done]

    def is_live(self, engine_request_id: str) -> bool:
        """Whether a sample with this engine id is live in the table."""
        return engine_request_id in self._by_engine_id

    def client_request_ids(self, client_id: bytes) -> list[str]:
        client = self._clients.get(client_id)
        return [] if client is None else list(client.requests)

    # ------------------------------------------------------------ inbound

    def on_message(
        self, client_id: bytes, msg: ClientMessage, now: float, key: str | None = None
    ) -> Effects:
        """Handle one decoded client message. ``key``: its sender's CURVE public key (with
        CURVE on): a session belongs to the key that opened it; another key's messages on
        its routing id are refused and change nothing."""
        client = self._clients.get(client_id)
        if client is not None:
            if client.key != key:
                return self._not_the_owner(client_id, msg)
            client.last_seen = now
            repeated_hello = type(msg) is Hello and client.fresh
            if repeated_hello and msg.protocol_version == PROTOCOL_VERSION:
                # Sent again while the first HelloAck was on its way: the same session.
                client.name = msg.client_name
                return Effects(replies=[(client_id, self._hello_ack(client))])
            client.fresh = False
        # By wire type: a Generate or PrefixQuery decoded under the gateway's bounds is a
        # subclass of it (codec.bounds).
        effects = self._handlers[wire_type(msg)](client_id, msg, now)
        if key is not None and type(msg) is Hello and client_id in self._clients:
            self._clients[client_id].key = key
        return effects

    def _not_the_owner(self, client_id: bytes, msg: ClientMessage) -> Effects:
        if type(msg) is Ping:
            return Effects(replies=[(client_id, Pong(msg.nonce))])
        error = Error(
            getattr(msg, "request_id", None) if isinstance(msg, Generate) else None,
            ErrorCode.UNAUTHORIZED,
            "this routing id's session was opened with another CURVE key; it is not yours"
            " to use or end (pick another routing id)",
            getattr(msg, "call_id", None),
        )
        return Effects(replies=[(client_id, error)])

    def on_control(
        self,
        client_id: bytes,
        msg: ClientMessage,
        now: float,
        authorized: bool,
        key: str | None = None,
        refusal: Callable[[bytes, ClientMessage, float], str | None] | None = None,
    ) -> Effects:
        """A control call (one of codec.CONTROL_MESSAGES).

        Refused with UNAUTHORIZED unless ``authorized`` (the server's policy), and without
        a session; with INVALID_REQUEST when ``refusal`` (the open weight update's rule)
        says why it may not run. Otherwise the server makes the engine call in
        ``Effects.control`` and answers when it is done; Pause(abort) first ends every live
        request with ABORT.
        """
        client = self._clients.get(client_id)
        if client is not None:
            if client.key != key:
                return self._not_the_owner(client_id, msg)
            client.last_seen = now
            client.fresh = False
        call_id = msg.call_id
        if not authorized:
            return self._on_unauthorized_control(client_id, msg, now)
        if client is None:
            error = Error(None, ErrorCode.HANDSHAKE_REQUIRED, _HELLO_FIRST[Pause], call_id)
            return Effects(replies=[(client_id, error)])
        if problem := _control_problem(msg):
            error = Error(None, ErrorCode.INVALID_MESSAGE, problem, call_id)
            return Effects(replies=[(client_id, error)])
        if refusal is not None and (problem := refusal(client_id, msg, now)):
            error = Error(None, ErrorCode.INVALID_REQUEST, problem, call_id)
            return Effects(replies=[(client_id, error)])
        effects = Effects()
        # ``paused`` changes when the engine call succeeds (control.control_reply).
        if (isinstance(msg, Pause) and msg.mode == "abort") or (
            isinstance(msg, StartWeightUpdate) and msg.pause == "abort" and not self.paused
        ):
            self._end_requests(self._all_requests(), FinishReason.ABORT, effects, now=now)
        effects.control.append((client_id, msg))
        return effects

    def _on_unauthorized_control(self, client_id: bytes, msg: ClientMessage, now: float) -> Effects:
        return self._unauthorized(client_id, wire_type(msg), msg.call_id)

    @staticmethod
    def _unauthorized(client_id: bytes, kind: type, call_id: int | None) -> Effects:
        error = Error(
            None,
            ErrorCode.UNAUTHORIZED,
            f"{kind.__name__} changes or inspects the engine for every client; this client is"
            " not allowed to call it (the operator allows clients with --control-key or"
            " --control-open)",
            call_id,
        )
        return Effects(replies=[(client_id, error)])

    def before_decode(
        self,
        client_id: bytes,
        kind: type,
        now: float,
        authorized: bool,
        call_id: Callable[[], int | None],
        key: str | None = None,
    ) -> Effects | None:
        """The refusal a frame of message ``kind`` gets from its tag alone, before its payload
        is decoded: a control call from a client the server's policy does not allow
        (``authorized``), whose maps (``update_info``, ``init_info``) may be as large as a
        frame. The same Error as after decoding (``on_control``); ``call_id`` reads the
        frame's from its headers. None: decode it."""
        if kind not in CONTROL_MESSAGES or authorized:
            return None
        client = self._clients.get(client_id)
        if client is not None:
            if client.key != key:
                return None  # decoded, then refused as another key's
            client.last_seen = now
            client.fresh = False
        return self._unauthorized(client_id, kind, call_id())

    def gateway_stats(self) -> dict[str, int]:
        """The gateway's own counts, for StatsReply."""
        stats = self.stats
        return {
            "live_requests": self._live_requests,
            "live_samples": self._live_samples,
            "queued_requests": self.queued_requests,
            "connected_clients": len(self._clients),
            "requests_accepted": stats.requests_accepted,
            "output_tokens": stats.output_tokens,
            "aborted_by_client": stats.aborted_by_client,
            "timed_out": stats.timed_out,
            "stop_sequence_hits": stats.stop_sequence_hits,
            "clients_expired": stats.clients_expired,
            "pauses_forgiven": stats.pauses_forgiven,
            "slow_consumers": stats.slow_consumers,
            **self.multimodal_stats(),
        }

    def multimodal_stats(self) -> dict[str, int]:
        """Multimodal items of accepted requests (none without a multimodal model)."""
        store = self.multimodal
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

    def on_protocol_error(self, client_id: bytes, exc: ProtocolError, now: float) -> Effects:
        """A frame from ``client_id`` could not be decoded; answer with its Error."""
        client = self._clients.get(client_id)
        if client is not None:
            client.last_seen = now
            client.fresh = False
        error = Error(exc.request_id, exc.code, exc.message, exc.call_id)
        return Effects(replies=[(client_id, error)])

    def _on_hello(self, client_id: bytes, msg: Hello, now: float) -> Effects:
        if msg.protocol_version != PROTOCOL_VERSION:
            error = Error(
                None,
                ErrorCode.UNSUPPORTED_VERSION,
                f"Hello.protocol_version {msg.protocol_version} is not supported;"
                f" this gateway speaks version {PROTOCOL_VERSION}",
            )
            return Effects(replies=[(client_id, error)])
        if client_id in self._blocked:
            error = Error(
                None,
                ErrorCode.SLOW_CONSUMER,
                "frames owed to this client from its previous session are still undelivered;"
                " read them, then send Hello again",
            )
            return Effects(replies=[(client_id, error)])
        effects = Effects()
        if client_id in self._clients:  # reconnect under the same identity
            self._end_client(client_id, FinishReason.ABORT, effects, now)
        elif self.limits.max_clients and (
            len(self._clients) + len(self._blocked) >= self.limits.max_clients
        ):
            return self._overloaded(
                client_id, "", "max_clients", self.limits.max_clients, len(self._clients)
            )
        limits = self.limits
        interval = msg.heartbeat_interval_s or limits.default_heartbeat_interval_s
        interval = min(
            max(interval, limits.min_heartbeat_interval_s), limits.max_heartbeat_interval_s
        )
        timeout = interval * limits.heartbeat_timeout_factor
        client = _Client(
            client_id,
            msg.client_name,
            interval,
            timeout,
            now,
            rate_tokens=float(limits.request_rate_burst),
            rate_updated=now,
            session_id=next(self._session_ids),
        )
        self._clients[client_id] = client
        effects.replies.append((client_id, self._hello_ack(client)))
        return effects

    def _hello_ack(self, client: _Client) -> HelloAck:
        return HelloAck(
            protocol_version=PROTOCOL_VERSION,
            gateway_version=self._gateway_version,
            model=self.model_info,
            limits=self.wire_limits,
            heartbeat_interval_s=client.heartbeat_interval_s,
            heartbeat_timeout_s=client.heartbeat_timeout_s,
            session_id=client.session_id,
        )

    def _refuse(self, client_id: bytes, request_id: str, code: ErrorCode, message: str) -> Effects:
        return Effects(replies=[(client_id, Error(request_id, code, message))])

    def _on_generate(self, client_id: bytes, msg: Generate, now: float) -> Effects:
        request_id = msg.request_id
        client = self._clients.get(client_id)
        if client is None:
            return self._refuse(
                client_id,
                request_id,
                ErrorCode.HANDSHAKE_REQUIRED,
                _HELLO_FIRST[Generate],
            )
        if request_id in client.requests:
            return self._refuse(
                client_id,
                request_id,
                ErrorCode.DUPLICATE_REQUEST_ID,
                f"request id {request_id!r} is already live for this client; the live"
                " request is unaffected",
            )
        if self.state is not GatewayState.SERVING:
            code = (
                ErrorCode.DRAINING if self.state is GatewayState.DRAINING else ErrorCode.ENGINE_DEAD
            )
            return self._refuse(
                client_id,
                request_id,
                code,
                f"gateway is {self.state.value}; no new requests are accepted",
            )
        limits = self.wire_limits
        rate = self.limits.max_request_rate_per_client
        if not self._take_rate_token(client, now):
            return self._overloaded(
                client_id, request_id, "max_request_rate_per_client", int(rate), int(rate)
            )
        if len(client.requests) >= limits.max_in_flight_per_client:
            return self._overloaded(
                client_id,
                request_id,
                "max_in_flight_per_client",
                limits.max_in_flight_per_client,
                len(client.requests),
            )
        if self._live_requests >= limits.max_in_flight_total:
            return self._overloaded(
                client_id,
                request_id,
                "max_in_flight_total",
                limits.max_in_flight_total,
                self._live_requests,
            )
        queued = self._live_samples - self.info.max_num_seqs
        if queued >= limits.max_queued_requests:
            return self._overloaded(
                client_id, request_id, "max_queued_requests", limits.max_queued_requests, queued
            )
        prompt_tokens = len(msg.prompt_token_ids)
        if prompt_tokens > limits.max_prompt_tokens:
            return self._refuse(
                client_id,
                request_id,
                ErrorCode.INVALID_REQUEST,
                prompt_too_long(prompt_tokens, limits.max_prompt_tokens),
            )
        problem = self._check_gateway_fields(msg)
        if problem is not None:
            return self._refuse(client_id, request_id, ErrorCode.INVALID_REQUEST, problem)
        options = msg.options
        submitted = msg
        if options is not None and options.kv_transfer_params is not None:
            params = None  # an explicit nil
            if kv_params_given(options):
                if not self.kv_transfer_allowed(client.key):
                    return self._refuse(client_id, request_id, ErrorCode.UNAUTHORIZED, KV_REFUSED)
                try:  # decoded only now, the sender known to be allowed them (codec.bounds)
                    params = decode_kv_params(options.kv_transfer_params)
                except ValueError as exc:
                    message = str(exc)
                    return self._refuse(client_id, request_id, ErrorCode.INVALID_REQUEST, message)
            options = msgspec.structs.replace(options, kv_transfer_params=params)
            submitted = msgspec.structs.replace(msg, options=options)
        multimodal_bytes = 0
        if msg.multimodal:
            store = self.multimodal
            if store is None:
                return self._refuse(
                    client_id,
                    request_id,
                    ErrorCode.UNSUPPORTED,
                    f"model {self.info.model_name!r} takes no multimodal items",
                )
            try:
                items = store.resolve(client.session_id, msg.multimodal, prompt_tokens)
            except ItemProblem as exc:
                return self._refuse(client_id, request_id, exc.code, exc.message)
            multimodal_bytes = store.engine_bytes(items)
            refused = self._multimodal_over(client, client_id, request_id, multimodal_bytes)
            if refused is not None:
                return refused
            submitted = msgspec.structs.replace(submitted, multimodal=items)
        if submitted.options is not None and submitted.options.routing_key is not None:
            # Each client's keys are its own: no client can re-point or evict another's.
            # Hex (no ":"), whichever identity: the router reads the owner up to the first
            # ":" (a Z85 CURVE key may hold one: two such keys would share one budget).
            owner = (client.key.encode() if client.key else client_id).hex()
            options = msgspec.structs.replace(
                submitted.options, routing_key=f"{owner}:{submitted.options.routing_key}"
            )
            submitted = msgspec.structs.replace(submitted, options=options)
        resolved = submitted.multimodal  # as the store keeps them for resending by hash
        if self.cache_isolation:
            options = self._isolated(client, submitted.options)
            submitted = msgspec.structs.replace(submitted, options=options)
            if resolved:  # the engine's encoder cache is keyed by the item's id: the tenant's
                tenant = self._tenant(client)
                items = [
                    msgspec.structs.replace(i, hash=isolated_id(tenant, i.hash)) for i in resolved
                ]
                submitted = msgspec.structs.replace(submitted, multimodal=items)
        engine_request_id = f"{self._engine_id_prefix}{next(self._engine_ids)}"
        try:
            prepared = self._prepare(engine_request_id, submitted)
        except RequestRejected as exc:
            return self._refuse(client_id, request_id, exc.code, exc.message)
        except Exception as exc:  # a bug in preparing this one request: fail it alone
            logger.exception("preparing request %r failed", request_id)
            return self._refuse(
                client_id,
                request_id,
                ErrorCode.INTERNAL,
                f"the gateway failed to prepare request {request_id!r}: {exc!r}",
            )
        if msg.multimodal and self.multimodal is not None:
            self.multimodal.remember(client.session_id, msg.multimodal, resolved)
        n = len(prepared)
        samples = [
            _Sample(
                sample_engine_request_id(engine_request_id, i, n),
                i,
                token_ids=None if msg.stream else [],
            )
            for i in range(n)
        ]
        sampling = msg.sampling
        if sampling.stop_token_sequences:
            for sample in samples:
                sample.matcher = StopMatcher(
                    sampling.stop_token_sequences,
                    include=bool(sampling.include_stop_sequence),
                    min_tokens=sampling.min_tokens or 0,
                    hold_back=msg.stream and sampling.hold_back_stop_sequences is not False,
                )
        request = _Request(client_id, request_id, msg.stream, prompt_tokens, samples, n, now, now)
        if multimodal_bytes:
            request.multimodal_bytes = multimodal_bytes
            client.multimodal_bytes += multimodal_bytes
            self._live_multimodal_bytes += multimodal_bytes
        options = msg.options
        if options is not None and (options.deadline_s or options.stall_timeout_s):
            if options.deadline_s:
                request.deadline_at = now + options.deadline_s
            request.stall_timeout_s = options.stall_timeout_s
            self._timed[request] = None
        client.requests[request_id] = request
        for sample in samples:
            self._by_engine_id[sample.engine_request_id] = (request, sample)
        self._live_requests += 1
        self._live_samples += n
        self.stats.requests_accepted += 1
        return Effects(submit=list(prepared))

    @staticmethod
    def _isolated(client: _Client, options: RequestOptions | None) -> RequestOptions:
        """``options`` with the cache salt the gateway enforces under cache isolation: the
        client's CURVE key (its routing id without CURVE), then the client's own salt.
        vLLM hashes the salt into every block, so no other key's request can hit (or
        probe) these blocks. A key is 40 characters and an id hex digits: the ``/`` after
        either ends it, so no client's own salt can pass for another client's."""
        tenant = SessionTable._tenant(client)
        options = options or RequestOptions()
        return msgspec.structs.replace(options, cache_salt=f"{tenant}/{options.cache_salt or ''}")

    @staticmethod
    def _tenant(client: _Client) -> str:
        """Whose cache a client's requests use under cache isolation: its CURVE key (its
        routing id without CURVE)."""
        return f"key:{client.key}" if client.key else f"id:{client.client_id.hex()}"

    def _multimodal_over(
        self, client: _Client, client_id: bytes, request_id: str, nbytes: int
    ) -> Effects | None:
        """Overloaded if ``nbytes`` more tensor bytes would put the client's live requests,
        or all of them, over their bound (bytes the engine holds while they wait)."""
        limits = self.wire_limits
        for limit, value, current in (
            (
                "max_multimodal_bytes_in_flight_per_client",
                limits.max_multimodal_bytes_in_flight_per_client,
                client.multimodal_bytes,
            ),
            (
                "max_multimodal_bytes_in_flight",
                limits.max_multimodal_bytes_in_flight,
                self._live_multimodal_bytes,
            ),
        ):
            if current + nbytes > value:
                return self._overloaded(client_id, request_id, limit, value, current)
        return None

    def _check_gateway_fields(self, msg: Generate) -> str | None:
        """Checks of the fields the gateway (not vLLM) acts on; the problem, or None."""
        sequences = msg.sampling.stop_token_sequences
        if sequences:
            limits = self.wire_limits
            problem = check_stop_sequences(
                sequences,
                self.info.vocab_size,
                limits.max_stop_sequences,
                limits.max_stop_sequence_len,
            )
            if problem is not None:
                return problem
        options = msg.options
        if options is not None:
            for name in ("deadline_s", "stall_timeout_s"):
                value = getattr(options, name)
                if value is not None and not 0 < value < 1e9:  # nan and inf fail too
                    return f"{name} must be a number of seconds above 0, got {value}."
            key = options.routing_key
            if key is not None and len(key) > MAX_ROUTING_KEY_LEN:
                return (
                    f"routing_key must be at most {MAX_ROUTING_KEY_LEN} characters, got {len(key)}."
                )
        return None

    def _overloaded(
        self, client_id: bytes, request_id: str, limit: str, value: int, current: int
    ) -> Effects:
        self.stats.overloaded[limit] += 1
        message = f"{limit} is {value} and the current load is {current}; retry later"
        return Effects(
            replies=[(client_id, Overloaded(request_id, limit, value, current, message))]
        )

    def _on_abort(self, client_id: bytes, msg: Abort, now: float) -> Effects:
        client = self._clients.get(client_id)
        if client is None:
            error = Error(None, ErrorCode.HANDSHAKE_REQUIRED, _HELLO_FIRST[Abort], msg.call_id)
            return Effects(replies=[(client_id, error)])
        ids = list(client.requests) if msg.request_ids is None else msg.request_ids
        if len(ids) > self.wire_limits.max_abort_ids:
            error = Error(
                None,
                ErrorCode.INVALID_MESSAGE,
                f"Abort.request_ids has {len(ids)} ids; the limit is"
                f" {self.wire_limits.max_abort_ids}",
                msg.call_id,
            )
            return Effects(replies=[(client_id, error)])
        effects = Effects()
        aborted: list[_Request] = []
        unknown: list[str] = []
        for request_id in dict.fromkeys(ids):  # de-duplicated, in order
            request = client.requests.get(request_id)
            if request is None:
                unknown.append(request_id)
            else:
                aborted.append(request)
        self.stats.aborted_by_client += len(aborted)
        self._end_requests(aborted, FinishReason.ABORT, effects, now=now)
        ack = AbortAck([r.request_id for r in aborted], unknown, msg.call_id)
        effects.replies.append((client_id, ack))
        return effects

    def _on_abort_samples(self, client_id: bytes, msg: AbortSamples, now: float) -> Effects:
        """Some samples of one request (a client that ended them itself, on a text stop
        string): those still live end with ABORT; the others run on."""
        client = self._clients.get(client_id)
        if client is None:
            error = Error(
                None, ErrorCode.HANDSHAKE_REQUIRED, _HELLO_FIRST[AbortSamples], msg.call_id
            )
            return Effects(replies=[(client_id, error)])
        request = client.requests.get(msg.request_id)
        effects = Effects()
        indices = set(msg.samples)
        if request is not None and any(
            not sample.done and sample.index in indices for sample in request.samples
        ):
            self.stats.aborted_by_client += 1
            self._end_requests([request], FinishReason.ABORT, effects, now=now, samples=indices)
            ack = AbortAck([msg.request_id], [], msg.call_id)
        else:
            ack = AbortAck([], [msg.request_id], msg.call_id)
        effects.replies.append((client_id, ack))
        return effects

    def _on_ping(self, client_id: bytes, msg: Ping, now: float) -> Effects:
        client = self._clients.get(client_id)
        session_id = 0 if client is None else client.session_id
        return Effects(replies=[(client_id, Pong(msg.nonce, session_id))])

    def _on_get_model_info(self, client_id: bytes, msg: GetModelInfo, now: float) -> Effects:
        reply = ModelInfoReply(msg.call_id, self.model_info, self.wire_limits)
        return Effects(replies=[(client_id, reply)])

    def _on_get_health(self, client_id: bytes, msg: GetHealth, now: float) -> Effects:
        reply = HealthReply(
            call_id=msg.call_id,
            ready=self.state is GatewayState.SERVING,
            state=self.state.value,
            live_requests=self._live_requests,
            connected_clients=len(self._clients),
            paused=self.paused,
            engines=self._engine_load(),
        )
        return Effects(replies=[(client_id, reply)])

    def _take_rate_token(self, client: _Client, now: float) -> bool:
        """One of the client's request-rate tokens (Generate and PrefixQuery share them);
        False when it has none left (``max_request_rate_per_client``)."""
        rate = self.limits.max_request_rate_per_client
        if rate <= 0:
            return True
        burst = self.limits.request_rate_burst
        client.rate_tokens = min(burst, client.rate_tokens + (now - client.rate_updated) * rate)
        client.rate_updated = now
        if client.rate_tokens < 1.0:
            return False
        client.rate_tokens -= 1.0
        return True

    def _on_prefix_query(self, client_id: bytes, msg: PrefixQuery, now: float) -> Effects:
        prompt, call_id = msg.prompt_token_ids, msg.call_id
        limit = self.wire_limits.max_prompt_tokens
        if self._prefix_query is None:
            error = Error(None, ErrorCode.UNSUPPORTED, "this gateway has no engine", call_id)
            return Effects(replies=[(client_id, error)])
        client = self._clients.get(client_id)
        if client is None:  # each query hashes the whole prompt: no work for strangers
            error = Error(None, ErrorCode.HANDSHAKE_REQUIRED, _HELLO_FIRST[PrefixQuery], call_id)
            return Effects(replies=[(client_id, error)])
        if not self._take_rate_token(client, now):
            rate = self.limits.max_request_rate_per_client
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
        if self.cache_isolation:
            options = self._isolated(client, options)
        try:
            matched, block_size, policy = self._prefix_query(prompt, options)
        except RequestRejected as exc:
            return Effects(replies=[(client_id, Error(None, exc.code, exc.message, call_id))])
        reply = PrefixReply(call_id, block_size, matched, policy)
        return Effects(replies=[(client_id, reply)])

    # ------------------------------------------------------------ engine side

    def on_step(
        self, outputs: Sequence[StepOutput], now: float, weight_version: str | None = None
    ) -> Effects:
        """One engine step: at most one Outputs frame per client, and the engine ids to
        abort (samples a stop sequence ended)."""
        effects = Effects()
        per_client: dict[bytes, list[RequestOutput]] = {}
        by_engine_id = self._by_engine_id
        plain_tokens = 0
        for out in outputs:
            entry = by_engine_id.get(out.request_id)
            if entry is None:  # aborted or timed out already: its terminal was sent
                self.stats.late_outputs += 1
                continue
            request, sample = entry
            new_token_ids = out.new_token_ids
            if (
                # The common case, inline (it is most of the gateway's work per token):
                # streamed tokens mid-sample, nothing else to note or to hold back.
                new_token_ids
                and out.finish_reason is None
                and request.stream
                and sample.matcher is None
                and sample.first_token_at is not None
                and (weight_version is None or weight_version == sample.sent_version)
                and sample.version == sample.sent_version
                and out.new_logprobs is None
                and out.new_prompt_logprobs_tensors is None
                and out.prefill_stats is None
                and not out.events
            ):
                request.last_output_at = now
                sample.output_tokens += len(new_token_ids)
                plain_tokens += len(new_token_ids)
                reply = RequestOutput(request.request_id, new_token_ids, index=sample.index)
            else:
                reply = self._on_sample_output(
                    request, sample, out, now, effects.abort, weight_version
                )
            if reply is not None:
                bucket = per_client.get(request.client_id)
                if bucket is None:
                    per_client[request.client_id] = [reply]
                else:
                    bucket.append(reply)
        self.stats.output_tokens += plain_tokens
        effects.replies = [(client_id, Outputs(batch)) for client_id, batch in per_client.items()]
        return effects

    def _on_sample_output(
        self,
        request: _Request,
        sample: _Sample,
        out: StepOutput,
        now: float,
        abort: list[str],
        weight_version: str | None = None,
    ) -> RequestOutput | None:
        new_token_ids = out.new_token_ids
        new_logprobs = out.new_logprobs
        if new_token_ids:
            request.last_output_at = now
            if sample.first_token_at is None:
                sample.first_token_at = now
            if weight_version is not None and weight_version != sample.version:
                # Tokens produced before this output: sent (or cut) plus held back.
                produced = sample.output_tokens + len(sample.held_ids)
                sample.versions.append((weight_version, produced))
                sample.version = weight_version
        stats = out.prefill_stats
        if stats is not None:
            sample.cached_tokens = stats.num_cached_tokens
            sample.external_cached_tokens = stats.num_external_cached_tokens
        events = out.events
        if events:
            _note_events(sample, events)
        reason = out.finish_reason
        stop = out.stop_reason
        stop_reason = stop if isinstance(stop, int) else None
        cut_to = None
        matcher = sample.matcher
        if matcher is not None:
            check = matcher.feed(
                new_token_ids, engine_stopped=reason == FinishReason.STOP, final=reason is not None
            )
            if sample.held_ids:
                new_token_ids = sample.held_ids + new_token_ids
                new_logprobs = Logprobs.concat(sample.held_logprobs, new_logprobs)
            release = check.release
            held_ids, held_logprobs = new_token_ids[release:], Logprobs.rows(new_logprobs, release)
            new_token_ids = new_token_ids[:release]
            new_logprobs = Logprobs.rows(new_logprobs, 0, release)
            if check.matched is not None:
                if reason is None:
                    abort.append(sample.engine_request_id)  # the engine would go on
                reason = FinishReason.STOP
                stop_reason = matcher.sequences[check.matched]
                cut_to = check.kept
                self.stats.stop_sequence_hits += 1
                sample.held_ids, sample.held_logprobs = [], None
            else:
                sample.held_ids, sample.held_logprobs = held_ids, held_logprobs
        sample.output_tokens += len(new_token_ids)
        self.stats.output_tokens += len(new_token_ids)
        finished = None
        if reason is not None:
            if cut_to is not None:
                sample.output_tokens = cut_to
            self.stats.finished[FinishReason(reason).name] += 1
            finished = self._finished(
                request, sample, FinishReason(reason), stop_reason, now, out.kv_transfer_params
            )
        if request.stream:
            if finished is not None:
                self._retire(request, sample)
            elif not new_token_ids and out.new_prompt_logprobs_tensors is None:
                return None  # every new token held back (a new version is told later)
            return RequestOutput(
                request.request_id,
                new_token_ids,
                finished,
                new_logprobs,
                out.new_prompt_logprobs_tensors,
                sample.index,
                _version_news(sample) if new_token_ids else None,
            )
        sample.token_ids.extend(new_token_ids)
        sample.logprobs = Logprobs.concat(sample.logprobs, new_logprobs)
        sample.prompt_logprobs = Logprobs.concat(
            sample.prompt_logprobs, out.new_prompt_logprobs_tensors
        )
        if finished is None:
            return None
        if cut_to is not None and len(sample.token_ids) > cut_to:
            del sample.token_ids[cut_to:]
            sample.logprobs = Logprobs.rows(sample.logprobs, 0, cut_to)
        self._retire(request, sample)
        return self._final_output(request, sample, finished)

    def _finished(
        self,
        request: _Request,
        sample: _Sample,
        reason: FinishReason,
        stop_reason: int | list[int] | None,
        now: float,
        kv_transfer_params: dict | None = None,
    ) -> Finished:
        def since(t: float | None) -> float | None:
            return None if t is None else t - request.accepted_at

        timings = RequestTimings(
            since(sample.queued_at),
            since(sample.scheduled_at),
            since(sample.first_token_at),
            now - request.accepted_at,
        )
        return Finished(
            reason,
            stop_reason,
            request.prompt_tokens,
            sample.output_tokens,
            sample.cached_tokens,
            kv_transfer_params,
            sample.external_cached_tokens,
            timings,
            _spans(sample.versions, sample.output_tokens) if sample.versions else None,
        )

    @staticmethod
    def _final_output(request: _Request, sample: _Sample, finished: Finished) -> RequestOutput:
        """A non-streaming sample's one output: its tokens, named with the version of the
        last of them (Finished.weight_versions has every span)."""
        return RequestOutput(
            request.request_id,
            sample.token_ids if sample.token_ids is not None else [],
            finished,
            sample.logprobs,
            sample.prompt_logprobs,
            sample.index,
            _version_of_tokens(sample, len(sample.token_ids)) if sample.token_ids else None,
        )

    def _retire(self, request: _Request, sample: _Sample) -> None:
        """Mark one sample terminal; drop the request when it was the last."""
        sample.done = True
        del self._by_engine_id[sample.engine_request_id]
        request.live_samples -= 1
        self._live_samples -= 1
        if request.live_samples == 0:
            client = self._clients.get(request.client_id)
            if client is not None and client.requests.get(request.request_id) is request:
                del client.requests[request.request_id]
                client.multimodal_bytes -= request.multimodal_bytes
            self._live_requests -= 1
            self._live_multimodal_bytes -= request.multimodal_bytes
            if request.deadline_at is not None or request.stall_timeout_s is not None:
                self._timed.pop(request, None)

    def _end_requests(
        self,
        requests: Sequence[_Request],
        ending: FinishReason | tuple[ErrorCode, str],
        effects: Effects,
        *,
        now: float,
        tell_engine: bool = True,
        samples: set[int] | None = None,
    ) -> None:
        """End every live sample of ``requests`` now (only those of index in ``samples``,
        when given): the one way requests end early.

        ``ending`` is a FinishReason (each live sample gets a terminal
        RequestOutput with its tokens so far, one Outputs frame per client) or
        ``(code, message)`` (one terminal Error per request). The engine is told
        to stop every sample that was still live, unless ``tell_engine`` is off.
        Streamed tokens held back for stop sequences go out with the terminal.
        """
        terminals: dict[bytes, list[RequestOutput]] = {}
        for request in requests:
            live = [
                sample
                for sample in request.samples
                if not sample.done and (samples is None or sample.index in samples)
            ]
            if not live:
                continue
            for sample in live:
                if tell_engine:
                    effects.abort.append(sample.engine_request_id)
                self._retire(request, sample)
            if isinstance(ending, tuple):
                code, message = ending
                effects.replies.append(
                    (request.client_id, Error(request.request_id, code, message))
                )
                continue
            self.stats.finished[ending.name] += len(live)
            bucket = terminals.setdefault(request.client_id, [])
            for sample in live:
                held, held_logprobs = sample.held_ids, sample.held_logprobs
                if sample.matcher is not None:
                    sample.matcher.flush()
                    sample.output_tokens += len(held)
                    self.stats.output_tokens += len(held)
                    sample.held_ids, sample.held_logprobs = [], None
                finished = self._finished(request, sample, ending, None, now)
                if request.stream:
                    bucket.append(
                        RequestOutput(
                            request.request_id,
                            held,
                            finished,
                            held_logprobs,
                            None,
                            sample.index,
                            _version_news(sample) if held else None,
                        )
                    )
                else:
                    bucket.append(self._final_output(request, sample, finished))
        for client_id, outputs in terminals.items():
            effects.replies.append((client_id, Outputs(outputs)))

    def _end_client(
        self,
        client_id: bytes,
        ending: FinishReason | tuple[ErrorCode, str],
        effects: Effects,
        now: float,
    ) -> None:
        """End every live request of a client and forget its session."""
        client = self._clients.pop(client_id)
        if self.multimodal is not None:
            self.multimodal.drop_session(client.session_id)
        self._end_requests(list(client.requests.values()), ending, effects, now=now)

    def _all_requests(self) -> list[_Request]:
        return [r for client in self._clients.values() for r in client.requests.values()]

    # ------------------------------------------------------------ lifecycle

    def forgive(self, paused_s: float, now: float) -> None:
        """This process did not run for ``paused_s`` (a host pause, CPU throttling, a held
        event loop): its clients could not be heard meanwhile, so their heartbeat clocks
        skip that time instead of ``expire`` ending every session at once."""
        self.stats.pauses_forgiven += 1
        for client in self._clients.values():
            client.last_seen = min(client.last_seen + paused_s, now)

    def expire(self, now: float) -> Effects:
        """Abort the requests of clients silent past their heartbeat timeout; end requests
        past their deadline_s or stall_timeout_s with TIMED_OUT."""
        effects = Effects()
        for client in list(self._clients.values()):
            if now - client.last_seen > client.heartbeat_timeout_s:
                self.stats.clients_expired += 1
                # An Error, not an ABORT output: a client whose loop was held past the
                # timeout reads these first, and must learn that the session ended.
                silent = now - client.last_seen
                message = (
                    f"the session expired: nothing was heard from this client for {silent:.1f}s"
                    f" (heartbeat timeout {client.heartbeat_timeout_s:.1f}s); the request was"
                    " aborted; send Hello again and retry it"
                )
                self._end_client(
                    client.client_id, (ErrorCode.SESSION_EXPIRED, message), effects, now
                )
        if self._timed:
            late = [
                request
                for request in self._timed
                if (request.deadline_at is not None and now >= request.deadline_at)
                or (
                    request.stall_timeout_s is not None
                    and now - request.last_output_at >= request.stall_timeout_s
                )
            ]
            if late:
                self.stats.timed_out += len(late)
                self._end_requests(late, FinishReason.TIMED_OUT, effects, now=now)
        return effects

    def on_client_gone(self, client_id: bytes, now: float) -> Effects:
        """The transport says ``client_id`` is unreachable: end its session now."""
        effects = Effects()
        self._blocked.discard(client_id)
        if client_id in self._clients:
            self._end_client(client_id, FinishReason.ABORT, effects, now)
        return effects

    def on_send_blocked(self, client_id: bytes, now: float) -> Effects:
        """The server could not queue a frame for ``client_id``: it stopped reading.

        Its live requests end with one Error(SLOW_CONSUMER) each and its session
        is forgotten. The server must deliver every frame it already holds for
        the client, then these replies, in order; until it reports
        ``on_send_unblocked`` the client may not open a new session.
        """
        effects = Effects()
        if client_id in self._blocked:
            return effects
        self._blocked.add(client_id)
        client = self._clients.get(client_id)
        if client is None:
            return effects
        self.stats.slow_consumers += 1
        message = (
            f"client did not read its outputs ({self.wire_limits.client_send_hwm} frames"
            " queued): its requests were ended and its session closed; every frame sent"
            " before this one is still delivered, in order; send Hello again after reading them"
        )
        self._end_client(client_id, (ErrorCode.SLOW_CONSUMER, message), effects, now)
        return effects

    def on_send_unblocked(self, client_id: bytes) -> None:
        """Every frame owed to a slow consumer was delivered: it may say Hello again."""
        self._blocked.discard(client_id)

    def on_submit_failed(self, engine_request_id: str, message: str, now: float) -> Effects:
        """Submitting one sample to a live engine failed: end its request with INTERNAL."""
        effects = Effects()
        entry = self._by_engine_id.get(engine_request_id)
        if entry is not None:
            request, _ = entry
            self._end_requests([request], (ErrorCode.INTERNAL, message), effects, now=now)
        return effects

    @property
    def queued_requests(self) -> int:
        """Samples beyond what the engine can run at once (an estimate of its queue)."""
        return max(0, self._live_samples - self.info.max_num_seqs)

    def on_engine_dead(self, message: str, now: float) -> Effects:
        """The engine failed: every live request ends with ENGINE_DEAD; refuse new ones."""
        self.state = GatewayState.ENGINE_DEAD
        effects = Effects()
        ending = (ErrorCode.ENGINE_DEAD, message)
        self._end_requests(self._all_requests(), ending, effects, now=now, tell_engine=False)
        return effects

    def start_drain(self) -> None:
        """Refuse new requests from now on; live ones run on."""
        if self.state is GatewayState.SERVING:
            self.state = GatewayState.DRAINING

    def abort_all(self, now: float) -> Effects:
        """End every live request now with ABORT (drain deadline, shutdown)."""
        effects = Effects()
        self._end_requests(self._all_requests(), FinishReason.ABORT, effects, now=now)
        return effects

    def fail_all(self, code: ErrorCode, message: str, now: float) -> Effects:
        """End every live request now with one Error(``code``) each; the engine aborts them."""
        effects = Effects()
        self._end_requests(self._all_requests(), (code, message), effects, now=now)
        return effects

    def has_session(self, client_id: bytes) -> bool:
        """Whether ``client_id`` has a session now (Hello, not yet ended or expired)."""
        return client_id in self._clients


def _version_news(sample: _Sample) -> str | None:
    """The weight version to name on an output of ``sample`` that carries tokens: the
    version of its last token when the client has not been told it yet, else None
    (unchanged). Not always the latest: a stop sequence may cut the tokens of a newer one."""
    version = _version_of_tokens(sample, sample.output_tokens)
    if version == sample.sent_version:
        return None
    sample.sent_version = version
    return version


def _version_of_tokens(sample: _Sample, count: int) -> str | None:
    """The version of the last of ``sample``'s first ``count`` tokens (None: not known)."""
    version = None
    for name, first in sample.versions:
        if first >= count:
            break
        version = name
    return version


def _spans(starts: list[tuple[str, int]], output_tokens: int) -> list[WeightVersionSpan]:
    """Spans from where each version began, covering the first ``output_tokens`` tokens
    (after any stop-sequence cut)."""
    ends = [first for _, first in starts[1:]] + [output_tokens]
    return [
        WeightVersionSpan(version, first, min(end, output_tokens) - first)
        for (version, first), end in zip(starts, ends, strict=True)
        if first < output_tokens
    ]


def _note_events(sample: _Sample, events: Sequence) -> None:
    """The engine's QUEUED (1) and first SCHEDULED (2) event times (vLLM EngineCoreEvent)."""
    for event in events:
        kind = int(event.type)
        if kind == 1 and sample.queued_at is None:
            sample.queued_at = event.timestamp
        elif kind == 2 and sample.scheduled_at is None:
            sample.scheduled_at = event.timestamp


MAX_WEIGHT_VERSION_CHARS = 256  # it rides on outputs and in every Finished.weight_versions


def _control_problem(msg: ClientMessage) -> str | None:
    """What is wrong with a control call's fields (INVALID_MESSAGE), or None."""
    if isinstance(msg, Pause) and msg.mode not in ("abort", "wait", "keep"):
        return f"Pause.mode must be 'abort', 'wait' or 'keep', got {msg.mode!r}"
    if isinstance(msg, StartWeightUpdate) and msg.pause not in (None, "abort", "wait", "keep"):
        return f"StartWeightUpdate.pause must be 'abort', 'wait', 'keep' or nil, got {msg.pause!r}"
    versioned = (ReloadWeights, SetWeightVersion, FinishWeightUpdate)
    version = msg.version if isinstance(msg, versioned) else None
    if version is not None and not 1 <= len(version) <= MAX_WEIGHT_VERSION_CHARS:
        return (
            f"{type(msg).__name__}.version must be 1 to {MAX_WEIGHT_VERSION_CHARS} characters,"
            f" got {len(version)}"
        )
    return None
