"""The prefix index (sans-IO): vLLM's KV events in, per-rank prefix matches out."""

import msgspec

from gateway.prefix_index import EventBatch, KvEvent, PrefixIndex, decode_batch


def stored(hashes, parent=None, tokens=None, block_size=4, **more):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens or list(range(block_size * len(hashes))),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **more,
    }


def batch(*events, rank=0):
    """A batch as the feed gets it: vLLM's msgpack form, through the index's decoder."""
    return decode_batch(msgspec.msgpack.encode([1.0, list(events), rank]))


def test_stored_removed_and_cleared_shape_each_ranks_prefix_matches():
    index = PrefixIndex(2)
    index.apply(0, 0, batch(stored([11, 12, 13])))
    index.apply(1, 0, batch(stored([11]), rank=1))
    assert index.matched_blocks([11, 12, 13, 14]) == [3, 1]

    index.apply(0, 1, batch({"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}))
    assert index.matched_blocks([11, 12, 13]) == [1, 1]  # 13 is no use without 12
    index.apply(1, 1, batch({"type": "AllBlocksCleared"}, rank=1))
    assert index.matched_blocks([11]) == [1, 0]
    assert index.size() == 2 and index.block_size() == 4


def test_other_kv_cache_groups_and_unknown_events_are_left_out():
    index = PrefixIndex(1)
    index.apply(0, 0, batch(stored([5], group_idx=1), {"type": "SomethingNew"}, stored([7])))
    assert index.matched_blocks([7]) == [1]
    assert index.matched_blocks([5]) == [0]


def test_sequence_numbers_tell_next_gap_restart_and_old():
    index = PrefixIndex(1)
    assert index.check_sequence(0, 0) == "next"  # a fresh engine starts at 0
    assert index.check_sequence(0, 3) == "gap"
    index.apply(0, 0, batch(stored([1])))
    assert index.check_sequence(0, 1) == "next"
    assert index.check_sequence(0, 0) == "restart"  # live: the publisher started over
    assert index.check_sequence(0, 0, live=False) == "old"  # replayed twice


def test_an_unsynced_rank_matches_nothing_until_refilled_or_reset():
    index = PrefixIndex(2)
    index.apply(0, 0, batch(stored([1, 2])))
    index.note_gap(0)
    assert index.matched_blocks([1, 2]) == [None, 0]
    index.refilled(0)
    assert index.matched_blocks([1, 2]) == [2, 0]

    index.note_gap(0)
    index.reset(0)
    assert index.matched_blocks([1, 2]) == [0, 0]  # cleared, and synced again
    assert index.check_sequence(0, 57) == "next"  # after a reset, any batch starts over
    assert index.ranks[0].gaps == 2 and index.ranks[0].resets == 1
    index.reset(1, restarted=True)
    assert index.ranks[1].restarts == 1


def test_root_blocks_are_kept_for_the_hash_check_lora_blocks_are_not():
    index = PrefixIndex(1)
    tokens = list(range(8))
    index.apply(0, 0, batch(stored([9, 10], tokens=tokens, extra_keys=[("salt",), None])))
    index.apply(0, 1, batch(stored([20], parent=10, tokens=[1, 2, 3, 4])))  # not a root
    index.apply(0, 2, batch(stored([30], lora_name="ada")))  # events leave out its path
    assert index.ranks[0].root_blocks_seen == [(9, [0, 1, 2, 3], ["salt"])]


def test_a_batch_decodes_from_vllms_msgpack_form():
    # vLLM's EventBatch is array-like: [ts, [event maps tagged "type"], dp_rank].
    payload = msgspec.msgpack.encode([2.5, [stored([b"\x01" * 32])], 1])
    decoded = decode_batch(payload)
    assert decoded.ts == 2.5 and decoded.data_parallel_rank == 1
    index = PrefixIndex(2)
    index.apply(1, 0, decoded)
    assert index.matched_blocks([b"\x01" * 32]) == [0, 1]  # bytes hashes work as well


def test_a_block_stored_twice_stays_until_both_copies_are_evicted():
    """vLLM keeps a second copy of a block under the same hash (a request that skips
    reading the cache, e.g. with prompt_logprobs) and evicts each copy on its own."""
    index = PrefixIndex(1)
    index.apply(0, 0, batch(stored([1, 2]), stored([1, 2])))
    index.apply(0, 1, batch({"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}))
    assert index.matched_blocks([1, 2]) == [2]  # one copy of each is still held
    index.apply(0, 2, batch({"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "GPU"}))
    assert index.matched_blocks([1, 2]) == [0] and index.size() == 0


def test_events_of_another_medium_are_not_the_devices():
    index = PrefixIndex(1)
    index.apply(0, 0, batch(stored([1]), stored([2], medium="CPU")))
    assert index.matched_blocks([1]) == [1] and index.matched_blocks([2]) == [0]
    index.apply(0, 1, batch({"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}))
    assert index.matched_blocks([1]) == [1]  # the offloaded copy went, not the device's


def test_a_batch_that_cannot_be_applied_whole_resets_the_rank():
    """Half of a batch must not stand for all of it: the rank starts over (an under-
    estimate), its sequence not advanced past the batch."""
    import pytest

    index = PrefixIndex(1)
    index.apply(0, 0, batch(stored([1])))
    removed = KvEvent(type="BlockRemoved", block_hashes=5)  # not a list (unchecked here)
    broken = EventBatch(1.0, [*batch(stored([2])).events, removed], 0)
    with pytest.raises(TypeError):
        index.apply(0, 1, broken)
    rank = index.ranks[0]
    assert rank.resets == 1 and rank.last_seq is None and index.matched_blocks([1]) == [0]
    assert index.check_sequence(0, 2) == "next"


def test_a_batch_of_the_wrong_shape_is_refused_when_decoded():
    """The decoder checks what the index reads: such a batch counts as malformed (the
    feed then treats it as a lost batch); token ids are decoded only for a kept root."""
    import pytest

    for event in (
        {"type": "BlockRemoved", "block_hashes": 5},
        {"type": "BlockStored", "block_hashes": [1], "block_size": "four"},
    ):
        with pytest.raises(msgspec.ValidationError):
            batch(event)
    index = PrefixIndex(1)
    index.apply(0, 0, batch(stored([1], parent=7, tokens=["not", "ids"])))  # not kept
    assert index.matched_blocks([1]) == [1]
    with pytest.raises(msgspec.ValidationError):  # kept for the hash check: decoded
        index.apply(0, 1, batch(stored([2], tokens=["not", "ids"])))


def test_clear_all_and_removals_of_other_groups_and_the_latest_block_size():
    """Issue 51's surviving mutants: clear_all doing nothing, BlockRemoved of another KV
    cache group applied, the first event's block size kept."""
    index = PrefixIndex(2)
    index.apply(0, 0, batch(stored([1], block_size=4)))
    index.apply(0, 1, batch({"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1}))
    assert index.matched_blocks([1]) == [1, 0]  # another group's removal: not this block
    index.apply(1, 0, batch(stored([2], block_size=8), rank=1))
    index.apply(0, 2, batch(stored([3], block_size=8)))
    assert index.ranks[0].block_size == 8
    index.clear_all()
    assert index.matched_blocks([1]) == [0, 0] and index.matched_blocks([2]) == [0, 0]
    assert index.size() == 0


def test_matching_takes_no_hash_past_the_first_miss_on_every_rank_nor_past_the_cap():
    """Issue 51 item 16: a prompt's hashes are computed as matching takes them, and
    matching stops where no rank holds the block, or at the cap (ranks tie there)."""
    index = PrefixIndex(2)
    index.apply(0, 0, batch(stored([1, 2, 3, 4])))
    index.apply(1, 0, batch(stored([1, 2]), rank=1))
    taken = []

    def lazily(hashes):
        for h in hashes:
            taken.append(h)
            yield h

    assert index.matched_blocks(lazily([1, 2, 3, 9, 10, 11])) == [3, 2]
    assert taken == [1, 2, 3, 9]  # 9: no rank holds it; 10 and 11 never hashed
    taken.clear()
    assert index.matched_blocks(lazily([1, 2, 3, 4]), max_blocks=2) == [2, 2]
    assert taken == [1, 2]
    taken.clear()
    assert index.matched_blocks(lazily([5, 6])) == [0, 0] and taken == [5]
    index.ranks[0].synced = index.ranks[1].synced = False
    assert index.matched_blocks(lazily([1])) == [None, None] and taken == [5]


def test_batches_from_before_a_reset_cannot_undo_its_clear():
    """Issue 51 item 22: the gateway clears the index when ResetPrefixCache succeeds, but
    batches published before the reset may arrive after; vLLM's own AllBlocksCleared
    comes with the rank's next step. Until then nothing stored is taken in."""
    index = PrefixIndex(2)
    index.apply(0, 0, batch(stored([1, 2])))
    index.clear_all()
    index.apply(0, 1, batch(stored([3, 4])))  # in flight across the reset
    index.apply(1, 0, batch(stored([5]), rank=1))
    assert index.matched_blocks([3, 4]) == [0, 0] and index.matched_blocks([5]) == [0, 0]
    # The rank's next step: its AllBlocksCleared, then what that step stored.
    index.apply(0, 2, batch({"type": "AllBlocksCleared"}, stored([6, 7])))
    assert index.matched_blocks([6, 7]) == [2, 0]
    index.apply(0, 3, batch(stored([8])))
    assert index.matched_blocks([8]) == [1, 0]
    index.reset(1, restarted=True)  # a restarted engine sends no clear of ours
    index.apply(1, 0, batch(stored([9]), rank=1))
    assert index.matched_blocks([9]) == [0, 1]


def test_at_most_eight_root_blocks_are_kept_and_a_disconnected_rank_matches_nothing():
    """Mutants the suite let live (issue 67): the bound of 8 on the hash check's samples
    (every prompt's first block would be kept for good), and ``connected`` ignored (a
    rank whose feed is down would be routed on blocks it may have evicted since)."""
    index = PrefixIndex(2)
    for seq in range(20):
        index.apply(0, seq, batch(stored([100 + seq], tokens=[seq] * 4)))
    assert len(index.ranks[0].root_blocks_seen) == 8
    index.apply(1, 0, batch(stored([100]), rank=1))
    assert index.matched_blocks([100]) == [1, 1]
    index.ranks[1].connected = False
    assert index.matched_blocks([100]) == [1, None]
    index.ranks[0].connected = False
    assert index.matched_blocks([100]) == [None, None]
