"""What the gateway itself placed on each data-parallel rank, as a prefix index (sans-IO).

``--routing-index approximate``: instead of reading vLLM's KV events (``PrefixIndex``), the
gateway records the block hashes of each prompt it sends to a rank and counts them against
that rank's KV-cache blocks, the least recently routed dropped first. The engines publish
nothing, so neither their busy loops nor the gateway pay for events, and nothing has to
reach the gateway from the ranks; the price is that it is a guess. It holds the prompts'
blocks (held for routing from placement, cached once the request produced output) and,
once a request ends (``PlacedSequences``), the blocks its generated tokens filled, so that
a conversation's next turn matches its previous turn whole; it sees
neither other gateways' placements nor vLLM's own evictions and preemptions: under memory
pressure it can predict a hit that vLLM no longer holds. Its predictions are still checked
against vLLM's ``num_cached_tokens``, as the events index's are.

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
import dataclasses
import secrets
from collections.abc import Container, Hashable, Iterable, Sequence
from typing import Any

from .prefix_index import count_leading_blocks

__all__ = ["ApproximateIndex", "PlacedSequences", "chained_block_hashes"]


def chained_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: Hashable,
    limit: int | None = None,
    after: int | None = None,
) -> list[int]:
    """One hash per full block of ``tokens``, each of its block's tokens and the hash
    before it (the first: of ``seed``, or ``after``, the hash of the block these tokens
    follow), so equal hashes mean equal prefixes; at most ``limit``. Valid within one
    process (``seed``'s strings hash per process)."""
    hashes: list[int] = []
    if block_size <= 0 or limit == 0:
        return hashes
    parent = hash(seed) if after is None else after
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, *tokens[start : start + block_size]))
        hashes.append(parent)
        if len(hashes) == limit:
            break
    return hashes


class _HeldOrCached:
    """A rank's blocks as routing sees them: cached, or about to be (held)."""

    __slots__ = ("cached", "held")

    def __init__(self, cached: Container[Hashable], held: Container[Hashable]):
        self.cached, self.held = cached, held

    def __contains__(self, block: object) -> bool:
        return block in self.cached or block in self.held


class ApproximateIndex:
    """Per rank, the block hashes of the prompts routed there, at most ``capacity_blocks``:
    those computed (``record``: a request that produced output, its prompt's and its
    output's), and those held by requests placed there that have not yet produced any
    (``hold``): routing counts both, so that a burst of one prefix goes to one rank;
    ``matched_blocks(..., held=False)`` (PrefixQuery) only what was computed."""

    def __init__(self, ranks: int, capacity_blocks: int):
        if ranks < 1:
            raise ValueError("ranks must be at least 1")
        self.capacity_blocks = max(1, capacity_blocks)
        self.secret = secrets.randbits(64)  # part of every seed (the module docstring)
        self.ranks: list[collections.OrderedDict[Hashable, None]] = [
            collections.OrderedDict() for _ in range(ranks)
        ]
        # Per rank: block hash -> requests placed there, not yet computed, that hold it.
        self.held: list[dict[Hashable, int]] = [{} for _ in range(ranks)]

    def matched_blocks(
        self, hashes: Iterable[Hashable], max_blocks: int | None = None, held: bool = True
    ) -> list[int]:
        """Per rank: how many of ``hashes`` (a prompt's chained block hashes, in order) it
        holds as a prefix (``held``: counting the blocks of requests placed there not yet
        computed). Stops at the first hash no rank holds, or at ``max_blocks``."""
        out = [0] * len(self.ranks)
        if held:
            holding = [
                (rank, _HeldOrCached(blocks, self.held[rank]) if self.held[rank] else blocks)
                for rank, blocks in enumerate(self.ranks)
            ]
        else:
            holding = list(enumerate(self.ranks))
        count_leading_blocks(hashes, holding, out, max_blocks)
        return out

    def record(self, rank: int, hashes: Sequence[Hashable]) -> None:
        """Blocks with these hashes were computed on ``rank``: they are now its most
        recently used (first block most of all); the oldest go past capacity."""
        blocks = self.ranks[rank]
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def hold(self, rank: int, hashes: Iterable[Hashable]) -> None:
        """A request placed on ``rank`` will compute these blocks (routing counts them)."""
        held = self.held[rank]
        for h in hashes:
            held[h] = held.get(h, 0) + 1

    def release(self, rank: int, hashes: Iterable[Hashable]) -> None:
        """A request that held these blocks produced output, or ended without any."""
        held = self.held[rank]
        for h in hashes:
            count = held.get(h, 0) - 1
            if count > 0:
                held[h] = count
            else:
                held.pop(h, None)

    def clear(self) -> None:
        """Every rank's prefix cache was reset."""
        for blocks, held in zip(self.ranks, self.held, strict=True):
            blocks.clear()
            held.clear()

    def sizes(self) -> list[int]:
        """Computed block hashes held per rank."""
        return [len(blocks) for blocks in self.ranks]


@dataclasses.dataclass(slots=True)
class _Sequence:
    rank: int
    hashes: list[int]  # of its full blocks so far, the prompt's first
    tail: list[int]  # the tokens after the last full block
    seed: Hashable | None  # None: its output is not followed (hashes not ours to chain)
    held: list[Hashable]  # its prompt's blocks, held on its rank until it computes them
    computed: bool = False  # it produced output: its prompt was computed


class PlacedSequences:
    """The requests placed with an ``ApproximateIndex``, followed as they generate: a
    request's prompt blocks are held on its rank until it produces output (then they are
    recorded as computed; a request that ends with none, aborted while it waited, records
    nothing), and when it ends the blocks its output filled join its prompt's on its rank
    (a multi-turn conversation's next prompt is the last one, its answer and a new
    message).

    vLLM caches a request's full blocks of computed tokens, which at its end are all its
    tokens but the last sampled one (never fed back): a block is hashed once a token follows
    it, so at most one block of tokens is held per request. Output is followed up to
    ``max_blocks`` blocks (the routing's ``max_prefix_blocks``), for at most ``kept``
    requests at a time (the oldest forgotten: a request whose end never came, such as one
    the engine refused)."""

    def __init__(
        self,
        index: ApproximateIndex,
        block_size: int,
        max_blocks: int | None = None,
        kept: int = 100_000,
    ):
        self.index = index
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.kept = kept
        self._sequences: collections.OrderedDict[str, _Sequence] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._sequences)

    def start(
        self,
        request_id: str,
        rank: int,
        prompt: Sequence[int],
        hashes: list[Hashable],
        seed: Hashable | None,
    ) -> None:
        """Follow a request placed on ``rank``: its prompt and the prompt's block hashes
        (``chained_block_hashes`` from ``seed``; None: hashes of another kind, vLLM's, whose
        output blocks are not followed), held on the rank until it computes them. A prompt
        whose hashes stopped at the limit has no output blocks to add."""
        if not 0 <= rank < len(self.index.ranks):
            return
        size = self.block_size
        grows = (
            seed is not None
            and size > 0
            and len(hashes) == len(prompt) // size
            and not self._full(hashes)
        )
        tail = list(prompt[len(hashes) * size :]) if grows else []
        self.index.hold(rank, hashes)
        self._sequences[request_id] = _Sequence(
            rank, list(hashes), tail, seed if grows else None, list(hashes)
        )
        if len(self._sequences) > self.kept:
            _, oldest = self._sequences.popitem(last=False)
            self._forget(oldest)

    def split(self, request_id: str, sample_ids: Sequence[str]) -> None:
        """A followed request became these samples, each generating on the same rank."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        for _ in sample_ids[1:]:  # each sample holds the prompt until it computes it
            self.index.hold(sequence.rank, sequence.held)
        for sample_id in sample_ids:
            self._sequences[sample_id] = dataclasses.replace(
                sequence, hashes=list(sequence.hashes), tail=list(sequence.tail)
            )

    def observe(self, outputs: Iterable[Any]) -> None:
        """One engine step's outputs (``request_id``, ``new_token_ids``, ``finish_reason``):
        a followed request's first output records its prompt as computed, its new tokens
        join its tail (outputs of requests not followed are skipped), and those that
        finished ``end``. Runs for every output of every step, so it is one loop with
        little else in it."""
        sequences, size = self._sequences, self.block_size
        for out in outputs:
            sequence = sequences.get(out.request_id)
            if sequence is None:
                continue
            if not sequence.computed:
                self._computed(sequence)
            if sequence.seed is not None:
                tail = sequence.tail
                tail += out.new_token_ids
                if len(tail) > size:
                    self._hash_computed_blocks(sequence)
            if out.finish_reason is not None:
                self.end(out.request_id)

    def _computed(self, sequence: _Sequence) -> None:
        sequence.computed = True
        self.index.release(sequence.rank, sequence.held)
        self.index.record(sequence.rank, sequence.held)

    def _hash_computed_blocks(self, sequence: _Sequence) -> None:
        """Hash the tail's blocks that a token follows (computed, so cached), keep the rest."""
        size, tail = self.block_size, sequence.tail
        full = (len(tail) - 1) // size
        after = sequence.hashes[-1] if sequence.hashes else None
        limit = None if self.max_blocks is None else self.max_blocks - len(sequence.hashes)
        sequence.hashes += chained_block_hashes(
            tail[: full * size], size, sequence.seed, limit, after
        )
        del tail[: full * size]
        if self._full(sequence.hashes):
            tail.clear()
            sequence.seed = None  # nothing more to add

    def end(self, request_id: str) -> None:
        """A followed request ended (finished or aborted): the blocks it computed, prompt
        and output, are recorded on its rank; one that computed nothing records nothing."""
        sequence = self._sequences.pop(request_id, None)
        if sequence is None:
            return
        if sequence.computed:
            self.index.record(sequence.rank, sequence.hashes)
        else:
            self.index.release(sequence.rank, sequence.held)

    def _forget(self, sequence: _Sequence) -> None:
        if not sequence.computed:
            self.index.release(sequence.rank, sequence.held)

    def clear(self) -> None:
        """Forget every request followed (the prefix caches were dropped)."""
        self._sequences.clear()

    def _full(self, hashes: list[Hashable]) -> bool:
        return self.max_blocks is not None and len(hashes) >= self.max_blocks
