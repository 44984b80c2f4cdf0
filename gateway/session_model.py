"""What the session table holds: clients, their live requests and each request's samples,
its running counts, and the effects its methods return (plain data, no behaviour)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from codec import ClientMessage, Logprobs, ServerMessage

from .engine import PreparedRequest
from .stop_sequences import StopMatcher

__all__ = ["Client", "Effects", "GatewayState", "Reply", "Request", "Sample", "TableStats"]

Reply = tuple[bytes, ServerMessage]


@dataclass(slots=True)
class TableStats:
    """Running counts, read by the metrics collector at scrape time (no I/O here)."""

    requests_accepted: int = 0
    output_tokens: int = 0
    aborted_by_client: int = 0
    clients_expired: int = 0  # sessions silent past their heartbeat timeout
    clients_left: int = 0  # sessions their client ended with Goodbye
    pauses_forgiven: int = 0  # times this process did not run for a while (see forgive)
    pause_calls: int = 0  # Pause control calls the engine carried out
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
class Sample:
    """One of a request's n samples: one engine request."""

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
class Request:
    """A client's live Generate."""

    client_id: bytes
    request_id: str
    stream: bool
    prompt_tokens: int
    samples: list[Sample]
    live_samples: int
    accepted_at: float = 0.0
    last_output_at: float = 0.0
    deadline_at: float | None = None
    stall_timeout_s: float | None = None
    multimodal_bytes: int = 0  # its items' tensor bytes as the engine holds them


@dataclass(slots=True)
class Client:
    """A client's session."""

    client_id: bytes
    name: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    last_seen: float
    requests: dict[str, Request] = field(default_factory=dict)
    rate_tokens: float = 0.0
    rate_updated: float = 0.0
    session_id: int = 0
    key: str | None = None  # the CURVE public key that opened it, when CURVE is on
    fresh: bool = True  # nothing but its Hello received yet (a repeated Hello keeps it)
    multimodal_bytes: int = 0  # of its live requests (Request.multimodal_bytes)
