"""The approximate prefix index: what the gateway placed on each rank (sans-IO)."""

from __future__ import annotations

from types import SimpleNamespace as Output

import pytest

from gateway.approximate_index import ApproximateIndex, PlacedSequences, chained_block_hashes


def test_a_prompt_placed_on_a_rank_matches_there_as_a_prefix_and_nowhere_else():
    # Hashes are chained (each names its parent's), so a block's hash is its whole prefix.
    index = ApproximateIndex(2, capacity_blocks=100)
    index.record(1, ["a", "b", "c"])
    assert index.matched_blocks(["a", "b", "c", "d"]) == [0, 3]
    assert index.matched_blocks(["a", "x", "c"]) == [0, 1]  # a chain: stops at a miss
    assert index.matched_blocks(["a", "b", "c"], max_blocks=2) == [0, 2]
    assert index.matched_blocks(["a"], max_blocks=0) == [0, 0]
    assert index.sizes() == [0, 3]


def test_matching_stops_hashing_at_the_first_block_no_rank_holds():
    index = ApproximateIndex(2, capacity_blocks=100)
    index.record(0, ["a"])
    taken = []

    def lazy():
        for h in ["a", "b", "c", "d"]:
            taken.append(h)
            yield h

    assert index.matched_blocks(lazy()) == [1, 0]
    assert taken == ["a", "b"]


def test_past_capacity_the_least_recently_routed_go_tail_first():
    """A rank holds at most its KV-cache blocks; a prompt's ends go before its root (as
    vLLM frees a request's blocks tail first), so what stays still matches."""
    index = ApproximateIndex(1, capacity_blocks=4)
    index.record(0, ["a1", "a2", "a3"])
    index.record(0, ["b1", "b2"])  # one over: a3, the oldest prompt's tail, goes
    assert index.matched_blocks(["a1", "a2", "a3"]) == [2]
    assert index.matched_blocks(["b1", "b2"]) == [2]
    index.record(0, ["a1", "a2"])  # used again: now the newest
    index.record(0, ["c1", "c2"])  # b2, then b1 go
    assert index.matched_blocks(["a1", "a2"]) == [2]
    assert index.matched_blocks(["b1"]) == [0]
    assert index.sizes() == [4]


def test_clear_forgets_every_rank():
    index = ApproximateIndex(2, capacity_blocks=10)
    index.record(0, ["a"])
    index.record(1, ["a"])
    index.clear()
    assert index.matched_blocks(["a"]) == [0, 0] and index.sizes() == [0, 0]


def test_at_least_one_rank_and_one_block():
    with pytest.raises(ValueError):
        ApproximateIndex(0, 10)
    assert ApproximateIndex(1, 0).capacity_blocks == 1


def test_chained_hashes_name_whole_prefixes_of_full_blocks():
    from gateway.approximate_index import chained_block_hashes

    tokens = list(range(100, 150))  # 3 full blocks of 16 and 2 tokens
    hashes = chained_block_hashes(tokens, 16, ("lora-a", None))
    assert len(hashes) == 3 and len(set(hashes)) == 3
    # The same prefix, whatever follows: the same chain as far as it goes.
    assert chained_block_hashes(tokens[:33] + [7] * 20, 16, ("lora-a", None))[:2] == hashes[:2]
    # One token changed in the first block changes every hash after it.
    changed = [999] + tokens[1:]
    assert not set(chained_block_hashes(changed, 16, ("lora-a", None))) & set(hashes)
    # Another LoRA or cache salt: another chain.
    assert chained_block_hashes(tokens, 16, ("lora-b", None))[0] != hashes[0]
    assert chained_block_hashes(tokens, 16, ("lora-a", "salt"))[0] != hashes[0]
    assert chained_block_hashes(tokens, 16, ("lora-a", None), limit=2) == hashes[:2]
    assert chained_block_hashes(tokens[:15], 16, None) == []
    assert chained_block_hashes(tokens, 0, None) == []


def test_each_index_draws_its_own_secret_for_the_seeds():
    """Hashes a client could predict could be crafted to collide in the index's tables: the
    seed holds a secret of each index, so the same prompt hashes apart in two of them."""
    from gateway.approximate_index import chained_block_hashes

    first, second = ApproximateIndex(1, 8), ApproximateIndex(1, 8)
    assert first.secret != second.secret
    tokens = list(range(32))
    assert chained_block_hashes(tokens, 16, (first.secret, None, None)) != chained_block_hashes(
        tokens, 16, (second.secret, None, None)
    )


def _placed(index, block, max_blocks=None):
    return PlacedSequences(index, block, max_blocks), ("seed",)


def _step(sequences, request_id, token_ids):
    """One engine step's new tokens for one request, handed over as the engine does."""
    sequences.observe([Output(request_id=request_id, new_token_ids=token_ids, finish_reason=None)])


def test_a_finished_requests_output_blocks_join_its_prompts_as_one_chain():
    """The next turn of a conversation (prompt + answer + more) matches the whole previous
    turn, less the last sampled token, which vLLM never computes."""
    index = ApproximateIndex(2, capacity_blocks=100)
    sequences, seed = _placed(index, 4)
    prompt = list(range(10))  # 2 full blocks and 2 tokens
    hashes = chained_block_hashes(prompt, 4, seed)
    index.record(1, hashes)
    sequences.start("r", 1, prompt, hashes, seed)
    _step(sequences, "r", [20, 21])  # block 3 full, but nothing after it yet
    _step(sequences, "r", [22])
    _step(sequences, "r", [23, 24, 25])  # 10 + 6 = 16 tokens: 3 blocks computed
    assert len(sequences) == 1
    sequences.end("r")
    assert len(sequences) == 0
    next_turn = prompt + [20, 21, 22, 23, 24, 25, 30, 31, 32]
    assert index.matched_blocks(chained_block_hashes(next_turn, 4, seed)) == [0, 3]
    # Tokens of another answer match up to where they differ.
    other = prompt + [99, 21, 22, 23, 24, 25]
    assert index.matched_blocks(chained_block_hashes(other, 4, seed)) == [0, 2]


def test_samples_each_follow_their_own_output_and_an_abort_records_what_was_computed():
    index = ApproximateIndex(1, capacity_blocks=100)
    sequences, seed = _placed(index, 2)
    prompt = [1, 2, 3]
    sequences.start("r", 0, prompt, chained_block_hashes(prompt, 2, seed), seed)
    sequences.split("r", ["r-0", "r-1"])
    _step(sequences, "r-0", [10, 11, 12])
    _step(sequences, "r-1", [20, 21, 22])
    sequences.end("r-0")
    sequences.end("r-1")  # (the engine's abort: the same record)
    for answer in ([10, 11, 12], [20, 21, 22]):
        turn = prompt + answer
        assert index.matched_blocks(chained_block_hashes(turn, 2, seed)) == [2]
    sequences.end("unknown")  # not followed: nothing happens


def test_following_stops_at_the_block_limit_and_forgets_the_oldest_past_kept():
    index = ApproximateIndex(1, capacity_blocks=100)
    sequences = PlacedSequences(index, 2, max_blocks=3, kept=2)
    seed = ("seed",)
    capped = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks, hashed to the limit of 3
    sequences.start("capped", 0, capped, chained_block_hashes(capped, 2, seed, 3), seed)
    _step(sequences, "capped", [9, 10, 11, 12])  # its prompt computed; no output followed
    sequences.end("capped")
    assert index.sizes() == [3]
    index.clear()
    prompt = [1, 2, 3]
    sequences.start("a", 0, prompt, chained_block_hashes(prompt, 2, seed, 3), seed)
    _step(sequences, "a", list(range(10, 20)))
    sequences.end("a")
    assert index.sizes() == [3]
    for name in ("x", "y", "z"):
        sequences.start(name, 0, [5], [], seed)
    assert len(sequences) == 2  # "x", the oldest, forgotten
    sequences.clear()
    assert len(sequences) == 0


def test_a_steps_outputs_extend_their_requests_and_a_finish_records_them():
    index = ApproximateIndex(2, capacity_blocks=100)
    sequences, seed = _placed(index, 2)
    prompt = [1, 2, 3]
    sequences.start("a", 0, prompt, chained_block_hashes(prompt, 2, seed), seed)
    sequences.start("b", 1, prompt, chained_block_hashes(prompt, 2, seed), seed)
    sequences.observe(
        [
            Output(request_id="a", new_token_ids=[4, 5], finish_reason=None),
            Output(request_id="other", new_token_ids=[9], finish_reason="stop"),
            Output(request_id="b", new_token_ids=[6], finish_reason=None),
        ]
    )
    sequences.observe([Output(request_id="a", new_token_ids=[6], finish_reason="length")])
    assert len(sequences) == 1  # "b" goes on
    answered = chained_block_hashes([1, 2, 3, 4, 5, 6, 7], 2, seed)
    assert index.matched_blocks(answered) == [2, 1]  # 5 of 6 tokens computed: 2 blocks
    # "b" produced output: its prompt's block was computed on rank 1.


def test_a_placed_prompt_is_held_for_routing_and_cached_only_once_computed():
    """Until a request produces output its prompt's blocks are held on its rank: routing
    counts them (a burst of one prefix goes to one rank), PrefixQuery does not; a request
    aborted before it ran records nothing (issue 67 item 4)."""
    index = ApproximateIndex(2, capacity_blocks=100)
    sequences, seed = _placed(index, 2)
    prompt = [1, 2, 3, 4, 5]
    hashes = chained_block_hashes(prompt, 2, seed)
    sequences.start("a", 1, prompt, hashes, seed)
    assert index.matched_blocks(hashes) == [0, 2]
    assert index.matched_blocks(hashes, held=False) == [0, 0]
    sequences.end("a")  # aborted while it waited: nothing computed
    assert index.matched_blocks(hashes) == [0, 0] and index.held == [{}, {}]
    sequences.start("b", 1, prompt, hashes, seed)
    sequences.start("c", 1, prompt, hashes, seed)  # the same prompt, twice held
    _step(sequences, "b", [6])
    assert index.matched_blocks(hashes, held=False) == [0, 2]
    sequences.end("c")  # c never ran, but b computed the blocks: still cached
    assert index.matched_blocks(hashes, held=False) == [0, 2]
    assert index.held == [{}, {}]
    # Samples each hold the prompt until each computes it or ends.
    other = [9, 8, 7]
    other_hashes = chained_block_hashes(other, 2, seed)
    sequences.start("n", 0, other, other_hashes, seed)
    sequences.split("n", ["n-0", "n-1"])
    assert len(sequences) == 3  # b, n-0, n-1: the parent is gone
    sequences.end("n-0")
    assert index.matched_blocks(other_hashes) == [1, 0]  # n-1 still holds it
    sequences.end("n-1")
    assert index.matched_blocks(other_hashes) == [0, 0]


def test_a_request_forgotten_past_kept_releases_what_it_held():
    index = ApproximateIndex(1, capacity_blocks=100)
    sequences = PlacedSequences(index, 2, kept=1)
    seed = ("seed",)
    first = chained_block_hashes([1, 2], 2, seed)
    sequences.start("old", 0, [1, 2], first, seed)
    sequences.start("new", 0, [3, 4], chained_block_hashes([3, 4], 2, seed), seed)
    assert index.matched_blocks(first) == [0]  # "old" forgotten: its hold released


def test_hashing_stops_at_the_limit_and_a_long_output_stays_within_it():
    """chained_block_hashes with limit 0 hashes nothing; a followed request's hashes never
    pass max_blocks however long its output, and its tail is cut once hashed (bounded)."""
    assert chained_block_hashes([1, 2, 3, 4], 2, ("s",), limit=0) == []
    index = ApproximateIndex(1, capacity_blocks=1000)
    sequences = PlacedSequences(index, 2, max_blocks=4)
    seed = ("seed",)
    prompt = [1, 2, 3]
    sequences.start("r", 0, prompt, chained_block_hashes(prompt, 2, seed, 4), seed)
    followed = sequences._sequences["r"]
    for step in range(50):
        _step(sequences, "r", [10 + step, 11 + step, 12 + step])
        assert len(followed.hashes) <= 4
        assert len(followed.tail) <= 2 + 3  # at most a block waiting plus a step's tokens
    sequences.end("r")
    assert index.sizes() == [4]
    # The chain is the tokens' own: the next turn matches exactly the blocks computed.
    tokens = prompt + [t for step in range(50) for t in (10 + step, 11 + step, 12 + step)]
    assert index.matched_blocks(chained_block_hashes(tokens, 2, seed)) == [4]
    assert index.matched_blocks(chained_block_hashes(tokens[:7] + [0], 2, seed)) == [3]


def test_clear_drops_held_blocks_and_a_rank_out_of_range_is_not_followed():
    index = ApproximateIndex(2, capacity_blocks=100)
    sequences, seed = _placed(index, 2)
    hashes = chained_block_hashes([1, 2, 3], 2, seed)
    sequences.start("a", 1, [1, 2, 3], hashes, seed)
    index.clear()
    assert index.matched_blocks(hashes) == [0, 0]
    for rank in (-1, 2):
        sequences.start(f"r{rank}", rank, [1, 2, 3], hashes, seed)
        assert f"r{rank}" not in sequences._sequences


def test_a_block_is_hashed_as_soon_as_a_token_follows_it_even_of_size_one():
    """vLLM caches a block once a token follows it (it was computed): a tail one token
    past a block hashes that block at once; blocks of one token too."""
    index = ApproximateIndex(1, capacity_blocks=100)
    sequences, seed = _placed(index, 2)
    sequences.start("a", 0, [1, 2], chained_block_hashes([1, 2], 2, seed), seed)
    _step(sequences, "a", [3, 4, 5])  # tail [3, 4, 5]: the block [3, 4] has a token after it
    assert sequences._sequences["a"].hashes == chained_block_hashes([1, 2, 3, 4], 2, seed)
    ones = PlacedSequences(index, 1)
    assert chained_block_hashes([7], 1, seed) and chained_block_hashes([7], 1, seed, limit=1)
    ones.start("b", 0, [7], chained_block_hashes([7], 1, seed), seed)
    _step(ones, "b", [8, 9])
    assert ones._sequences["b"].hashes == chained_block_hashes([7, 8], 1, seed)
