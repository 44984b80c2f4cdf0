"""Rank choice for unpinned requests (sans-IO): each policy and the balance guard."""

import pytest

from gateway.routing import Router, RoutingConfig

BLOCK = 32


def cache_router(ranks=2, **config) -> Router:
    return Router(ranks, RoutingConfig("cache", **config))


def test_load_leaves_the_rank_to_vllm_and_round_robin_takes_turns():
    load = Router(2, RoutingConfig("load"))
    assert load.choose([3, 0], [0, 0], 128, BLOCK).rank is None
    turns = Router(3, RoutingConfig("round-robin"))
    assert [turns.choose(None, [0, 0, 0], 1, BLOCK).rank for _ in range(4)] == [0, 1, 2, 0]
    assert turns.decisions["round_robin"] == 4


def test_cache_goes_where_the_prefix_is_and_predicts_what_vllm_can_reuse():
    router = cache_router()
    decision = router.choose([0, 4], [1.0, 1.0], 4 * BLOCK, BLOCK)
    # 4 full blocks cached, but vLLM always computes the last token: 3 reusable.
    assert (decision.rank, decision.reason, decision.predicted_blocks) == (1, "matched", 3)


def test_load_outweighs_a_small_match_by_the_documented_cost():
    # cost = load - prefix_weight * matched / blocks: rank 1 holds 1 of 8 blocks
    # (worth 4 * 1/8 = 0.5 of load) but has 2 more requests queued.
    router = cache_router(prefix_weight=4.0)
    decision = router.choose([0, 1], [0.0, 2.0], 8 * BLOCK + 1, BLOCK)
    assert (decision.rank, decision.reason) == (0, "load")
    decision = router.choose([0, 8], [0.0, 2.0], 8 * BLOCK + 1, BLOCK)
    assert (decision.rank, decision.reason) == (1, "matched")  # 8/8 is worth 4


def test_the_balance_guard_moves_a_request_off_an_overloaded_rank():
    router = cache_router(prefix_weight=100.0, guard_ratio=1.5, guard_slack=8.0)
    assert router.choose([4, 0], [20.0, 8.0], 5 * BLOCK, BLOCK).rank == 0  # 20 <= 1.5*8+8
    decision = router.choose([4, 0], [21.0, 8.0], 5 * BLOCK, BLOCK)
    assert (decision.rank, decision.reason, decision.predicted_blocks) == (1, "balance_guard", 0)


def test_a_routing_key_sticks_while_no_rank_holds_the_prompt():
    router = cache_router()
    first = router.choose([0, 0], [3.0, 1.0], 40, BLOCK, routing_key="episode-7")
    assert (first.rank, first.reason) == (1, "load")
    again = router.choose([0, 0], [0.0, 2.0], 40, BLOCK, routing_key="episode-7")
    assert (again.rank, again.reason) == (1, "sticky")
    other = router.choose([0, 0], [0.0, 2.0], 40, BLOCK, routing_key="episode-8")
    assert other.rank == 0


def test_sticky_keys_are_bounded():
    router = cache_router(sticky_keys=2)
    for key in ("a", "b", "c"):
        router.choose([0, 0], [0.0, 0.0], 40, BLOCK, routing_key=key)
    assert list(router._sticky) == ["b", "c"]


def test_one_clients_keys_cannot_push_out_anothers():
    """Issue 51 item 22: the gateway prefixes each client's keys with its identity; each
    client keeps at most sticky_keys_per_client, so a flood of one client's keys evicts
    only its own."""
    router = cache_router(sticky_keys=100, sticky_keys_per_client=3)
    router.choose([0, 0], [0.0, 5.0], 40, BLOCK, routing_key="alice:episode")
    for i in range(50):
        router.choose([0, 0], [5.0, 0.0], 40, BLOCK, routing_key=f"mallory:{i}")
    assert "alice:episode" in router._sticky
    assert [k for k in router._sticky if k.startswith("mallory:")] == [
        "mallory:47", "mallory:48", "mallory:49"
    ]  # fmt: skip
    decision = router.choose([0, 0], [1.0, 0.0], 40, BLOCK, routing_key="alice:episode")
    assert (decision.rank, decision.reason) == (0, "sticky")


@pytest.mark.parametrize("matched", [None, [None, None]])
def test_no_synced_index_falls_back_to_load_and_is_counted(matched):
    router = cache_router()
    decision = router.choose(matched, [5.0, 1.0], 4 * BLOCK, BLOCK)
    assert (decision.rank, decision.reason) == (1, "fallback")
    assert router.decisions == {"fallback": 1}


def test_one_unsynced_rank_leaves_the_others_matches_in_use():
    """Issue 51 item 22: a rank catching up on its events (its blocks unknown, counted as
    none) no longer sends every request by load: a prefix on a synced rank still wins."""
    router = cache_router(ranks=3)
    decision = router.choose([None, 0, 3], [0.0, 0.0, 1.0], 4 * BLOCK, BLOCK)
    assert (decision.rank, decision.reason, decision.predicted_blocks) == (2, "matched", 3)
    decision = router.choose([3, None, 0], [1.0, 0.0, 0.0], 4 * BLOCK, BLOCK)
    assert (decision.rank, decision.reason) == (0, "matched")
    # Nothing matched on the synced ranks: by load, the unsynced rank included.
    assert router.choose([None, 0, 0], [0.0, 2.0, 1.0], 4 * BLOCK, BLOCK).rank == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing policy"):
        RoutingConfig("fastest")


def test_load_ties_go_in_turn_as_vllm_rotates_them():
    router = cache_router(ranks=3)
    ranks = [router.choose([0, 0, 0], [0.0, 0.0, 0.0], 40, BLOCK).rank for _ in range(4)]
    assert ranks == [0, 1, 2, 0]
    # A turn passes only when a tie was broken by it: hits in between leave it.
    assert router.choose([0, 0, 2], [0.0, 0.0, 0.0], 100, BLOCK).rank == 2
    assert router.choose([0, 0, 0], [0.0, 0.0, 0.0], 40, BLOCK).rank == 1


def test_tied_matches_go_to_the_less_loaded_then_in_turn():
    """Issue 51's surviving mutants: ties ignoring load, no rotation among tied matches."""
    router = cache_router()
    assert router.choose([4, 4], [3.0, 1.0], 5 * BLOCK, BLOCK).rank == 1  # equal hits: load
    first = router.choose([4, 4], [1.0, 1.0], 5 * BLOCK, BLOCK).rank
    router.choose([0, 0], [1.0, 1.0], 5 * BLOCK, BLOCK)  # a load decision: the turn passes
    second = router.choose([4, 4], [1.0, 1.0], 5 * BLOCK, BLOCK).rank
    assert first != second  # equal hits, equal load: where the turn stands


def test_a_match_beats_a_routing_key_and_a_guard_decision_moves_the_key():
    router = cache_router(prefix_weight=100.0, guard_ratio=1.5, guard_slack=8.0)
    router.choose([0, 0], [0.0, 1.0], 5 * BLOCK, BLOCK, routing_key="k")  # k -> rank 0
    matched = router.choose([0, 4], [0.0, 1.0], 5 * BLOCK, BLOCK, routing_key="k")
    assert (matched.rank, matched.reason) == (1, "matched")  # the cache, not the key
    guarded = router.choose([4, 0], [30.0, 1.0], 5 * BLOCK, BLOCK, routing_key="k")
    assert (guarded.rank, guarded.reason) == (1, "balance_guard")
    assert router._sticky["k"] == 1  # the key follows where its request went


def test_a_prompt_cached_to_the_hashing_cap_counts_as_a_whole_hit():
    """Matching looks at max_prefix_blocks blocks at most: the share of the prompt cached
    is over those, so a long prompt's hit is not undervalued against load."""
    router = Router(2, RoutingConfig("cache", max_prefix_blocks=4))
    # 100 blocks, the first 4 (the cap) on rank 0; rank 0 busier by 6 (< prefix_weight 16).
    decision = router.choose([4, 0], [6.0, 0.0], 100 * BLOCK, BLOCK)
    assert (decision.rank, decision.reason) == (0, "matched")


def _routing_with_silent_ranks():
    """Three ranks of which only rank 0 reports a KV-event publisher (a headless rank
    started without --kv-events-config reports none)."""
    from types import SimpleNamespace

    from gateway.vllm.prefix_routing import PrefixRouting

    events_on = SimpleNamespace(enable_kv_cache_events=True)
    routing = PrefixRouting()
    routing._vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=3))
    routing._client = SimpleNamespace(get_kv_event_sources=lambda: {0: events_on})
    routing._init_routing()
    return routing


def test_cache_routing_asked_for_refuses_to_start_naming_each_rank_without_kv_events():
    """``--routing cache`` given: the start stops with a message naming the ranks that
    publish no events and the setting they lack (DEPLOYMENT.md)."""
    routing = _routing_with_silent_ranks()
    with pytest.raises(ValueError, match=r"rank\(s\) \[1, 2\] publish no KV.*tcp://\*:0"):
        routing._start_routing(RoutingConfig("cache"))
    routing._start_routing(RoutingConfig("load"))  # vLLM's balancer needs no events
    assert routing.kv_feed is None and routing.routing_stats()["policy"] == "load"


def test_cache_by_default_routes_by_load_where_a_rank_publishes_no_kv_events(caplog):
    """The default ``cache`` (no --routing) where a rank publishes no events: the gateway
    starts, routes by load, says so once naming the ranks, and /metrics names the policy."""
    from gateway.metrics import _routing_families

    routing = _routing_with_silent_ranks()
    with caplog.at_level("WARNING"):
        routing._start_routing(RoutingConfig("cache", by_default=True))
    assert routing.kv_feed is None and routing.router.config.policy == "load"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "rank(s) [1, 2] publish no KV events" in warnings[0]
    assert "routing: load" in warnings[0]
    samples = {
        (sample.name, sample.labels.get("policy")): sample.value
        for family in _routing_families("eg_", routing.routing_stats())
        for sample in family.samples
    }
    assert samples[("eg_routing_policy", "load")] == 1.0
    assert ("eg_routing_policy", "cache") not in samples


def test_the_approximate_index_starts_without_kv_events_and_metrics_name_it():
    """``--routing-index approximate`` needs no rank's events: ``cache`` starts where the
    events index would refuse, with no feed, and /metrics says which index is in force."""
    from gateway.metrics import _routing_families

    routing = _routing_with_silent_ranks()
    routing._start_routing(RoutingConfig("cache", index="approximate"))
    assert routing.kv_feed is None and routing.prefix_index is None
    assert routing.router.config.policy == "cache"
    stats = routing.routing_stats()
    assert stats["index"] == "approximate"
    samples = {
        (sample.name, sample.labels.get("kind")): sample.value
        for family in _routing_families("eg_", stats)
        for sample in family.samples
    }
    assert samples[("eg_routing_prefix_index", "approximate")] == 1.0
    with pytest.raises(ValueError, match="routing index"):
        RoutingConfig("cache", index="guess")


def test_the_kv_events_folder_is_removed_only_when_enable_kv_events_made_it(tmp_path):
    """The supervisor of a gateway group (and a single gateway) removes the private folder
    of its engines' ipc event sockets at exit, and never a folder it did not make."""
    from types import SimpleNamespace

    from gateway.vllm.args import KV_EVENTS_FOLDER_PREFIX, remove_kv_events_folder

    ours, theirs = tmp_path / f"{KV_EVENTS_FOLDER_PREFIX}x", tmp_path / "elsewhere"
    for folder in (ours, theirs):
        folder.mkdir()
        (folder / "kv").touch()

    def config(endpoint):
        return SimpleNamespace(kv_events_config=SimpleNamespace(endpoint=endpoint))

    remove_kv_events_folder(config(f"ipc://{theirs}/kv"))
    remove_kv_events_folder(config("tcp://*:0"))
    remove_kv_events_folder(SimpleNamespace(kv_events_config=None))
    assert theirs.exists() and ours.exists()
    remove_kv_events_folder(config(f"ipc://{ours}/kv"))
    assert not ours.exists() and theirs.exists()


def test_routing_metrics_give_each_ranks_feed_connection_and_lag():
    """The /metrics families of --routing cache, from the engine's own snapshot: per rank
    the feed's connection, its lost connections and its lag, beside the index's size."""
    from types import SimpleNamespace

    from gateway.metrics import _routing_families
    from gateway.prefix_index import PrefixIndex
    from gateway.vllm.prefix_routing import PrefixRouting

    routing = PrefixRouting()
    routing._init_routing()
    routing.router = cache_router()
    routing.prefix_index = index = PrefixIndex(2)
    index.ranks[1].connected, index.ranks[1].disconnects, index.ranks[0].lag_s = False, 2, 0.25
    routing._hash_check = None
    routing._vllm_config = SimpleNamespace()
    samples = {
        (sample.name, sample.labels.get("rank")): sample.value
        for family in _routing_families("eg_", routing.routing_stats())
        for sample in family.samples
    }
    assert samples[("eg_kv_event_feed_connected", "0")] == 1.0
    assert samples[("eg_kv_event_feed_connected", "1")] == 0.0
    assert samples[("eg_kv_event_feed_disconnects_total", "1")] == 2.0
    assert samples[("eg_kv_event_rank_lag_seconds", "0")] == 0.25


async def test_a_sleep_that_drops_the_kv_cache_empties_the_approximate_index():
    """vLLM's Sleep(level >= 1) drops every engine's KV cache with no reset from the gateway
    (the events index hears vLLM's AllBlocksCleared; the approximate one hears nothing):
    the approximate index forgets; a level-0 sleep (a pause) keeps it."""
    from types import SimpleNamespace

    from gateway.approximate_index import ApproximateIndex, PlacedSequences
    from gateway.vllm.engine import VllmEngine

    slept = []

    async def sleep_async(level):
        slept.append(level)

    engine = VllmEngine.__new__(VllmEngine)
    engine._model_config = SimpleNamespace(enable_sleep_mode=True)
    engine._engine_pids = []
    engine._client = SimpleNamespace(sleep_async=sleep_async)
    engine.approximate_index = ApproximateIndex(2, 16)
    engine.approximate_index.record(1, ["a", "b"])
    engine.placed_sequences = PlacedSequences(engine.approximate_index, 16)
    engine.placed_sequences.start("generating", 1, [5] * 3, [], ("seed",))

    await engine.sleep(0)
    assert engine.approximate_index.sizes() == [0, 2] and len(engine.placed_sequences) == 1
    await engine.sleep(1)
    assert engine.approximate_index.sizes() == [0, 0] and slept == [0, 1]
    assert len(engine.placed_sequences) == 0  # its blocks so far are gone with the cache


def _fake_core_request(request_id, prompt, rank=None, items=()):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        data_parallel_rank=rank,
        mm_features=[
            SimpleNamespace(mm_position=SimpleNamespace(offset=offset)) for offset in items
        ],
        lora_request=None,
        cache_salt=None,
        sampling_params=None,
        pooling_params=None,
    )


def _approximate_routing(ranks, policy="load", chosen=None):
    """A PrefixRouting over ``ranks`` ranks publishing no KV events, started with
    ``policy``; ``chosen``: request id -> the rank vLLM's balancer sent it to."""
    from types import SimpleNamespace

    from gateway.vllm.prefix_routing import PrefixRouting

    routing = PrefixRouting()
    routing._vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=ranks),
        cache_config=SimpleNamespace(block_size=BLOCK, num_gpu_blocks=64 * ranks),
    )
    engines = [f"engine-{r}" for r in range(ranks)]
    routing._client = SimpleNamespace(
        get_kv_event_sources=lambda: {},
        core_engines=engines,
        reqs_in_flight={rid: engines[rank] for rid, rank in (chosen or {}).items()},
    )
    routing._init_routing()
    routing._start_routing(RoutingConfig(policy))
    return routing


def _served(routing, core_request, output_ids=(1,)):
    """As the engine does: route, submit (note the placement), one step's output, its end."""
    from types import SimpleNamespace

    routing._route(core_request, None)
    routing._placed_by_engine_client(core_request)
    routing._follow_generation(
        [SimpleNamespace(request_id=core_request.request_id, new_token_ids=list(output_ids),
                         finish_reason="length")]
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["load", "round-robin", "cache"])
def test_a_single_engine_gateway_answers_prefix_query_from_what_it_served(policy):
    """Issue 67 item 3: with one rank nothing routes, but the index PrefixQuery reads is
    filled (what a GatewayPool with policy="cache" needs of single-engine gateways); a
    request only placed, not yet computed, is not reported."""
    routing = _approximate_routing(1, "load" if policy == "cache" else policy)
    prompt = list(range(3 * BLOCK + 5))
    _served(routing, _fake_core_request("unasked", prompt))  # nobody queried: not followed
    assert routing.approximate_index is None and routing.placed_sequences is None
    assert routing.prefix_matches(_fake_core_request("q", prompt))[0] == [0]  # from now on
    placed = _fake_core_request("a", prompt)
    routing._route(placed, None)
    routing._placed_by_engine_client(placed)
    assert routing.prefix_matches(_fake_core_request("q", prompt))[0] == [0]
    _served(routing, _fake_core_request("b", prompt))
    assert routing.prefix_matches(_fake_core_request("q", prompt))[0] == [3 * BLOCK]
    assert routing.routing_stats()["index"] == "approximate"


def test_vllms_balancer_placements_are_noted_on_the_rank_it_chose():
    """``--routing load`` over two ranks: vLLM picks the rank; the gateway reads its choice
    (its DP client's reqs_in_flight) and fills PrefixQuery's index there."""
    routing = _approximate_routing(2, "load", chosen={"a": 1})
    prompt = list(range(2 * BLOCK + 1))
    assert routing.prefix_matches(_fake_core_request("q", prompt))[0] == [0, 0]
    _served(routing, _fake_core_request("a", prompt))
    assert routing.prefix_matches(_fake_core_request("q", prompt))[0] == [0, 2 * BLOCK]


def test_load_with_the_operators_kv_events_reads_the_events_index():
    """``--routing load`` where the engines publish KV events (the operator's own
    --kv-events-config) runs the events feed: PrefixQuery reads it, not an empty
    approximate index."""
    from gateway.prefix_index import PrefixIndex

    routing = _approximate_routing(2, "load")
    assert routing._reads_approximate()
    routing.prefix_index = PrefixIndex(2)  # what _start_routing sets up with events on
    assert not routing._reads_approximate()
    assert routing.routing_stats()["index"] == "events"


def test_a_text_prompt_matches_the_text_blocks_an_image_prompt_shares():
    """Issue 67 item 5: the blocks before a prompt's first item are hashed as a text
    prompt's, so a text prompt sharing them matches there (vLLM reuses them); from the
    item's block on, vLLM's hashes (which hold the item) chain on."""
    routing = _approximate_routing(1)

    class Hasher:  # vLLM's hashes stand-in: a block's prefix and the items it holds
        def iter_block_hashes(self, core_request, block_size):
            tokens, items = core_request.prompt_token_ids, core_request.mm_features
            offsets = [f.mm_position.offset for f in items]
            for start in range(0, len(tokens) - block_size + 1, block_size):
                held = [o for o in offsets if start <= o < start + block_size]
                yield ("vllm", tuple(tokens[: start + block_size]), *held)

    routing._hasher = Hasher()
    routing._prefix_queried = True  # a pool in front: placements are noted
    shared = list(range(4 * BLOCK))
    image = _fake_core_request("i", shared + [7] * (2 * BLOCK), items=[4 * BLOCK + 3])
    _served(routing, image)
    text = _fake_core_request("q", shared + [9] * BLOCK)
    assert routing.prefix_matches(text)[0] == [4 * BLOCK]
    again = _fake_core_request("q2", shared + [7] * (2 * BLOCK), items=[4 * BLOCK + 3])
    assert routing.prefix_matches(again)[0] == [5 * BLOCK]  # len - 1: 5 of 6 blocks reusable
    other_item = _fake_core_request("q3", shared + [7] * (2 * BLOCK), items=[4 * BLOCK + 9])
    assert routing.prefix_matches(other_item)[0] == [4 * BLOCK]


async def test_a_pause_that_clears_the_cache_empties_the_approximate_index():
    """Issue 67 item 2: vLLM resets every engine's prefix cache (running requests' too) at
    Pause(clear_cache=True); the approximate index forgets as at ResetPrefixCache. A pause
    that keeps the cache keeps it."""
    from types import SimpleNamespace

    from gateway.vllm.engine import VllmEngine

    paused = []

    async def pause_scheduler_async(mode, clear_cache):
        paused.append((mode, clear_cache))

    engine = VllmEngine.__new__(VllmEngine)
    routing = _approximate_routing(2, "round-robin")
    engine.__dict__.update(routing.__dict__)
    engine._engine_pids = []
    engine._client = SimpleNamespace(pause_scheduler_async=pause_scheduler_async)
    prompt = list(range(2 * BLOCK + 1))
    engine.prefix_matches(_fake_core_request("q", prompt))  # a pool in front: noted from now
    _served(engine, _fake_core_request("a", prompt))
    held = engine.prefix_matches(_fake_core_request("q", prompt))[0]
    assert sorted(held) == [0, 2 * BLOCK]
    await engine.pause("keep", False)
    assert engine.prefix_matches(_fake_core_request("q", prompt))[0] == held
    await engine.pause("keep", True)
    assert engine.prefix_matches(_fake_core_request("q", prompt))[0] == [0, 0]
    assert engine.approximate_index.sizes() == [0, 0] and paused[-1] == ("keep", True)


def test_equal_costs_go_to_the_less_loaded_rank():
    """A mutant the suite let live: cost ties broken by load. 16 blocks, rank 0 holding 2
    and one request busier, rank 1 holding 1: both cost -1; the less loaded takes it."""
    router = cache_router()
    decision = router.choose([2, 1], [1.0, 0.0], 16 * BLOCK + 1, BLOCK)
    assert (decision.rank, decision.reason) == (1, "matched")


def test_a_reused_key_is_the_most_recently_used_and_owners_without_keys_are_dropped():
    """Mutants the suite let live: sticky keys not moved to the end on reuse (a key in use
    was pushed out first), and owners left in the table once all their keys were pushed
    out (unbounded)."""
    router = cache_router(sticky_keys=2)
    for key in ("o1:a", "o2:b", "o1:a", "o3:c"):
        router.choose([0, 0], [0.0, 0.0], 40, BLOCK, routing_key=key)
    assert list(router._sticky) == ["o1:a", "o3:c"]  # "o2:b", the least recently used, went
    assert set(router._owned) == {"o1", "o3"}
    for i in range(100):
        router.choose([0, 0], [0.0, 0.0], 40, BLOCK, routing_key=f"owner{i}:k")
    assert len(router._owned) == 2 and len(router._sticky) == 2


def test_a_block_size_of_zero_falls_back_to_load():
    """No index block size yet (no event seen): routed by load, never a division by 0."""
    router = cache_router()
    decision = router.choose([1, 0], [0.0, 3.0], 40, 0)
    assert (decision.rank, decision.reason) == (0, "fallback")


def test_health_per_rank_is_current_once_every_request_ended():
    """Issue 72 item 6: the DP coordinator's counts are a snapshot (HealthReply showed
    running=8 after every request had ended); a gateway alone on its engines bounds them
    by its own requests in flight there. Gateways of a group keep the snapshot (the others'
    requests count too)."""
    from types import SimpleNamespace

    from gateway.vllm.engine import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)
    for clients, expected in ((1, [(0, 0, 0), (1, 1, 2)]), (2, [(8, 3, 0), (1, 2, 2)])):
        engine._client = SimpleNamespace(
            lb_engines=[[3, 8, 0.2], [2, 1, 0.1]],
            engine_inflight={"e0": 0, "e1": 2},
            engine_ranks_managed=[0, 1],
            core_engines=["e0", "e1"],
            client_count=clients,
        )
        loads = engine.engine_load()
        assert [(e.running, e.waiting, e.in_flight) for e in loads] == expected


def test_the_defaults_and_the_reusable_blocks_rule():
    """Mutants an AST mutation run left alive: the default index per gateway count, vLLM's
    rule that the last prompt token is always computed, and --routing flags read as given."""
    from types import SimpleNamespace

    from gateway.routing import default_routing_index, reusable_blocks

    assert [default_routing_index(n) for n in (1, 2, 4)] == ["approximate", "events", "events"]
    assert reusable_blocks(4, 4 * BLOCK, BLOCK) == 3  # the last token is computed
    assert reusable_blocks(4, 4 * BLOCK + 1, BLOCK) == 4
    assert reusable_blocks(9, 2 * BLOCK + 1, BLOCK) == 2 and reusable_blocks(1, 0, BLOCK) == 0
    args = SimpleNamespace(
        routing="cache", routing_prefix_weight=4.0, routing_guard=(2.0, 3.0),
        routing_max_blocks=64, routing_by_default=True, routing_index=None, gateway_count=2,
    )  # fmt: skip
    config = RoutingConfig.from_args(args)
    assert (config.policy, config.prefix_weight, config.guard_ratio, config.guard_slack) == (
        "cache", 4.0, 2.0, 3.0,
    )  # fmt: skip
    assert (config.max_prefix_blocks, config.by_default, config.index) == (64, True, "events")
    args.routing_index, args.gateway_count = "approximate", 1
    assert RoutingConfig.from_args(args).index == "approximate"


def test_one_matched_block_counts_and_an_owners_reused_key_is_kept():
    """One reusable block is a match (not load); a key its owner uses again is its newest,
    so the owner's budget pushes out its oldest other key."""
    router = cache_router()
    decision = router.choose([1, 0], [0.0, 0.0], 2 * BLOCK + 1, BLOCK)
    assert (decision.rank, decision.reason, decision.predicted_blocks) == (0, "matched", 1)
    router = cache_router(sticky_keys=100, sticky_keys_per_client=2)
    for key in ("o:a", "o:b", "o:a", "o:c"):
        router.choose([0, 0], [0.0, 0.0], 40, BLOCK, routing_key=key)
    assert list(router._owned["o"]) == ["o:a", "o:c"]  # "o:b" went, the reused "o:a" stayed
