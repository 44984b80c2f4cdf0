"""Which prompt blocks each data-parallel rank holds in its prefix cache (sans-IO).

Fed by vLLM's KV cache events (``gateway.kv_event_feed`` reads them off the engines'
publishers): ``BlockStored`` adds block hashes, ``BlockRemoved`` drops them,
``AllBlocksCleared`` empties a rank. Each rank's batches carry a sequence number (per
publisher process, from 0): a jump forward is a gap (a batch lost, e.g. at the high-water
mark), a step back is a restarted engine. Either way the rank is *unsynced* until the feed
refilled the gap from the engine's replay buffer or cleared the rank and started over;
``matched_blocks`` reports no match on an unsynced rank, and routers fall back to load.

No vLLM import: events are decoded here from their msgpack form (vLLM's ``EventBatch``:
``[ts, [event maps tagged "type"], dp_rank]``), into ``KvEvent`` structs that take only the
fields the index reads; a block's token ids (most of a batch's bytes) stay undecoded msgpack
unless the block is kept for the hash check: a batch of 128 stored blocks of 128 tokens
decodes in about a quarter of the time of a generic decode (bench/probes/kv_feed_cost.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable
from typing import Any

import msgspec

__all__ = [
    "EventBatch",
    "KvEvent",
    "PrefixIndex",
    "RankIndex",
    "count_leading_blocks",
    "decode_batch",
]

BlockHash = int | bytes


class KvEvent(msgspec.Struct, gc=False):
    """One of vLLM's KV cache events, as published (a map tagged ``type``: ``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``; other types are kept and left out by the
    index). Fields it does not read are skipped; ``token_ids`` stays raw msgpack."""

    type: str = ""
    block_hashes: list[BlockHash] = []
    parent_block_hash: BlockHash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class EventBatch(msgspec.Struct, array_like=True):
    """vLLM's ``EventBatch`` (``vllm/distributed/kv_events.py``) as published."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_token_ids_decoder = msgspec.msgpack.Decoder(list[int])


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one published batch; raises msgspec.DecodeError on a malformed one."""
    return _batch_decoder.decode(payload)


@dataclasses.dataclass
class RankIndex:
    """One rank's cached block hashes and where its event stream stands."""

    # hash -> copies the rank holds: vLLM does not de-duplicate cached blocks (a request
    # that skips reading the cache stores a second copy), and evicts each copy on its own.
    blocks: dict = dataclasses.field(default_factory=dict)
    # The last batch applied: -1 before the first (a fresh engine's first batch is 0);
    # None after a reset (the next batch, whatever its number, starts over).
    last_seq: int | None = -1
    synced: bool = True  # every batch since the start or the last reset applied
    # The feed's SUB socket is connected to the rank's publisher (the feed sets it; an
    # index without a feed, as in unit tests, counts as connected). Not connected: the
    # rank's blocks are unknown, and it is matched as an unsynced rank (routing by load).
    connected: bool = True
    disconnects: int = 0  # the feed's connection to the publisher was lost
    # The gateway reset the rank's prefix cache (clear_all) and the rank's own
    # AllBlocksCleared has not come yet: blocks stored in batches still on their way from
    # before the reset are gone, and are not taken in.
    awaiting_clear: bool = False
    block_size: int | None = None  # from its BlockStored events
    events: int = 0
    gaps: int = 0  # sequence jumps forward (batches lost)
    restarts: int = 0  # sequence went back (a new publisher: the engine restarted)
    resets: int = 0  # cleared because a gap could not be refilled
    last_event_ts: float | None = None  # the engine's wall clock at its last batch
    lag_s: float = 0.0  # the feed's clock at receipt minus that stamp (the rank's feed lag)
    verified: bool | None = None  # a root block's hash checked against ours: None = not yet
    root_blocks_seen: list = dataclasses.field(default_factory=list)  # (hash, tokens, keys)


class PrefixIndex:
    """Per-rank block hashes from KV events, and prefix matches against them."""

    def __init__(self, ranks: int):
        self.ranks = [RankIndex() for _ in range(ranks)]

    # ------------------------------------------------------------ the event stream

    def check_sequence(self, rank: int, seq: int, live: bool = True) -> str:
        """Where batch ``seq`` of ``rank`` stands: "next" (apply it), "gap" (batches
        before it were lost: refill them first), "restart" (a live batch that went back:
        a new publisher, the engine restarted) or "old" (a replayed batch already applied)."""
        last = self.ranks[rank].last_seq
        if last is None:
            return "next"
        if seq == last + 1:
            return "next"
        if seq <= last:
            return "restart" if live else "old"
        return "gap"

    def apply(self, rank: int, seq: int, batch: EventBatch) -> None:
        """Apply batch ``seq`` of ``rank`` (in order: ``check_sequence`` said "next"). A
        batch that cannot be applied whole (an event of a shape this index does not know)
        resets the rank, as a lost batch would: its index is no longer what the rank
        holds, and half of a batch must not stand for all of it."""
        index = self.ranks[rank]
        try:
            self._apply_events(index, batch)
        except Exception:
            self.reset(rank)
            raise
        index.last_seq = seq
        index.last_event_ts = batch.ts

    @staticmethod
    def _apply_events(index: RankIndex, batch: EventBatch) -> None:
        blocks = index.blocks
        for event in batch.events:
            index.events += 1
            kind = event.type
            if kind == "BlockStored":
                if index.awaiting_clear:
                    continue  # published before the reset the gateway made
                if event.group_idx not in (None, 0):
                    continue  # hybrid models: route on the first KV cache group only
                if event.medium not in (None, "GPU"):
                    continue  # another tier (an offloading connector's CPU copies)
                hashes = event.block_hashes
                for h in hashes:
                    blocks[h] = blocks.get(h, 0) + 1
                index.block_size = event.block_size or index.block_size
                root = event.parent_block_hash is None and not event.lora_name
                if root and hashes and len(index.root_blocks_seen) < 8:
                    # Kept for the hash check (PrefixHasher.verify): the first block of
                    # a prompt, its tokens and untagged extra keys (the cache salt).
                    keys = (event.extra_keys or [None])[0]
                    raw = event.token_ids
                    tokens = _token_ids_decoder.decode(raw) if len(raw) else []
                    index.root_blocks_seen.append(
                        (hashes[0], tokens[: event.block_size or 0], keys)
                    )
            elif kind == "BlockRemoved":
                if event.group_idx not in (None, 0):
                    continue
                if event.medium not in (None, "GPU"):
                    continue
                for h in event.block_hashes:
                    copies = blocks.get(h, 0) - 1
                    if copies > 0:
                        blocks[h] = copies
                    else:
                        blocks.pop(h, None)
            elif kind == "AllBlocksCleared":
                index.blocks.clear()
                index.awaiting_clear = False

    def note_gap(self, rank: int) -> None:
        """Batches before the one in hand were lost: unsynced until refilled or reset."""
        self.ranks[rank].gaps += 1
        self.ranks[rank].synced = False

    def refilled(self, rank: int) -> None:
        """The gap was refilled from the replay buffer, in order."""
        self.ranks[rank].synced = True

    def reset(self, rank: int, restarted: bool = False) -> None:
        """Forget ``rank``'s blocks (a restart, or a gap the replay buffer could not
        refill); it is synced again from the next batch on (an under-estimate from then:
        blocks stored before are unknown until evicted or stored again)."""
        index = self.ranks[rank]
        index.blocks.clear()
        index.last_seq = None
        index.synced = True
        index.awaiting_clear = False  # a new stream: it has no clear of ours to send
        if restarted:
            index.restarts += 1
        else:
            index.resets += 1

    def clear_all(self) -> None:
        """Every rank's cache was reset (the gateway's own ResetPrefixCache): as an
        AllBlocksCleared on each, which vLLM publishes only with its next step. Until that
        event comes, stored blocks of batches published before the reset (still on their
        way, or replayed) are not taken in: they would undo the clear."""
        for index in self.ranks:
            index.blocks.clear()
            index.awaiting_clear = True

    # ------------------------------------------------------------ queries

    def matched_blocks(
        self, hashes: Iterable[BlockHash], max_blocks: int | None = None
    ) -> list[int | None]:
        """Per rank: how many of ``hashes`` (a prompt's chained block hashes, in order)
        it holds as a prefix, or None where the rank is unsynced or its feed is not
        connected (do not route on it).
        Takes no hash past the first that no synced rank holds, nor past ``max_blocks``
        (a lazy ``hashes`` is computed only that far)."""
        usable = [index.synced and index.connected for index in self.ranks]
        out: list[int | None] = [0 if ok else None for ok in usable]
        holding = [(rank, index.blocks) for rank, index in enumerate(self.ranks) if usable[rank]]
        count_leading_blocks(hashes, holding, out, max_blocks)  # type: ignore[arg-type]
        return out

    def size(self) -> int:
        return sum(len(index.blocks) for index in self.ranks)

    def block_size(self) -> int | None:
        for index in self.ranks:
            if index.block_size:
                return index.block_size
        return None


def count_leading_blocks(
    hashes: Iterable[Any],
    holding: list[tuple[int, Container[Any]]],
    out: list[int],
    max_blocks: int | None = None,
) -> None:
    """Add to ``out[rank]``, for each ``(rank, blocks)`` in ``holding``, how many of
    ``hashes`` (chained, in order) it holds as a prefix. Takes no hash past the first that
    none holds, nor past ``max_blocks`` (a lazy ``hashes`` is computed only that far)."""
    if not holding or max_blocks == 0:
        return
    for taken, h in enumerate(hashes, 1):
        holding = [(rank, blocks) for rank, blocks in holding if h in blocks]
        for rank, _ in holding:
            out[rank] += 1
        if not holding or taken == max_blocks:
            break
