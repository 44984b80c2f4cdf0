"""vLLM's prefix-cache block hashes of a request, computed in the gateway's process.

The same code the engine core runs (``get_request_block_hasher`` over
``Request.from_engine_core_request``): parent-chained hashes of each full block of
prompt tokens with their extra keys (LoRA name and path, cache salt, multimodal items),
by the engine's ``--prefix-caching-hash-algo``, from the same ``NONE_HASH`` seed. Hashes
are given as vLLM's KV events publish them (the low 64 bits as an int, unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

The seed: sha256 and sha256_cbor use vLLM's fixed default unless PYTHONHASHSEED is set
(the engines inherit the gateway's environment, so both sides read the same value);
non-cryptographic algorithms draw a random seed per process unless PYTHONHASHSEED is set,
and no gateway can reproduce those (``reproducible`` is False). Whatever the settings,
``verify`` checks our hash of a block an engine published against the hash it published.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["PrefixHasher"]


class PrefixHasher:
    """Block hashes of EngineCoreRequests, as an engine with ``vllm_config`` makes them."""

    def __init__(self, vllm_config: Any, block_size: int | None = None):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        self.algorithm = vllm_config.cache_config.prefix_caching_hash_algo
        self._hash_fn = get_hash_fn_by_name(self.algorithm)
        kv_cache_utils.init_none_hash(self._hash_fn)  # this process's NONE_HASH
        non_crypto = getattr(kv_cache_utils, "_NON_CRYPTO_HASH_FUNCTIONS", ())
        self.reproducible = not (
            self._hash_fn in non_crypto and os.getenv("PYTHONHASHSEED") is None
        )
        self.block_size = block_size or vllm_config.cache_config.block_size

    def block_hashes(self, core_request: Any, block_size: int | None = None) -> list[Any]:
        """The hashes of the request's full prompt blocks, in order (as events carry them)."""
        return list(self.iter_block_hashes(core_request, block_size))

    def iter_block_hashes(self, core_request: Any, block_size: int | None = None) -> Iterator:
        """The same hashes, each computed only when it is taken: a caller that stops at the
        first block no rank holds hashes no further (vLLM's ``get_request_block_hasher``
        loop, which hashes the whole prompt at once, taken apart)."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            hash_block_tokens,
            maybe_convert_block_hash,
        )
        from vllm.v1.request import Request

        size = block_size or self.block_size
        if not size:
            return
        request = Request.from_engine_core_request(core_request, None)
        tokens = request.all_token_ids
        parent = None
        mm_index = 0
        for start in range(0, request.num_tokens - size + 1, size):
            extra_keys, mm_index = generate_block_hash_extra_keys(
                request, start, start + size, mm_index
            )
            parent = hash_block_tokens(
                self._hash_fn, parent, tokens[start : start + size], extra_keys
            )
            yield maybe_convert_block_hash(parent)

    def verify(self, published: Any, token_ids: Sequence[int], event_keys: Any) -> bool:
        """Does our hash of a prompt's first block (no LoRA: events leave out its path)
        with the untagged extra keys an engine published for it (``BlockStored.extra_keys``
        entry: the cache salt) equal the hash that engine published?"""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

        keys = None
        if event_keys:
            keys = tuple(("cache_salt", key) for key in event_keys if isinstance(key, str))
            if len(keys) != len(event_keys):
                return True  # multimodal or embeds keys: not checkable from the event
        ours = hash_block_tokens(self._hash_fn, None, list(token_ids), keys or None)
        return maybe_convert_block_hash(ours) == published
