"""Framing: how messages map onto ZeroMQ multipart messages, and back.

Rule: after the ROUTER identity a message is exactly two frames, a one-byte
protocol version then the msgpack payload. ``decode_client`` checks frame
count, version, size, then the payload, in that order, and raises
ProtocolError with one ErrorCode per failure. Nothing here touches a socket.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from .bounds import bounded_client_message
from .errors import ProtocolError
from .messages import (
    CLIENT_TAGS,
    PROTOCOL_VERSION,
    Abort,
    ClientMessage,
    ErrorCode,
    Generate,
    ServerMessage,
)

__all__ = [
    "VERSION_FRAME",
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
_any_decoder = msgspec.msgpack.Decoder()

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


def decode_client(
    frames: Sequence[Buffer],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_prompt_tokens: int | None = None,
    max_multimodal_items: int | None = None,
) -> ClientMessage:
    """Decode a client's frames (identity already removed) into a ClientMessage.

    With ``max_prompt_tokens``, a Generate whose prompt array is longer is
    refused from its first bytes, before the costly decode of the whole frame,
    and so is any placeholder mask (``is_embed``) or PrefixQuery prompt that is
    longer, and (with ``max_multimodal_items``) a Generate with more items:
    ``Error(INVALID_REQUEST)`` from the list's header, before its elements.

    Raises:
        ProtocolError: the peer's fault; its ``code`` says which rule broke and
            ``request_id`` is set when the bad message was a readable Generate.
    """
    try:
        payload = _check_frames(frames, max_frame_bytes)
    except ProtocolError as exc:
        if exc.code is ErrorCode.FRAME_TOO_LARGE:  # name the call or request, if it can
            head = _peek_head(frames[1])
            exc.request_id, exc.call_id = head
        raise
    if max_prompt_tokens is not None and len(payload) > max_prompt_tokens:
        head = _peek_generate_head(payload)
        if head is not None and head[1] > max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST, prompt_too_long(head[1], max_prompt_tokens), head[0]
            )
    decoder = (
        _client_decoder
        if max_prompt_tokens is None
        else _bounded_decoder(max_prompt_tokens, max_multimodal_items)
    )
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


@functools.lru_cache(maxsize=8)
def _bounded_decoder(max_prompt_tokens: int, max_multimodal_items: int | None) -> Any:
    items = _UNBOUNDED if max_multimodal_items is None else max_multimodal_items
    return msgspec.msgpack.Decoder(bounded_client_message(max_prompt_tokens, items))


_UNBOUNDED = 2**31


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


_FULL_PEEK_BYTES = 1 << 20  # above this, an error reads headers only (never every element)


def _head(payload: Buffer) -> _Head | None:
    """The head of a message that failed validation; None if it is not one msgpack value."""
    if len(payload) > _FULL_PEEK_BYTES:
        try:
            reader = _Reader(payload)
            length = reader.array()
            tag = reader.integer() if length else None
        except IndexError:
            return _Head(None, None, None, None)
        return _Head(length, tag, *_peek_head(payload))
    raw = _peek(payload)
    if raw is _NOT_MSGPACK:  # e.g. a value followed by trailing bytes
        return None
    if not isinstance(raw, list):
        return _Head(None, None, None, None)
    tag = raw[0] if raw else None
    cls = CLIENT_TAGS.get(tag) if isinstance(tag, int) and not isinstance(tag, bool) else None
    request_id = call_id = None
    if cls is Generate and len(raw) > 1 and isinstance(raw[1], str):
        request_id = raw[1]
    elif cls is not None and "call_id" in cls.__struct_fields__:
        position = cls.__struct_fields__.index("call_id") + 1
        value = raw[position] if len(raw) > position else None
        if isinstance(value, int) and not isinstance(value, bool):
            call_id = value
    return _Head(len(raw), tag, request_id, call_id)


_LENGTH_BOUND = re.compile(r"^Expected `array` of length <= (\d+)")
# Lists bounded by a gateway limit (codec.bounds): past it, the request is refused by name.
_BOUNDED_LISTS = {
    ("Generate", "multimodal", ""): "max_multimodal_items",
    ("PrefixQuery", "prompt_token_ids", ""): "max_prompt_tokens",
}
_BOUNDED_MASK = re.compile(r"^\[\d+\]\.is_embed$")


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
    if bound is not None and not in_key:
        limit = _BOUNDED_LISTS.get((name, field, rest))
        if limit is None and name == "Generate" and field == "multimodal":
            limit = "max_prompt_tokens" if _BOUNDED_MASK.match(rest) else None
        if limit is not None:
            return ProtocolError(
                ErrorCode.INVALID_REQUEST,
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
    """msgpack headers read one by one from a payload's start (IndexError: too short)."""

    def __init__(self, payload: Buffer):
        self.data = memoryview(payload)
        self.pos = 0

    def _take(self, size: int) -> int:
        start = self.pos
        self.pos += size
        if self.pos > len(self.data):
            raise IndexError("truncated")
        return int.from_bytes(self.data[start : self.pos], "big")

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

    def skip_string(self) -> bool:
        kind = self._take(1)
        if 0xA0 <= kind <= 0xBF:
            size = kind & 0x1F
        elif kind in (0xD9, 0xDA, 0xDB):
            size = self._take({0xD9: 1, 0xDA: 2, 0xDB: 4}[kind])
        else:
            return False
        self._take(size)
        return True


_CALL_ID_AT = {  # tag -> the call_id's position among the message's fields
    tag: cls.__struct_fields__.index("call_id")
    for tag, cls in CLIENT_TAGS.items()
    if "call_id" in cls.__struct_fields__
}
_ABORT_TAG = Abort.__struct_config__.tag
_MAX_PEEKED_IDS = 65_536  # an Abort's ids walked over to reach its call_id


def _peek_head(payload: Buffer) -> tuple[str | None, int | None]:
    """(request_id, call_id) read from a message's first bytes where the message could not
    be decoded whole (too large, or not msgpack past its start); (None, None) if unreadable.
    Reads headers only: an Abort's ids are walked over, not decoded."""
    try:
        if isinstance(head := _peek_generate_head(payload), tuple):
            return head[0], None
        reader = _Reader(payload)
        if not reader.array():
            return None, None
        tag = reader.integer()
        at = _CALL_ID_AT.get(tag) if tag is not None else None
        if at is None:
            return None, None
        if tag == _ABORT_TAG:  # request_ids (nil or an array of strings), then call_id
            if reader.data[reader.pos] == 0xC0:
                reader.pos += 1
            else:
                count = reader.array()
                if count is None or count > _MAX_PEEKED_IDS:
                    return None, None
                for _ in range(count):
                    if not reader.skip_string():
                        return None, None
        elif at != 0:
            return None, None
        return None, reader.integer()
    except IndexError:
        return None, None


_NOT_MSGPACK = object()


def _peek(payload: Buffer) -> Any:
    """Untyped decode, only on the error path, for tag and request id (or _NOT_MSGPACK)."""
    try:
        return _any_decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _NOT_MSGPACK
