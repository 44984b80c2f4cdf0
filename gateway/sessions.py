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
- Every way a request ends (engine finish aside) goes through ``end_requests``,
  which takes the samples to end and why; callers only choose which and why.

The table owns the state (session_model.py: clients, requests, samples, counts) and is the
one entry point; each concern beyond the sessions themselves is a room the table calls:
admission.py (every check a Generate meets before it is accepted, in the documented order
of refusals), request_outputs.py (engine steps to each client's outputs and terminals, and
ending requests early), session_queries.py (model info, health, PrefixQuery, counts) and
limits.py (the limits and what HelloAck says of them).
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
from collections.abc import Callable, Sequence
from typing import Any

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
    FinishReason,
    FinishWeightUpdate,
    Generate,
    GetHealth,
    GetModelInfo,
    Goodbye,
    Hello,
    HelloAck,
    Pause,
    Ping,
    Pong,
    PrefixQuery,
    ProtocolError,
    ReloadWeights,
    RequestOptions,
    SetWeightVersion,
    StartWeightUpdate,
    wire_type,
)

from . import request_outputs, session_queries
from .admission import Candidate, admit, overloaded, refuse
from .engine import EngineInfo, PreparedRequest, StepOutput, sample_engine_request_id
from .errors import RequestRejected
from .limits import GatewayLimits, frame_limit_for, model_info, wire_limits
from .multimodal_store import MultimodalStore
from .request_outputs import end_requests
from .session_model import Client, Effects, GatewayState, Reply, Request, Sample, TableStats
from .stop_sequences import StopMatcher

__all__ = [
    "GatewayLimits",
    "GatewayState",
    "Effects",
    "SessionTable",
    "Reply",
    "TableStats",
    "frame_limit_for",
]

logger = logging.getLogger("engine_gateway")

# PrefixQuery: (prompt ids, options) -> (matched tokens per rank, block size, policy).
PrefixQueryFn = Callable[[list[int], RequestOptions | None], tuple[list[int | None], int, str]]

# What a message that needs a session is told without one (HANDSHAKE_REQUIRED).
_HELLO_FIRST = {
    Generate: "send Hello before Generate (or again after a heartbeat timeout)",
    Abort: "send Hello before Abort",
    AbortSamples: "send Hello before AbortSamples",
    PrefixQuery: session_queries.PREFIX_QUERY_HELLO_FIRST,
    **{kind: "send Hello before control calls" for kind in CONTROL_MESSAGES},
}


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
        ``cache_isolation``: each client's prefix cache is its own (admission.rewrite).
        ``kv_transfer_allowed``: whether a session's CURVE key (None without CURVE) may send
        ``kv_transfer_params`` (the server's control policy; default: nobody)."""
        self.cache_isolation = cache_isolation
        self.kv_transfer_allowed = kv_transfer_allowed
        self.info = info
        self.engine_load = engine_load or list
        self._prefix_query = prefix_query
        self.limits = limits
        self.state = GatewayState.SERVING
        self.paused = False  # the engine's scheduler, by Pause until Resume
        self._prepare = prepare
        # Session ids: from a random start, so that a restarted gateway's differ.
        self._session_ids = itertools.count(secrets.randbits(62) + 1)
        self._gateway_version = gateway_version
        self._clients: dict[bytes, Client] = {}
        # Slow consumers whose owed frames are not delivered yet: no new session.
        self._blocked: set[bytes] = set()
        self._engine_ids = itertools.count(1)
        self._engine_id_prefix = engine_id_prefix
        self.by_engine_id: dict[str, tuple[Request, Sample]] = {}
        self.live_requests = 0
        self.live_multimodal_bytes = 0  # of every live request (Request.multimodal_bytes)
        self.live_samples = 0
        # Requests with a deadline or stall timeout, in acceptance order (a dict as an
        # ordered set: Request hashes by identity).
        self._timed: dict[Request, None] = {}
        self.stats = TableStats()
        self.model_info = model_info(info)
        # Items held for resending by hash, and the model-free item checks.
        self.multimodal = _multimodal_store(limits, info)
        self.wire_limits = wire_limits(limits, info, self.multimodal is not None)
        self._handlers = self._message_handlers()

    def _message_handlers(self) -> dict[type, Callable[[bytes, Any, float], Effects]]:
        """Each client message's handler (on_message), by wire type."""
        return {
            Hello: self._on_hello,
            Generate: self._on_generate,
            Abort: self._on_abort,
            AbortSamples: self._on_abort_samples,
            Ping: self._on_ping,
            GetModelInfo: self._on_get_model_info,
            GetHealth: self._on_get_health,
            PrefixQuery: self._on_prefix_query,
            Goodbye: self._on_goodbye,
            # Control calls reach on_control (authorized or not) from the server; sent
            # through on_message they are refused.
            **{kind: self._on_unauthorized_control for kind in CONTROL_MESSAGES},
        }

    # ------------------------------------------------------------ queries

    @property
    def connected_clients(self) -> int:
        return len(self._clients)

    @property
    def prefix_query_fn(self) -> PrefixQueryFn | None:
        """The engine's answer to PrefixQuery (None: this gateway has no engine)."""
        return self._prefix_query

    def client(self, client_id: bytes) -> Client | None:
        """``client_id``'s session, if it has one."""
        return self._clients.get(client_id)

    def live_engine_request_ids(self) -> list[str]:
        return [eid for eid, (_, s) in self.by_engine_id.items() if not s.done]

    def is_live(self, engine_request_id: str) -> bool:
        """Whether a sample with this engine id is live in the table."""
        return engine_request_id in self.by_engine_id

    def client_request_ids(self, client_id: bytes) -> list[str]:
        client = self._clients.get(client_id)
        return [] if client is None else list(client.requests)

    def gateway_stats(self) -> dict[str, int]:
        """The gateway's own counts, for StatsReply."""
        return session_queries.gateway_stats(self)

    def multimodal_stats(self) -> dict[str, int]:
        """Multimodal items of accepted requests (none without a multimodal model)."""
        return session_queries.multimodal_stats(self)

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
            end_requests(self, self._all_requests(), FinishReason.ABORT, effects, now=now)
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
            return overloaded(
                self, client_id, "", "max_clients", self.limits.max_clients, len(self._clients)
            )
        limits = self.limits
        interval = msg.heartbeat_interval_s or limits.default_heartbeat_interval_s
        interval = min(
            max(interval, limits.min_heartbeat_interval_s), limits.max_heartbeat_interval_s
        )
        timeout = interval * limits.heartbeat_timeout_factor
        client = Client(
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

    def _hello_ack(self, client: Client) -> HelloAck:
        return HelloAck(
            protocol_version=PROTOCOL_VERSION,
            gateway_version=self._gateway_version,
            model=self.model_info,
            limits=self.wire_limits,
            heartbeat_interval_s=client.heartbeat_interval_s,
            heartbeat_timeout_s=client.heartbeat_timeout_s,
            session_id=client.session_id,
        )

    def _on_generate(self, client_id: bytes, msg: Generate, now: float) -> Effects:
        client = self._clients.get(client_id)
        if client is None:
            code = ErrorCode.HANDSHAKE_REQUIRED
            return refuse(client_id, msg.request_id, code, _HELLO_FIRST[Generate])
        admitted = admit(self, client, client_id, msg, now)
        if isinstance(admitted, Effects):
            return admitted
        engine_request_id = f"{self._engine_id_prefix}{next(self._engine_ids)}"
        try:
            prepared = self._prepare(engine_request_id, admitted.submitted)
        except RequestRejected as exc:
            return refuse(client_id, msg.request_id, exc.code, exc.message)
        except Exception as exc:  # a bug in preparing this one request: fail it alone
            logger.exception("preparing request %r failed", msg.request_id)
            message = f"the gateway failed to prepare request {msg.request_id!r}: {exc!r}"
            return refuse(client_id, msg.request_id, ErrorCode.INTERNAL, message)
        if msg.multimodal and self.multimodal is not None:
            self.multimodal.remember(client.session_id, msg.multimodal, admitted.resolved)
        self._accept(admitted, engine_request_id, len(prepared))
        return Effects(submit=list(prepared))

    def _accept(self, admitted: Candidate, engine_request_id: str, n: int) -> None:
        """The request is live: in the table, with its ``n`` samples (one engine request
        each), their stop-sequence matchers, its timeouts and its bytes in flight."""
        client, msg, now = admitted.client, admitted.msg, admitted.now
        samples = [Sample(sample_engine_request_id(engine_request_id, i, n), i) for i in range(n)]
        sampling = msg.sampling
        for sample in samples:
            sample.token_ids = None if msg.stream else []
            if sampling.stop_token_sequences:
                sample.matcher = StopMatcher(
                    sampling.stop_token_sequences,
                    include=bool(sampling.include_stop_sequence),
                    min_tokens=sampling.min_tokens or 0,
                    hold_back=msg.stream and sampling.hold_back_stop_sequences is not False,
                )
        request = Request(
            admitted.client_id, msg.request_id, msg.stream, len(msg.prompt_token_ids), samples,
            n, now, now, multimodal_bytes=admitted.multimodal_bytes,
        )  # fmt: skip
        client.multimodal_bytes += admitted.multimodal_bytes
        self.live_multimodal_bytes += admitted.multimodal_bytes
        options = msg.options
        if options is not None and (options.deadline_s or options.stall_timeout_s):
            if options.deadline_s:
                request.deadline_at = now + options.deadline_s
            request.stall_timeout_s = options.stall_timeout_s
            self._timed[request] = None
        client.requests[msg.request_id] = request
        for sample in samples:
            self.by_engine_id[sample.engine_request_id] = (request, sample)
        self.live_requests += 1
        self.live_samples += n
        self.stats.requests_accepted += 1

    def _on_abort(self, client_id: bytes, msg: Abort, now: float) -> Effects:
        client = self._clients.get(client_id)
        if client is None:
            error = Error(None, ErrorCode.HANDSHAKE_REQUIRED, _HELLO_FIRST[Abort], msg.call_id)
            return Effects(replies=[(client_id, error)])
        # The bound is on the list the client sent; nil aborts every live request, however many.
        if msg.request_ids is not None and len(msg.request_ids) > self.wire_limits.max_abort_ids:
            error = Error(
                None,
                ErrorCode.INVALID_MESSAGE,
                f"Abort.request_ids has {len(msg.request_ids)} ids; the limit is"
                f" {self.wire_limits.max_abort_ids}",
                msg.call_id,
            )
            return Effects(replies=[(client_id, error)])
        ids = list(client.requests) if msg.request_ids is None else msg.request_ids
        effects = Effects()
        aborted: list[Request] = []
        unknown: list[str] = []
        for request_id in dict.fromkeys(ids):  # de-duplicated, in order
            request = client.requests.get(request_id)
            if request is None:
                unknown.append(request_id)
            else:
                aborted.append(request)
        self.stats.aborted_by_client += len(aborted)
        end_requests(self, aborted, FinishReason.ABORT, effects, now=now)
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
            end_requests(self, [request], FinishReason.ABORT, effects, now=now, samples=indices)
            ack = AbortAck([msg.request_id], [], msg.call_id)
        else:
            ack = AbortAck([], [msg.request_id], msg.call_id)
        effects.replies.append((client_id, ack))
        return effects

    def _on_ping(self, client_id: bytes, msg: Ping, now: float) -> Effects:
        client = self._clients.get(client_id)
        session_id = 0 if client is None else client.session_id
        return Effects(replies=[(client_id, Pong(msg.nonce, session_id))])

    def _on_goodbye(self, client_id: bytes, msg: Goodbye, now: float) -> Effects:
        """The client closes: its session ends now, as at a disconnect (live requests
        abort in the engine), counted as left, not expired. Nothing is answered."""
        effects = Effects()
        if client_id in self._clients:
            self.stats.clients_left += 1
            self._end_client(client_id, FinishReason.ABORT, effects, now)
        return effects

    def _on_get_model_info(self, client_id: bytes, msg: GetModelInfo, now: float) -> Effects:
        return session_queries.get_model_info(self, client_id, msg)

    def _on_get_health(self, client_id: bytes, msg: GetHealth, now: float) -> Effects:
        return session_queries.get_health(self, client_id, msg)

    def _on_prefix_query(self, client_id: bytes, msg: PrefixQuery, now: float) -> Effects:
        return session_queries.prefix_query(self, client_id, msg, now)

    # ------------------------------------------------------------ engine side

    def on_step(
        self, outputs: Sequence[StepOutput], now: float, weight_version: str | None = None
    ) -> Effects:
        """One engine step: at most one Outputs frame per client, and the engine ids to
        abort (samples a stop sequence ended): gateway/request_outputs.py."""
        return request_outputs.on_step(self, outputs, now, weight_version)

    def retire(self, request: Request, sample: Sample) -> None:
        """Mark one sample terminal; drop the request when it was the last."""
        sample.done = True
        del self.by_engine_id[sample.engine_request_id]
        request.live_samples -= 1
        self.live_samples -= 1
        if request.live_samples == 0:
            client = self._clients.get(request.client_id)
            if client is not None and client.requests.get(request.request_id) is request:
                del client.requests[request.request_id]
                client.multimodal_bytes -= request.multimodal_bytes
            self.live_requests -= 1
            self.live_multimodal_bytes -= request.multimodal_bytes
            if request.deadline_at is not None or request.stall_timeout_s is not None:
                self._timed.pop(request, None)

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
        end_requests(self, list(client.requests.values()), ending, effects, now=now)

    def _all_requests(self) -> list[Request]:
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
                end_requests(self, late, FinishReason.TIMED_OUT, effects, now=now)
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
        entry = self.by_engine_id.get(engine_request_id)
        if entry is not None:
            request, _ = entry
            end_requests(self, [request], (ErrorCode.INTERNAL, message), effects, now=now)
        return effects

    @property
    def queued_requests(self) -> int:
        """Samples beyond what the engine can run at once (an estimate of its queue)."""
        return max(0, self.live_samples - self.info.max_num_seqs)

    def on_engine_dead(self, message: str, now: float) -> Effects:
        """The engine failed: every live request ends with ENGINE_DEAD; refuse new ones."""
        self.state = GatewayState.ENGINE_DEAD
        effects = Effects()
        ending = (ErrorCode.ENGINE_DEAD, message)
        end_requests(self, self._all_requests(), ending, effects, now=now, tell_engine=False)
        return effects

    def start_drain(self) -> None:
        """Refuse new requests from now on; live ones run on."""
        if self.state is GatewayState.SERVING:
            self.state = GatewayState.DRAINING

    def abort_all(self, now: float) -> Effects:
        """End every live request now with ABORT (drain deadline, shutdown)."""
        effects = Effects()
        end_requests(self, self._all_requests(), FinishReason.ABORT, effects, now=now)
        return effects

    def fail_all(self, code: ErrorCode, message: str, now: float) -> Effects:
        """End every live request now with one Error(``code``) each; the engine aborts them."""
        effects = Effects()
        end_requests(self, self._all_requests(), (code, message), effects, now=now)
        return effects

    def has_session(self, client_id: bytes) -> bool:
        """Whether ``client_id`` has a session now (Hello, not yet ended or expired)."""
        return client_id in self._clients


def _multimodal_store(limits: GatewayLimits, info: EngineInfo) -> MultimodalStore | None:
    """The items held for resending by hash, for a model that takes items."""
    if not info.modalities:
        return None
    return MultimodalStore(
        limits.multimodal_cache_bytes,
        limits.max_multimodal_items,
        limits.max_multimodal_item_bytes,
        limits.max_multimodal_request_bytes,
        info.multimodal,
    )


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
