"""What the gateway itself placed on each data-parallel rank, as a prefix index (sans-IO).

``--routing-index approximate``: instead of reading vLLM's KV events (``PrefixIndex``), the
gateway records the block hashes of each prompt it sends to a rank and counts them against
that rank's KV-cache blocks, the least recently routed dropped first. The engines publish
nothing, so neither their busy loops nor the gateway pay for events, and nothing has to
reach the gateway from the ranks; the price is that it is a guess. It holds the prompts'
blocks but not the blocks of generated tokens (a conversation's next turn matches up to its
previous turn's prompt), and sees neither other gateways' placements nor vLLM's own
evictions and preemptions: under memory pressure it can predict a hit that vLLM no longer
holds. Its predictions are still checked against vLLM's ``num_cached_tokens``, as the
events index's are.

Its hashes are its own (``chained_block_hashes``: Python's tuple hash, chained block to
block from a seed of the request's LoRA and cache salt), about 0.5 µs a block against
vLLM's ~12 µs: every placed prompt is hashed whole (up to ``--routing-max-blocks``), not only
to its first unmatched block, and no engine has to agree with them. The seed also holds a
secret drawn per index (``secret``): Python's tuple hash is not cryptographic, and a client
that could predict the values could craft prompts whose blocks collide in the index's
tables; it never sees them (PrefixQuery answers token counts), and cannot predict them.

A prompt's blocks are touched last block first, so that its first block is the most
recently used: as in vLLM, which frees a request's blocks tail first, a prefix loses its
ends before its root, and what stays is still a matchable chain.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Hashable, Iterable, Sequence

from .prefix_index import count_leading_blocks

__all__ = ["ApproximateIndex", "chained_block_hashes"]


def chained_block_hashes(
    tokens: Sequence[int], block_size: int, seed: Hashable, limit: int | None = None
) -> list[int]:
    """One hash per full block of ``tokens``, each of its block's tokens and the hash
    before it (the first: of ``seed``), so equal hashes mean equal prefixes; at most
    ``limit``. Valid within one process (``seed``'s strings hash per process)."""
    hashes: list[int] = []
    if block_size <= 0 or limit == 0:
        return hashes
    parent = hash(seed)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, *tokens[start : start + block_size]))
        hashes.append(parent)
        if len(hashes) == limit:
            break
    return hashes


class ApproximateIndex:
    """Per rank, the block hashes of the prompts routed there, at most ``capacity_blocks``."""

    def __init__(self, ranks: int, capacity_blocks: int):
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        self.capacity_blocks = max(1, capacity_blocks)
        self.secret = secrets.randbits(64)  # part of every seed (the module docstring)
        self.ranks: list[collections.OrderedDict[Hashable, None]] = [
            collections.OrderedDict() for _ in range(ranks)
        ]

    def matched_blocks(
        self, hashes: Iterable[Hashable], max_blocks: int | None = None
    ) -> list[int]:
        """Per rank: how many of ``hashes`` (a prompt's chained block hashes, in order) it
        holds as a prefix. Stops at the first hash no rank holds, or at ``max_blocks``."""
        out = [0] * len(self.ranks)
        count_leading_blocks(hashes, list(enumerate(self.ranks)), out, max_blocks)
        return out

    def record(self, rank: int, hashes: Sequence[Hashable]) -> None:
        """A prompt with these block hashes was sent to ``rank``: its blocks are now the
        rank's most recently used (first block most of all); the oldest go past capacity."""
        blocks = self.ranks[rank]
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def clear(self) -> None:
        """Every rank's prefix cache was reset."""
        for blocks in self.ranks:
            blocks.clear()

    def sizes(self) -> list[int]:
        """Block hashes held per rank."""
        return [len(blocks) for blocks in self.ranks]
