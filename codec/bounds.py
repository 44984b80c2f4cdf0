"""Client messages with their lists bounded by one gateway's limits.

msgspec checks a list's length from its msgpack header, before it decodes one element. A
Generate's ``is_embed`` masks and a PrefixQuery's prompt are bounded by nothing but the
frame otherwise, and a multimodal model's frame holds 64 MiB for tensors: decoded as lists
of booleans, that held the gateway's loop for seconds and took 8 bytes per byte. Here each
is bounded by the gateway's ``max_prompt_tokens`` (no placeholder is longer than a prompt)
and a Generate's items by ``max_multimodal_items``. The classes are subclasses of the wire
structs (same tags and fields), so a decoded message is still a ``Generate``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .messages import ClientMessage, Generate, MultimodalItem, PrefixQuery, TokenId

__all__ = ["bounded_client_message"]


@functools.lru_cache(maxsize=8)
def bounded_client_message(max_prompt_tokens: int, max_multimodal_items: int) -> Any:
    """The ClientMessage union with Generate's and PrefixQuery's lists bounded: at most
    ``max_prompt_tokens`` entries in a placeholder mask or a PrefixQuery's prompt, at most
    ``max_multimodal_items`` items in a Generate (0: none)."""
    mask = Annotated[list[bool], Meta(max_length=max_prompt_tokens)]
    item = msgspec.defstruct(
        "MultimodalItem",
        [("is_embed", mask | None, None)],
        bases=(MultimodalItem,),
        module=__name__,
    )
    items = Annotated[list[item], Meta(max_length=max_multimodal_items)]  # type: ignore[valid-type]
    generate = msgspec.defstruct(
        "Generate",
        [("multimodal", items | None, None)],
        bases=(Generate,),
        tag=Generate.__struct_config__.tag,
        module=__name__,
    )
    prompt = Annotated[list[TokenId], Meta(max_length=max_prompt_tokens)]
    query = msgspec.defstruct(
        "PrefixQuery",
        [("prompt_token_ids", prompt, [])],
        bases=(PrefixQuery,),
        tag=PrefixQuery.__struct_config__.tag,
        module=__name__,
    )
    swap = {Generate: generate, PrefixQuery: query}
    return functools.reduce(
        lambda union, cls: union | cls, [swap.get(cls, cls) for cls in ClientMessage.__args__]
    )
