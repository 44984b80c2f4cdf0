"""Client messages with every list and map bounded by one gateway's limits.

msgspec checks a list's (or map's) length from its msgpack header, before it decodes one
element, so a list over its bound costs nothing but the refusal. A gateway's frame holds
64 MiB more than a text model's for a multimodal model's tensors; without a bound, a list
in it decoded as Python objects took seconds of the gateway's loop and gigabytes (nested
lists: ``bad_words_token_ids=[[1]] * 34M``, 11.9 s and +2.6 GB). Here:

- a Generate's token-id lists are bounded by the vocabulary (``stop_token_ids``,
  ``allowed_token_ids``, ``logit_bias``: a longer one repeats ids), ``bad_words_token_ids``
  and ``stop_token_sequences`` by their limits (count, then ids in one), its placeholder
  masks (``is_embed``) and a PrefixQuery's prompt by ``max_prompt_tokens``, its items by
  ``max_multimodal_items``;
- an Abort's ids by ``max_abort_ids``;
- a Generate's ``kv_transfer_params`` is not decoded here at all (``msgspec.Raw``): only
  clients the operator allows may send them, so the session table decodes them (bounded,
  codec.messages.OpaqueMap) once the sender is known to be one (``decode_kv_params``).

The fixed bounds (tensor dims and names, WakeUp's tags, backend maps' depth and length)
are the wire structs' own. The classes are subclasses of the wire structs (same tags and
fields), so a decoded message is still a ``Generate``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .messages import (
    Abort,
    ClientMessage,
    Generate,
    Limits,
    MultimodalItem,
    OpaqueMap,
    PrefixQuery,
    RequestOptions,
    SamplingParams,
    TokenId,
)

__all__ = ["WireBounds", "bounded_client_message", "decode_kv_params", "kv_params_given"]


@dataclasses.dataclass(frozen=True, slots=True)
class WireBounds:
    """The lengths a gateway's decoder allows (each from ``Limits``, or the model)."""

    max_prompt_tokens: int
    vocab_size: int = 2**31
    max_multimodal_items: int | None = None  # None: any (the table refuses items by model)
    max_abort_ids: int = 2**31
    max_stop_sequences: int = 2**31
    max_stop_sequence_len: int = 2**31
    max_bad_words: int = 2**31
    max_bad_word_len: int = 2**31

    @classmethod
    def of(cls, limits: Limits, vocab_size: int) -> WireBounds:
        """A gateway's bounds, from the limits it announces and its model's vocabulary."""
        return cls(
            max_prompt_tokens=limits.max_prompt_tokens,
            vocab_size=vocab_size,
            # A model without images refuses items as UNSUPPORTED (the table), not by count.
            max_multimodal_items=limits.max_multimodal_items or None,
            max_abort_ids=limits.max_abort_ids,
            max_stop_sequences=limits.max_stop_sequences,
            max_stop_sequence_len=limits.max_stop_sequence_len,
            max_bad_words=limits.max_bad_words,
            max_bad_word_len=limits.max_bad_word_len,
        )


def _bounded(of: Any, max_length: int) -> Any:
    return Annotated[of, Meta(max_length=max_length)]


def _ids(max_length: int) -> Any:
    return _bounded(list[int], max_length)


def _nested_ids(count: int, length: int) -> Any:
    return _bounded(list[_ids(length)], count)


def _struct(base: type, fields: list[tuple[str, Any, Any]], tagged: bool = False) -> Any:
    """A subclass of wire struct ``base`` with ``fields`` retyped (same tag and names)."""
    config = {"tag": base.__struct_config__.tag} if tagged else {}
    return msgspec.defstruct(base.__name__, fields, bases=(base,), module=__name__, **config)


@functools.lru_cache(maxsize=8)
def bounded_client_message(bounds: WireBounds) -> Any:
    """The ClientMessage union with every client list bounded by ``bounds``."""
    vocab = bounds.vocab_size
    sampling = _struct(
        SamplingParams,
        [
            ("stop_token_ids", _ids(vocab) | None, None),
            ("logit_bias", _bounded(dict[int, float], vocab) | None, None),
            ("allowed_token_ids", _ids(vocab) | None, None),
            (
                "bad_words_token_ids",
                _nested_ids(bounds.max_bad_words, bounds.max_bad_word_len) | None,
                None,
            ),
            (
                "stop_token_sequences",
                _nested_ids(bounds.max_stop_sequences, bounds.max_stop_sequence_len) | None,
                None,
            ),
        ],
    )
    # (msgspec.Raw takes nil too: kv_params_given tells an explicit nil from params.)
    options = _struct(RequestOptions, [("kv_transfer_params", msgspec.Raw, None)])
    mask = _bounded(list[bool], bounds.max_prompt_tokens)
    item = _struct(MultimodalItem, [("is_embed", mask | None, None)])
    items = _bounded(list[item], bounds.max_multimodal_items or 2**31)
    generate = _struct(
        Generate,
        [
            ("sampling", sampling, SamplingParams()),
            ("options", options | None, None),
            ("multimodal", items | None, None),
        ],
        tagged=True,
    )
    prompt = _bounded(list[TokenId], bounds.max_prompt_tokens)
    query = _struct(
        PrefixQuery,
        [("prompt_token_ids", prompt, []), ("options", options | None, None)],
        tagged=True,
    )
    abort = _struct(
        Abort, [("request_ids", _bounded(list[str], bounds.max_abort_ids) | None, None)], True
    )
    swap = {Generate: generate, PrefixQuery: query, Abort: abort}
    return functools.reduce(
        lambda union, cls: union | cls, [swap.get(cls, cls) for cls in ClientMessage.__args__]
    )


_kv_decoder = msgspec.msgpack.Decoder(OpaqueMap)
_NIL = b"\xc0"


def kv_params_given(options: RequestOptions | None) -> bool:
    """Whether ``options`` carries kv_transfer_params (not absent, not nil)."""
    params = None if options is None else options.kv_transfer_params
    return params is not None and (not isinstance(params, msgspec.Raw) or bytes(params) != _NIL)


def decode_kv_params(raw: msgspec.Raw | dict[str, Any]) -> dict[str, Any]:
    """A Generate's ``kv_transfer_params`` as a map (left as ``msgspec.Raw`` by a gateway's
    decoder), bounded as codec.messages.OpaqueMap. Raises ValueError naming the problem."""
    if not isinstance(raw, msgspec.Raw):
        return raw
    try:
        return _kv_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise ValueError(f"RequestOptions.kv_transfer_params: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"RequestOptions.kv_transfer_params is not readable: {exc}") from None
