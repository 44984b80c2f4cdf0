"""Prefix-cache-aware routing on the real CPU engine: two data-parallel ranks (one core
each), 32-token blocks (the CPU attention's smallest), vLLM's KV events on
(``--routing cache``), a 64-block cache per rank so that eviction comes soon.

Which rank holds what is read from PrefixQuery (the gateway's index of the engines'
events) and checked against vLLM's own ``cached_tokens`` of the next request.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from client import AsyncClient, GatewayPool, RequestFailed, RequestOptions, SamplingParams
from gateway.routing import RoutingConfig
from tests.conftest import cpu_engine_args, running_gateway
from tests.gateway.test_data_parallel import ONE_CORE_PER_RANK, environment

pytestmark = pytest.mark.engine

BLOCK = 32
CACHE_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
async def routed():
    """A gateway routing by cache over two ranks, control calls open."""
    from gateway.auth import ControlPolicy
    from gateway.vllm import VllmEngine, enable_kv_events

    args = cpu_engine_args(
        data_parallel_size=2, block_size=BLOCK, num_gpu_blocks_override=CACHE_BLOCKS
    )
    enable_kv_events(args)
    with environment(ONE_CORE_PER_RANK):
        engine = await VllmEngine.start(args, routing=RoutingConfig("cache"))
    try:
        async with running_gateway(engine, control=ControlPolicy(open=True)) as gateway:
            yield gateway
    finally:
        await engine.aclose()


@pytest.fixture
async def client(routed):
    async with AsyncClient(routed.addresses[0], name="routing") as c:
        yield c


_rng = random.Random(40)


def fresh_prompt(blocks: int, extra: int = 5) -> list[int]:
    """A prompt no other test shares: ``blocks`` full blocks plus ``extra`` tokens."""
    return [_rng.randrange(4, 500) for _ in range(blocks * BLOCK + extra)]


async def settled(client: AsyncClient, prompt, want, options=None, timeout=10.0) -> list:
    """PrefixQuery until ``want(matched_tokens)``: events reach the index a moment after
    the request's output."""
    matched: list = []
    async with asyncio.timeout(timeout):
        while True:
            matched = (await client.prefix_query(prompt, options)).matched_tokens
            if want(matched):
                return matched
            await asyncio.sleep(0.02)


def holder(matched: list) -> int:
    """The one rank that holds the prompt."""
    (rank,) = [r for r, tokens in enumerate(matched) if tokens]
    return rank


async def test_the_gateways_hash_of_a_prompt_is_the_one_the_engine_published(client, routed):
    engine = routed.engine
    prompt = fresh_prompt(4)
    await client.complete(prompt, GREEDY)
    matched = await settled(client, prompt, lambda m: any(m))
    rank = engine.prefix_index.ranks[holder(matched)]

    ours = engine.prompt_block_hashes(prompt)
    assert len(ours) == 4 and all(isinstance(h, int) for h in ours)
    assert set(ours) <= rank.blocks.keys()  # BlockStored carried exactly these hashes
    assert rank.verified is True  # and the feed's own check of a root block agreed
    # vLLM reuses whole blocks and always computes the last token.
    assert matched[holder(matched)] == 4 * BLOCK


async def test_a_shared_prefix_follows_its_rank_and_vllm_reports_the_predicted_hit(client, routed):
    engine = routed.engine
    decisions = engine.router.decisions
    accuracy = engine.routing_accuracy
    ranks_seen = set()
    for _ in range(4):
        prefix = fresh_prompt(3, extra=0)
        await client.complete(prefix + [7] * 9, GREEDY)
        extended = prefix + [8] * 40
        matched = await settled(client, extended, lambda m: any(m))
        rank = holder(matched)
        ranks_seen.add(rank)
        matched_before = decisions["matched"]
        exact_before = accuracy.exact

        done = await client.complete(extended, GREEDY)

        assert done.cached_tokens == matched[rank] == 3 * BLOCK
        assert decisions["matched"] == matched_before + 1
        assert accuracy.exact == exact_before + 1
        # Its new blocks were stored on the same rank: the longer prompt is there alone.
        after = await settled(client, extended, lambda m, r=rank: m[r] == 4 * BLOCK)
        assert after[1 - rank] == 0
    assert ranks_seen == {0, 1}  # fresh prompts went by load: both ranks served


async def test_a_request_with_prompt_logprobs_is_not_routed_as_a_hit(client, routed):
    """vLLM reads no cached block for it: no rank matches, no hit is predicted, and vLLM
    indeed reports none."""
    prompt = fresh_prompt(3)
    await client.complete(prompt, GREEDY)
    await settled(client, prompt, lambda m: any(m))
    decisions = dict(routed.engine.router.decisions)
    exact = routed.engine.routing_accuracy.exact
    with_logprobs = msgspec.structs.replace(GREEDY, prompt_logprobs=1)

    done = await client.complete(prompt, with_logprobs)

    assert done.cached_tokens == 0
    assert routed.engine.router.decisions["matched"] == decisions.get("matched", 0)
    assert routed.engine.routing_accuracy.exact == exact + 1  # predicted 0, got 0


async def test_the_samples_of_an_n_request_are_each_predicted_as_vllm_reports(client, routed):
    """n samples of one prompt go to one rank; the first computes the prompt, and vLLM
    reports the others reusing its whole blocks: the prediction says so for each."""
    accuracy = routed.engine.routing_accuracy
    before = (accuracy.requests, accuracy.exact, accuracy.cached_tokens)
    prompt = fresh_prompt(3)  # 101 tokens: 3 whole blocks reusable
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True, n=4)

    await client.complete_samples(prompt, sampled)

    assert accuracy.requests - before[0] == 4
    assert accuracy.cached_tokens - before[2] == 3 * 3 * BLOCK  # siblings 2-4, whole blocks
    assert accuracy.exact - before[1] == 4


async def test_a_pinned_request_is_placed_where_asked(client, routed):
    prompt = fresh_prompt(3)
    await client.complete(prompt, GREEDY)
    rank = holder(await settled(client, prompt, lambda m: any(m)))
    decisions = dict(routed.engine.router.decisions)

    done = await client.complete(
        prompt, GREEDY, options=RequestOptions(data_parallel_rank=1 - rank)
    )

    assert done.cached_tokens == 0  # the other rank computed it from scratch
    assert dict(routed.engine.router.decisions) == decisions  # no routing decision made
    both = await settled(client, prompt, lambda m: all(m))
    assert both == [3 * BLOCK, 3 * BLOCK]


async def test_reset_prefix_cache_clears_the_index_through_all_blocks_cleared(client, routed):
    prompt = fresh_prompt(2)
    await client.complete(prompt, GREEDY)
    await settled(client, prompt, lambda m: any(m))

    await client.reset_prefix_cache()

    assert await settled(client, prompt, lambda m: not any(m)) == [0, 0]
    assert routed.engine.prefix_index.size() == 0
    done = await client.complete(prompt, GREEDY)
    assert done.cached_tokens == 0  # as the index said


async def test_eviction_under_cache_pressure_reaches_the_index(client, routed):
    first = fresh_prompt(6)
    pin = RequestOptions(data_parallel_rank=0)
    await client.complete(first, GREEDY, options=pin)
    await settled(client, first, lambda m: m[0] == 6 * BLOCK)
    # 12 more prompts of 7 blocks each on rank 0: far past its 64 blocks.
    for _ in range(12):
        await client.complete(fresh_prompt(6), GREEDY, options=pin)

    matched = await settled(client, first, lambda m: m[0] < 6 * BLOCK)
    done = await client.complete(first, GREEDY, options=pin)
    assert done.cached_tokens == matched[0]  # what BlockRemoved left, vLLM found


async def test_a_lost_batch_is_refilled_from_the_engines_replay_socket(client, routed):
    engine = routed.engine
    feed, index = engine.kv_feed, engine.prefix_index
    publisher = engine._client.get_kv_event_sources()[0].endpoint
    pin = RequestOptions(data_parallel_rank=0)
    replayed, gaps = feed.replayed, index.ranks[0].gaps

    feed.sub.disconnect(publisher)  # a subscriber that fell behind: batches lost
    lost = fresh_prompt(3)
    await client.complete(lost, GREEDY, options=pin)
    await asyncio.sleep(0.3)
    feed.sub.connect(publisher)
    async with asyncio.timeout(10):  # the next batch shows the gap; the replay fills it
        while index.ranks[0].gaps == gaps:
            await client.complete(fresh_prompt(1), GREEDY, options=pin)
            await asyncio.sleep(0.05)

    matched = await settled(client, lost, lambda m: m[0] == 3 * BLOCK)
    assert feed.replayed > replayed and index.ranks[0].synced
    assert matched[0] == (await client.complete(lost, GREEDY)).cached_tokens


async def test_the_balance_guard_spreads_a_skewed_stream(client, routed):
    router = routed.engine.router
    prefix = fresh_prompt(4, extra=0)
    await client.complete(prefix + [1], GREEDY)
    rank = holder(await settled(client, prefix + [2], lambda m: any(m)))
    guarded = router.decisions["balance_guard"]
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

    # 40 requests at once, all sharing the prefix: cache alone would put all on `rank`.
    done = await asyncio.gather(
        *(client.complete(prefix + [i % 400 + 4] * 3, long) for i in range(40))
    )

    assert router.decisions["balance_guard"] > guarded
    after = (await client.prefix_query(prefix + [9])).matched_tokens
    assert after[1 - rank] == 4 * BLOCK  # the guard's requests stored the prefix there too
    assert all(c.output_tokens == 64 for c in done)


async def test_a_routing_key_keeps_an_episode_on_one_rank(client, routed):
    key = RequestOptions(routing_key="episode-40")
    holders = set()
    for _ in range(3):
        prompt = fresh_prompt(1)  # nothing cached: only the key can keep them together
        await client.complete(prompt, GREEDY, options=key)
        holders.add(holder(await settled(client, prompt, lambda m: any(m))))
    assert len(holders) == 1
    assert routed.engine.router.decisions["sticky"] >= 2


async def test_prefix_query_checks_the_prompt_as_a_generate(client):
    from client import ErrorCode, RequestFailed

    with pytest.raises(RequestFailed) as refused:
        await client.prefix_query([5, 10**6])
    assert refused.value.code == ErrorCode.INVALID_REQUEST
    with pytest.raises(RequestFailed) as empty:
        await client.prefix_query([])
    assert empty.value.code == ErrorCode.INVALID_REQUEST


async def test_a_gateway_pool_with_the_cache_policy_goes_where_the_prefix_is(
    client, routed, real_gateway
):
    cached_here = routed.addresses[0]
    prefix = fresh_prompt(3, extra=0)
    await client.complete(prefix + [3], GREEDY)
    await settled(client, prefix + [4], lambda m: any(m))

    addresses = [real_gateway.addresses[0], cached_here]
    async with GatewayPool(addresses, policy="cache") as cache_pool:
        gateways = []
        for i in range(4):
            stream = cache_pool.generate(prefix + [10 + i] * 2, GREEDY)
            outs = [o async for o in stream]
            gateways.append(stream.gateway)
            assert outs[-1].finished.cached_tokens == 3 * BLOCK
        assert gateways == [cached_here] * 4
        # A prompt no gateway holds goes by load (the pool's in-flight counts, rotating).
        spread = []
        for _ in range(4):
            stream = cache_pool.generate(fresh_prompt(1), GREEDY)
            _ = [o async for o in stream]
            spread.append(stream.gateway)
        assert set(spread) == set(addresses)


async def test_a_cache_salt_and_a_lora_name_are_part_of_what_prefix_query_matches(client):
    """vLLM hashes the salt into every block: a prompt stored under one salt matches only
    a query (and a request) with the same salt."""
    from client import ErrorCode, RequestFailed

    prompt = fresh_prompt(3)
    salted = RequestOptions(cache_salt="tenant-a")
    await client.complete(prompt, GREEDY, options=salted)
    matched = await settled(client, prompt, lambda m: any(m), salted)
    assert max(matched) == 3 * BLOCK
    assert (await client.prefix_query(prompt)).matched_tokens == [0, 0]
    other = RequestOptions(cache_salt="tenant-b")
    assert (await client.prefix_query(prompt, other)).matched_tokens == [0, 0]
    assert (await client.complete(prompt, GREEDY, options=other)).cached_tokens == 0
    with pytest.raises(RequestFailed) as refused:
        await client.prefix_query(prompt, RequestOptions(lora_name="no-such-adapter"))
    assert refused.value.code == ErrorCode.UNSUPPORTED


async def test_cache_isolation_keeps_each_clients_prefix_cache_its_own(routed):
    """Issue 51 item 16: under --cache-isolation one client's prompt is neither a hit nor
    visible to PrefixQuery for another client, whatever salt either sends; the client
    itself still hits it."""
    routed.table.cache_isolation = True
    try:
        address = routed.addresses[0]
        async with AsyncClient(address, name="a") as a, AsyncClient(address, name="b") as b:
            prompt = fresh_prompt(3)
            await a.complete(prompt, GREEDY)
            matched = await settled(a, prompt, lambda m: any(m))
            assert max(matched) == 3 * BLOCK
            assert (await b.prefix_query(prompt)).matched_tokens == [0, 0]
            assert (await b.complete(prompt, GREEDY)).cached_tokens == 0
            assert (await a.complete(prompt, GREEDY)).cached_tokens == 3 * BLOCK
    finally:
        routed.table.cache_isolation = False


async def test_the_approximate_index_routes_a_shared_prefix_by_what_the_gateway_placed(
    client, routed
):
    """``--routing-index approximate`` (the router swapped on this gateway, as
    bench/routing.py does): matches come from the prompts the gateway itself sent, with no
    event awaited; the second request of a prefix goes where the first went, vLLM reports
    the hit it predicted, a pinned request's prompt is noted on its rank, and a reset of
    the prefix cache forgets them."""
    from gateway.routing import Router

    engine = routed.engine
    events_router = engine.router
    engine.router = Router(2, RoutingConfig("cache", index="approximate"))
    try:
        ranks_seen = set()
        for _ in range(4):
            prefix = fresh_prompt(3, extra=0)
            await client.complete(prefix + [7] * 9, GREEDY)
            extended = prefix + [8] * 40
            # At once: the gateway recorded the placement when it made it.
            matched = (await client.prefix_query(extended)).matched_tokens
            rank = holder(matched)
            ranks_seen.add(rank)
            assert matched[rank] == 3 * BLOCK
            exact_before = engine.routing_accuracy.exact

            done = await client.complete(extended, GREEDY)

            assert done.cached_tokens == 3 * BLOCK
            assert engine.routing_accuracy.exact == exact_before + 1
            after = (await client.prefix_query(extended)).matched_tokens
            assert after == [4 * BLOCK if r == rank else 0 for r in range(2)]
        assert ranks_seen == {0, 1}  # fresh prompts went by load
        assert engine.router.decisions["matched"] == 4
        index = engine.approximate_index
        assert index.capacity_blocks == CACHE_BLOCKS  # each rank's own KV-cache blocks
        assert engine.routing_stats()["index"] == "approximate"
        assert engine.routing_stats()["index_blocks"] == index.sizes()
        # A pinned request is not routed, but its prompt is cached where it went: noted.
        pinned = fresh_prompt(2)
        await client.complete(pinned, GREEDY, options=RequestOptions(data_parallel_rank=1))
        assert (await client.prefix_query(pinned)).matched_tokens == [0, 2 * BLOCK]
        assert (await client.complete(pinned, GREEDY)).cached_tokens == 2 * BLOCK

        await client.reset_prefix_cache()

        assert index.sizes() == [0, 0]
        assert (await client.prefix_query(extended)).matched_tokens == [0, 0]
        # Pause with clear_cache: vLLM resets every rank's prefix cache; so does the index.
        await client.complete(pinned, GREEDY, options=RequestOptions(data_parallel_rank=0))
        assert (await client.prefix_query(pinned)).matched_tokens == [2 * BLOCK, 0]
        await client.pause("keep", clear_cache=True)
        await client.resume()
        assert (await client.prefix_query(pinned)).matched_tokens == [0, 0]
        again = await client.complete(pinned, GREEDY, options=RequestOptions(data_parallel_rank=0))
        assert again.cached_tokens == 0  # as vLLM reports it
    finally:
        engine.router = events_router


async def test_the_approximate_index_matches_a_conversations_next_turn_whole(client, routed):
    """The blocks a request's output filled join its prompt's when it ends, so the next
    turn (prompt, answer, a new message) is predicted whole, less the last sampled token,
    which vLLM never computes; vLLM reports that hit. Two answers of one prompt (n=2)
    are each followed."""
    from gateway.routing import Router

    engine = routed.engine
    events_router = engine.router
    engine.router = Router(2, RoutingConfig("cache", index="approximate"))
    try:
        prompt = fresh_prompt(1, extra=10)  # 42 tokens: 1 full block
        answer = await client.complete(
            prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        )
        turn = prompt + answer.token_ids + [9] * 20  # 101 tokens computed: 3 blocks
        matched = (await client.prefix_query(turn)).matched_tokens
        rank = holder(matched)
        assert matched[rank] == 3 * BLOCK
        exact_before = engine.routing_accuracy.exact

        assert (await client.complete(turn, GREEDY)).cached_tokens == 3 * BLOCK
        assert engine.routing_accuracy.exact == exact_before + 1

        sampled = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=40, ignore_eos=True)
        samples = await client.complete_samples(prompt, sampled)
        for sample in samples:  # 82 tokens computed each: 2 blocks, the second its own
            extended = prompt + sample.token_ids + [9]
            assert (await client.prefix_query(extended)).matched_tokens[rank] == 2 * BLOCK
        assert not engine.placed_sequences  # every request it followed has ended
        # A request refused (seed + n - 1 past int64) is placed nowhere, and not followed.
        refused = fresh_prompt(2)
        with pytest.raises(RequestFailed, match="seed"):
            overflow = SamplingParams(n=2, seed=2**63 - 1, max_tokens=2)
            await client.complete_samples(refused, overflow)
        assert (await client.prefix_query(refused)).matched_tokens == [0, 0]
        assert not engine.placed_sequences
    finally:
        engine.router = events_router
