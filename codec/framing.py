"""Framing: how messages map onto ZeroMQ multipart messages, and back.

Rule: after the ROUTER identity a message is exactly two frames, a one-byte
protocol version then the msgpack payload. ``decode_client`` checks frame
count, version, size, then the payload, in that order, and raises
ProtocolError with one ErrorCode per failure. Nothing here touches a socket.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .bounds import WireBounds, bounded_client_message
from .errors import ProtocolError
from .messages import (
    CLIENT_TAGS,
    PROTOCOL_VERSION,
    ClientMessage,
    ErrorCode,
    Generate,
    ServerMessage,
)

__all__ = [
    "VERSION_FRAME",
    "message_kind",
    "peek_ids",
    "prompt_too_long",
    "DEFAULT_MAX_FRAME_BYTES",
    "encode",
    "encode_payload",
    "decode_client",
    "decode_server",
]

VERSION_FRAME = bytes([PROTOCOL_VERSION])
DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024
"""Largest payload frame a gateway accepts unless configured otherwise."""

Buffer = bytes | bytearray | memoryview

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)

_PATH = re.compile(r" - at `(key` in `)?\$(?:\[(\d+)\])?(.*)`$")


def encode_payload(msg: msgspec.Struct) -> bytes:
    """Encode one message's payload frame (without the version frame)."""
    return _encoder.encode(msg)


def encode(msg: msgspec.Struct) -> list[bytes]:
    """Encode one message as its frames: ``[VERSION_FRAME, payload]``."""
    return [VERSION_FRAME, _encoder.encode(msg)]


def _check_frames(frames: Sequence[Buffer], max_frame_bytes: int) -> Buffer:
    if len(frames) != 2:
        raise ProtocolError(
            ErrorCode.BAD_FRAME_COUNT,
            f"expected 2 frames (version, payload) after the identity, got {len(frames)}",
        )
    version, payload = frames
    if len(version) != 1 or version[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"unsupported protocol version frame {bytes(version[:8]).hex()!r};"
            f" this peer speaks version {PROTOCOL_VERSION} (frame b'\\x0{PROTOCOL_VERSION}')",
        )
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"payload of {len(payload)} bytes exceeds the limit of {max_frame_bytes} bytes",
        )
    return payload


def prompt_too_long(prompt_tokens: int, max_prompt_tokens: int) -> str:
    """The refusal message for a prompt over ``max_prompt_tokens`` (one wording everywhere)."""
    return f"prompt of {prompt_tokens} tokens exceeds max_prompt_tokens ({max_prompt_tokens})"


MAX_CACHE_SALT_LEN = 128  # vLLM's, as its frontend's forbidden characters
_SALT_FORBIDDEN = frozenset("@/\\\0")


def cache_salt_problem(salt: str) -> str | None:
    """Why vLLM's frontend (validate_cache_salt), and so a gateway, refuses ``salt``, in its
    words; None for a salt it accepts."""
    if not salt:
        return (
            "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
        )
    if len(salt) > MAX_CACHE_SALT_LEN or not _SALT_FORBIDDEN.isdisjoint(salt):
        return (
            f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT_LEN} characters and"
            " must not contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)"
        )
    return None


def decode_client(
    frames: Sequence[Buffer],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    bounds: WireBounds | None = None,
) -> ClientMessage:
    """Decode a client's frames (identity already removed) into a ClientMessage.

    With ``bounds`` (a gateway's), a Generate whose prompt array is longer than
    ``max_prompt_tokens`` is refused from its first bytes, before the costly decode of the
    whole frame, and every other list and map of a client message is bounded from its
    msgpack header (codec.bounds): ``Error(INVALID_REQUEST)`` naming the field and the
    limit (``INVALID_MESSAGE`` for an Abort's ids), before its elements are decoded.

    Raises:
        ProtocolError: the peer's fault; its ``code`` says which rule broke and
            ``request_id`` (a Generate's) or ``call_id`` is set where readable.
    """
    try:
        payload = _check_frames(frames, max_frame_bytes)
    except ProtocolError as exc:
        if exc.code is ErrorCode.FRAME_TOO_LARGE:  # name the call or request, if it can
            exc.request_id, exc.call_id = _peek_head(frames[1])
        raise
    if bounds is not None and len(payload) > bounds.max_prompt_tokens:
        head = _peek_generate_head(payload)
        if head is not None and head[1] > bounds.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                prompt_too_long(head[1], bounds.max_prompt_tokens),
                head[0],
            )
    decoder = _client_decoder if bounds is None else _bounded_decoder(bounds)
    try:
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise _translate_validation(exc, payload) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"payload is not valid msgpack: {exc}", *_peek_head(payload)
        ) from None
    except UnicodeDecodeError as exc:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"a string is not valid UTF-8: {exc}", *_peek_head(payload)
        ) from None
    except RecursionError:
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            "arrays or maps nested too deep (a client message nests a few levels at most)",
            *_peek_head(payload),
        ) from None


@functools.lru_cache(maxsize=8)
def _bounded_decoder(bounds: WireBounds) -> Any:
    return msgspec.msgpack.Decoder(bounded_client_message(bounds))


def message_kind(payload: Buffer) -> type | None:
    """The client message a payload says it is, from its first bytes (its tag); None where
    they name none. Nothing else is read: the payload may still fail to decode."""
    reader = _Reader(payload)
    try:
        return CLIENT_TAGS.get(reader.integer()) if reader.array() else None
    except IndexError:
        return None


def peek_ids(payload: Buffer) -> tuple[str | None, int | None]:
    """A client message's (request_id, call_id) read from its msgpack headers alone (the
    values before a call_id walked over, never decoded); None where not readable."""
    return _peek_head(payload)


def decode_server(frames: Sequence[Buffer]) -> ServerMessage:
    """Decode a gateway's frames into a ServerMessage (for clients).

    Raises:
        ProtocolError: the gateway sent something this client cannot read
            (for instance a newer message tag).
    """
    payload = _check_frames(frames, max_frame_bytes=2**62)
    try:
        return _server_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        code = ErrorCode.UNKNOWN_MESSAGE if "`$[0]`" in str(exc) else ErrorCode.INVALID_MESSAGE
        raise ProtocolError(code, f"unreadable gateway message: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"gateway payload is not msgpack: {exc}") from None


@dataclass(frozen=True, slots=True)
class _Head:
    """What an error message needs of a message that failed to decode: its top array's
    length (None: not an array), its tag, and its request id or call id where readable."""

    length: int | None
    tag: Any
    request_id: str | None
    call_id: int | None


_raw_decoder = msgspec.msgpack.Decoder(msgspec.Raw)
_any_decoder = msgspec.msgpack.Decoder()
_FULL_PEEK_BYTES = 64 * 1024  # decoded untyped on an error path, at most (~2 ms)


def _head(payload: Buffer) -> _Head | None:
    """The head of a message that failed validation, read from msgpack headers alone (never
    every element); None if the payload is not one msgpack value."""
    # Small: decoded untyped, which checks its strings' UTF-8 too; large: walked in C,
    # allocating nothing (a string's bytes unchecked).
    decoder = _any_decoder if len(payload) <= _FULL_PEEK_BYTES else _raw_decoder
    try:
        decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    except RecursionError:
        pass  # one value, nested too deep to walk: the validation error says so
    reader = _Reader(payload)
    try:
        length = reader.array()
        if length is None:
            return _Head(None, None, None, None)
        tag = reader.scalar() if length else None
    except (IndexError, ValueError):
        return _Head(None, None, None, None)
    return _Head(length, tag, *_peek_head(payload))


_LENGTH_BOUND = re.compile(r"^Expected `(?:array|object)` of length <= (\d+)")
# Lists bounded by a gateway limit (codec.bounds), by (message, field, the path within the
# field): past it, refused naming the field and the limit.
_INDEX = r"\[\d+\]"
_BOUNDED_LISTS = [
    ("Generate", "multimodal", "", "max_multimodal_items"),
    ("Generate", "multimodal", rf"{_INDEX}\.is_embed", "max_prompt_tokens"),
    ("Generate", "sampling", r"\.(?:stop_token_ids|allowed_token_ids|logit_bias)", "vocab_size"),
    ("Generate", "sampling", r"\.bad_words_token_ids", "max_bad_words"),
    ("Generate", "sampling", rf"\.bad_words_token_ids{_INDEX}", "max_bad_word_len"),
    ("Generate", "sampling", r"\.stop_token_sequences", "max_stop_sequences"),
    ("Generate", "sampling", rf"\.stop_token_sequences{_INDEX}", "max_stop_sequence_len"),
    ("PrefixQuery", "prompt_token_ids", "", "max_prompt_tokens"),
    ("Abort", "request_ids", "", "max_abort_ids"),
]
_BOUNDED = [
    (name, field, re.compile(rest + "$"), limit) for name, field, rest, limit in _BOUNDED_LISTS
]


def _bounded_limit(name: str, field: str, rest: str) -> str | None:
    """The limit that bounds this list, if a gateway's limit does."""
    for bounded_name, bounded_field, pattern, limit in _BOUNDED:
        if name == bounded_name and field == bounded_field and pattern.match(rest):
            return limit
    return None


def _translate_validation(exc: msgspec.ValidationError, payload: Buffer) -> ProtocolError:
    """Rewrite a msgspec validation error into field names and an ErrorCode."""
    head = _head(payload)
    if head is None:
        return ProtocolError(ErrorCode.MALFORMED, "payload is not one msgpack value")
    tag = head.tag
    cls = CLIENT_TAGS.get(tag) if isinstance(tag, int) and not isinstance(tag, bool) else None
    request_id, call_id = head.request_id, head.call_id
    text = str(exc)
    match = _PATH.search(text)
    if cls is None:
        if head.length:
            return ProtocolError(
                ErrorCode.UNKNOWN_MESSAGE,
                f"unknown message tag {tag!r}; known client tags: {sorted(CLIENT_TAGS)}",
            )
        return ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"a message is a msgpack array whose first element is its tag: {text}",
        )
    name = cls.__name__
    if match is None:
        # Root shape: too few items means a missing required field.
        required = [f for f, d in zip(cls.__struct_fields__, _defaults(cls), strict=True) if d]
        if head.length is not None and head.length - 1 < len(required):
            missing = ", ".join(required[head.length - 1 :])
            return ProtocolError(
                ErrorCode.INVALID_MESSAGE,
                f"{name}: missing required field(s) {missing}",
                request_id,
                call_id,
            )
        return ProtocolError(ErrorCode.INVALID_MESSAGE, f"{name}: {text}", request_id, call_id)
    in_key, index, rest = match.groups()
    where = text[: match.start()] + (" (in a map key)" if in_key else "")
    if index is None or int(index) == 0:
        field = "message"
    else:
        fields = cls.__struct_fields__
        position = int(index) - 1
        field = fields[position] if position < len(fields) else f"[{index}]"
    bound = _LENGTH_BOUND.match(where)
    limit = _bounded_limit(name, field, rest) if bound is not None and not in_key else None
    if limit is not None:
        code = ErrorCode.INVALID_MESSAGE if name == "Abort" else ErrorCode.INVALID_REQUEST
        return ProtocolError(
            code,
            f"{name}.{field}{rest} holds more than {bound.group(1)} entries; {limit} is"
            f" {bound.group(1)}",
            request_id,
            call_id,
        )
    return ProtocolError(
        ErrorCode.INVALID_MESSAGE, f"{name}.{field}{rest}: {where}", request_id, call_id
    )


def _defaults(cls: type[msgspec.Struct]) -> list[bool]:
    """For each field of ``cls``, whether it is required (has no default)."""
    n_required = len(cls.__struct_fields__) - len(cls.__struct_defaults__)
    return [True] * n_required + [False] * len(cls.__struct_defaults__)


_GENERATE_TAG = Generate.__struct_config__.tag


def _peek_generate_head(payload: Buffer) -> tuple[str, int] | None:
    """(request_id, prompt length) read from a Generate's first bytes, or None.

    Reads only msgpack headers: the array, the tag, the request id string and
    the prompt array's length. Anything unexpected returns None, and the full
    decode then reports the problem as usual.
    """
    data = memoryview(payload)
    if len(data) < 4:
        return None
    first = data[0]
    if 0x90 <= first <= 0x9F:
        pos = 1
    elif first == 0xDC:
        pos = 3
    elif first == 0xDD:
        pos = 5
    else:
        return None
    if data[pos] != _GENERATE_TAG:
        return None
    pos += 1
    kind = data[pos]
    if 0xA0 <= kind <= 0xBF:
        size, pos = kind & 0x1F, pos + 1
    elif kind == 0xD9:
        size, pos = data[pos + 1], pos + 2
    elif kind == 0xDA:
        size, pos = int.from_bytes(data[pos + 1 : pos + 3], "big"), pos + 3
    else:
        return None
    try:
        request_id = bytes(data[pos : pos + size]).decode()
    except UnicodeDecodeError:
        return None
    pos += size
    if pos >= len(data):
        return None
    kind = data[pos]
    if 0x90 <= kind <= 0x9F:
        length = kind & 0x0F
    elif kind == 0xDC:
        length = int.from_bytes(data[pos + 1 : pos + 3], "big")
    elif kind == 0xDD:
        length = int.from_bytes(data[pos + 1 : pos + 5], "big")
    else:
        return None
    return request_id, length


class _Reader:
    """msgpack headers read one by one from a payload's start (IndexError: too short;
    ValueError: not msgpack there)."""

    def __init__(self, payload: Buffer):
        self.data = memoryview(payload)
        self.pos = 0

    def _take(self, size: int) -> int:
        start = self.pos
        self.pos += size
        if self.pos > len(self.data):
            raise IndexError("truncated")
        return int.from_bytes(self.data[start : self.pos], "big")

    def _bytes(self, size: int) -> bytes:
        start = self.pos
        self._take(size)
        return bytes(self.data[start : self.pos])

    def array(self) -> int | None:
        kind = self._take(1)
        if 0x90 <= kind <= 0x9F:
            return kind & 0x0F
        size = {0xDC: 2, 0xDD: 4}.get(kind)
        return None if size is None else self._take(size)

    def integer(self) -> int | None:
        kind = self._take(1)
        if kind <= 0x7F:
            return kind
        size = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(kind)
        return None if size is None else self._take(size)

    def string(self) -> str | None:
        """A str (None: something else there, read over)."""
        kind = self.data[self.pos] if self.pos < len(self.data) else None
        if kind is None or not (0xA0 <= kind <= 0xBF or kind in (0xD9, 0xDA, 0xDB)):
            self.skip(1)
            return None
        self.pos += 1
        size = kind & 0x1F if kind <= 0xBF else self._take({0xD9: 1, 0xDA: 2, 0xDB: 4}[kind])
        try:
            return self._bytes(size).decode()
        except UnicodeDecodeError:
            return None

    def scalar(self) -> Any:
        """An int, float, str, bool or nil, as its value (a container: its header read, a
        marker returned)."""
        kind = self.data[self.pos] if self.pos < len(self.data) else None
        if kind is None:
            raise IndexError("truncated")
        if kind <= 0x7F or 0xCC <= kind <= 0xCF:
            return self.integer()
        if kind >= 0xE0:
            self.pos += 1
            return kind - 0x100
        if 0xD0 <= kind <= 0xD3:
            self.pos += 1
            size = 1 << (kind - 0xD0)
            return int.from_bytes(self._bytes(size), "big", signed=True)
        if kind in (0xCA, 0xCB):
            self.pos += 1
            return struct.unpack(
                ">f" if kind == 0xCA else ">d", self._bytes(4 if kind == 0xCA else 8)
            )[0]
        if kind in (0xC0, 0xC2, 0xC3):
            self.pos += 1
            return {0xC0: None, 0xC2: False, 0xC3: True}[kind]
        if 0xA0 <= kind <= 0xBF or kind in (0xD9, 0xDA, 0xDB):
            return self.string()
        return _CONTAINER  # (not read over: a tag's reader stops here)

    def skip(self, budget: int) -> int:
        """Read over one value, walking at most ``budget`` values in all; the budget left.
        Raises ValueError past the budget, or where the bytes are not msgpack."""
        pending = 1
        while pending:
            pending -= 1
            budget -= 1
            if budget < 0:
                raise ValueError("over the walking budget")
            kind = self._take(1)
            if kind <= 0x7F or kind >= 0xE0 or kind in (0xC0, 0xC2, 0xC3):
                continue
            if 0x80 <= kind <= 0x8F:
                pending += 2 * (kind & 0x0F)
            elif 0x90 <= kind <= 0x9F:
                pending += kind & 0x0F
            elif 0xA0 <= kind <= 0xBF:
                self._take(kind & 0x1F)
            elif kind in _FIXED_SIZES:
                self._take(_FIXED_SIZES[kind])
            elif kind in _SIZED:
                self._take(self._take(_SIZED[kind]))
            elif kind in _EXT:
                self._take(self._take(_EXT[kind]) + 1)
            elif kind in (0xDC, 0xDD):
                pending += self._take(2 if kind == 0xDC else 4)
            elif kind in (0xDE, 0xDF):
                pending += 2 * self._take(2 if kind == 0xDE else 4)
            else:  # 0xC1: never used
                raise ValueError("not msgpack")
        return budget


class _Container:
    def __repr__(self) -> str:
        return "an array, map, bin or ext"


_CONTAINER = _Container()
# msgpack kinds by how their size is given: fixed payload sizes (floats, ints, fixext with
# its type byte), a length of 1/2/4 bytes then the data (bin, str), ext (length, type, data).
_FIXED_SIZES = {
    0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4,
    0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_CALL_ID_AT = {  # tag -> the call_id's position among the message's fields
    tag: cls.__struct_fields__.index("call_id")
    for tag, cls in CLIENT_TAGS.items()
    if "call_id" in cls.__struct_fields__
}
_PEEK_BUDGET = 65_536  # values walked over to reach a call_id (an Abort's ids)


def _peek_head(payload: Buffer) -> tuple[str | None, int | None]:
    """(request_id, call_id) read from a message's first bytes where the message could not
    be decoded whole (too large, not msgpack past its start, a field out of bounds);
    (None, None) where unreadable. Reads headers only: the fields before a call_id are
    walked over (at most ``_PEEK_BUDGET`` values), not decoded."""
    reader = _Reader(payload)
    try:
        if not reader.array():
            return None, None
        tag = reader.integer()
        if tag == _GENERATE_TAG:
            return reader.string(), None
        at = _CALL_ID_AT.get(tag) if tag is not None else None
        if at is None:
            return None, None
        budget = _PEEK_BUDGET
        for _ in range(at):
            budget = reader.skip(budget)
        call_id = reader.scalar()
    except (IndexError, ValueError):
        return None, None
    return None, call_id if isinstance(call_id, int) and not isinstance(call_id, bool) else None
