"""SessionTable rules, driven in memory with a fake clock (no sockets, no engine process)."""

from __future__ import annotations

from codec import (
    Abort,
    AbortAck,
    AbortSamples,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    GetHealth,
    HealthReply,
    Hello,
    HelloAck,
    Outputs,
    Overloaded,
    Ping,
    Pong,
    SamplingParams,
)
from gateway.fake_engine import FakeOutput
from gateway.sessions import GatewayLimits
from tests.helpers import TableHarness

A, B = b"client-a", b"client-b"


def hello(h: TableHarness, client_id: bytes, interval: float = 1.0) -> HelloAck:
    h.send(client_id, Hello(1, "t", interval))
    (ack,) = h.take(client_id)
    assert isinstance(ack, HelloAck)
    return ack


def engine_ids(h: TableHarness) -> list[str]:
    return [p.request_id for p in h.submitted]


def test_generate_before_hello_is_handshake_required():
    h = TableHarness()
    h.send(A, Generate("r1", [5]))
    (err,) = h.take(A)
    assert isinstance(err, Error) and err.code is ErrorCode.HANDSHAKE_REQUIRED
    assert err.request_id == "r1" and not h.submitted


def test_probes_are_answered_without_a_session():
    h = TableHarness()
    h.send(A, Ping(7))
    h.send(A, GetHealth(3))
    pong, health = h.take(A)
    assert pong == Pong(7)
    assert isinstance(health, HealthReply) and health.ready and health.call_id == 3


def test_health_carries_the_engines_load_and_engine_ids_carry_the_prefix():
    from codec import EngineLoad
    from gateway.sessions import SessionTable
    from tests.helpers import FAKE_INFO

    h = TableHarness()
    load = [EngineLoad(0, 3, 1, 0.5, 2), EngineLoad(1, 0, 0, 0.0, 0)]
    h.table = SessionTable(
        FAKE_INFO, h.engine.prepare, engine_load=lambda: load, engine_id_prefix="g1."
    )
    h.send(A, GetHealth(4))
    (health,) = h.take(A)
    assert health.engines == load
    hello(h, A)
    h.send(A, Generate("r1", [5]))
    h.send(A, Generate("r2", [5]))
    assert [p.request_id for p in h.submitted] == ["g1.1", "g1.2"]


def test_hello_with_another_protocol_version_is_refused():
    h = TableHarness()
    h.send(A, Hello(2))
    (err,) = h.take(A)
    assert err.code is ErrorCode.UNSUPPORTED_VERSION and h.table.connected_clients == 0


def test_hello_ack_reports_model_limits_and_clamped_heartbeat():
    h = TableHarness(GatewayLimits(max_in_flight_per_client=7))
    ack = hello(h, A, interval=0.0001)
    assert ack.model.eos_token_ids == [2, 3] and ack.model.vocab_size == 512
    assert ack.limits.max_in_flight_per_client == 7
    assert ack.heartbeat_interval_s == 0.05 and ack.heartbeat_timeout_s == 0.05 * 3


def test_two_clients_may_use_the_same_request_id():
    h = TableHarness()
    hello(h, A)
    hello(h, B)
    h.send(A, Generate("same", [5]))
    h.send(B, Generate("same", [6]))
    ea, eb = engine_ids(h)
    assert ea != eb
    h.step(FakeOutput(ea, [10]), FakeOutput(eb, [20]))
    (out_a,) = h.take(A)
    (out_b,) = h.take(B)
    assert out_a.outputs[0].new_token_ids == [10]
    assert out_b.outputs[0].new_token_ids == [20]


def test_duplicate_live_request_id_is_refused_and_the_live_one_continues():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5]))
    h.send(A, Generate("r1", [6]))
    (err,) = h.take(A)
    assert err.code is ErrorCode.DUPLICATE_REQUEST_ID and err.request_id == "r1"
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [9], finish_reason=1))
    (out,) = h.take(A)
    assert out.outputs[0].finished.finish_reason is FinishReason.LENGTH
    h.send(A, Generate("r1", [6]))  # reusable after its terminal
    assert len(engine_ids(h)) == 2 and not h.take(A)


def test_one_outputs_frame_per_client_per_step():
    h = TableHarness()
    hello(h, A)
    for i in range(3):
        h.send(A, Generate(f"r{i}", [5]))
    replies = h.step(*(FakeOutput(e, [i]) for i, e in enumerate(engine_ids(h))))
    assert len(replies) == 1
    client_id, msg = replies[0]
    assert client_id == A and [o.request_id for o in msg.outputs] == ["r0", "r1", "r2"]


def test_non_streaming_gets_one_final_output_with_all_tokens_and_counts():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5, 6, 7], stream=False))
    (eid,) = engine_ids(h)
    assert h.step(FakeOutput(eid, [1])) == []
    h.step(FakeOutput(eid, [2, 3]))
    h.step(FakeOutput(eid, [2], finish_reason=0, stop_reason=2))
    (msg,) = h.take(A)
    (out,) = msg.outputs
    assert out.new_token_ids == [1, 2, 3, 2]
    assert out.finished.finish_reason is FinishReason.STOP and out.finished.stop_reason == 2
    assert (out.finished.prompt_tokens, out.finished.output_tokens) == (3, 4)
    assert h.table.live_requests == 0


def test_abort_mid_stream_sends_abort_terminal_then_ack_and_drops_late_outputs():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5]))
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [1]))
    h.step(FakeOutput(eid, [2]))
    h.take(A)
    h.send(A, Abort(["r1"]))
    assert h.aborted == [eid]
    terminal, ack = h.take(A)
    (out,) = terminal.outputs
    assert out.new_token_ids == [] and out.finished.finish_reason is FinishReason.ABORT
    assert out.finished.output_tokens == 2
    assert ack == AbortAck(["r1"], [])
    assert h.step(FakeOutput(eid, [3], finish_reason=1)) == []  # raced the abort: dropped


def test_abort_of_a_non_streaming_request_returns_its_partial_tokens():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5], stream=False))
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [7, 8]))
    h.send(A, Abort(["r1"]))
    terminal, _ = h.take(A)
    assert terminal.outputs[0].new_token_ids == [7, 8]


def test_abort_of_unknown_finished_and_repeated_ids_is_listed_in_ack():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("done", [5]))
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [1], finish_reason=1))
    h.send(A, Generate("live", [5]))
    h.take(A)
    h.send(A, Abort(["nope", "done", "live", "live"]))
    terminal, ack = h.take(A)
    assert [o.request_id for o in terminal.outputs] == ["live"]
    assert ack == AbortAck(["live"], ["nope", "done"])
    h.send(A, Abort(["live"]))
    assert h.take(A) == [AbortAck([], ["live"])]


def test_abort_all_ends_only_this_clients_requests():
    h = TableHarness()
    hello(h, A)
    hello(h, B)
    h.send(A, Generate("a1", [5]))
    h.send(A, Generate("a2", [5]))
    h.send(B, Generate("b1", [5]))
    h.send(A, Abort(None))
    terminal, ack = h.take(A)
    assert sorted(ack.aborted) == ["a1", "a2"] and len(terminal.outputs) == 2
    assert h.table.client_request_ids(B) == ["b1"] and not h.take(B)


def test_abort_with_too_many_ids_is_refused():
    h = TableHarness(GatewayLimits(max_abort_ids=2))
    hello(h, A)
    h.send(A, Abort(["a", "b", "c"]))
    (err,) = h.take(A)
    assert err.code is ErrorCode.INVALID_MESSAGE and "limit is 2" in err.message


def test_abort_all_ends_more_live_requests_than_max_abort_ids():
    h = TableHarness(GatewayLimits(max_abort_ids=2))
    hello(h, A)
    for request_id in ("a1", "a2", "a3"):
        h.send(A, Generate(request_id, [5]))
    h.send(A, Abort(None))
    terminal, ack = h.take(A)
    assert sorted(ack.aborted) == ["a1", "a2", "a3"] and len(terminal.outputs) == 3
    assert h.table.live_requests == 0


def test_n_samples_each_get_a_terminal_and_the_request_ends_with_the_last():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5], sampling=SamplingParams(n=2)))
    e0, e1 = engine_ids(h)
    h.step(FakeOutput(e0, [1], finish_reason=1))
    assert h.table.live_requests == 1
    h.step(FakeOutput(e1, [2], finish_reason=1))
    assert h.table.live_requests == 0
    first, second = h.take(A)
    assert (first.outputs[0].index, second.outputs[0].index) == (0, 1)


def test_abort_of_some_samples_ends_those_and_the_others_run_on():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5], sampling=SamplingParams(n=3)))
    e0, e1, e2 = engine_ids(h)
    h.step(FakeOutput(e0, [1]), FakeOutput(e1, [2]), FakeOutput(e2, [3]))
    h.take(A)
    h.send(A, AbortSamples("r1", [1, 2, 9], 7))
    assert h.aborted == [e1, e2]
    terminal, ack = h.take(A)
    assert [(o.index, o.finished.finish_reason) for o in terminal.outputs] == [
        (1, FinishReason.ABORT),
        (2, FinishReason.ABORT),
    ]
    assert ack == AbortAck(["r1"], [], 7) and h.table.live_requests == 1
    assert h.step(FakeOutput(e1, [4])) == []  # raced the abort: dropped
    h.send(A, AbortSamples("r1", [1], 8))  # no live sample among them
    assert h.take(A) == [AbortAck([], ["r1"], 8)]
    h.step(FakeOutput(e0, [5], finish_reason=1))
    (last,) = h.take(A)
    assert last.outputs[0].index == 0 and last.outputs[0].finished.output_tokens == 2
    assert h.table.live_requests == 0


def test_abort_of_samples_needs_a_session_and_names_a_request_of_this_client():
    h = TableHarness()
    h.send(A, AbortSamples("r1", [0], 3))
    (err,) = h.take(A)
    assert err.code is ErrorCode.HANDSHAKE_REQUIRED and err.call_id == 3
    hello(h, A)
    hello(h, B)
    h.send(A, Generate("r1", [5], sampling=SamplingParams(n=2)))
    h.send(B, AbortSamples("r1", [0, 1], 4))
    assert h.take(B) == [AbortAck([], ["r1"], 4)]
    assert h.table.live_requests == 1 and not h.aborted


def test_overloaded_per_client_and_in_total():
    h = TableHarness(GatewayLimits(max_in_flight_per_client=2, max_in_flight_total=3))
    hello(h, A)
    hello(h, B)
    for i in range(3):
        h.send(A, Generate(f"a{i}", [5]))
    (over,) = h.take(A)
    assert isinstance(over, Overloaded) and over.request_id == "a2"
    assert (over.limit, over.limit_value, over.current) == ("max_in_flight_per_client", 2, 2)
    h.send(B, Generate("b0", [5]))
    h.send(B, Generate("b1", [5]))
    (over,) = h.take(B)
    assert (over.limit, over.limit_value, over.current) == ("max_in_flight_total", 3, 3)


def test_prompt_longer_than_max_prompt_tokens_is_invalid():
    h = TableHarness(GatewayLimits(max_prompt_tokens=4))
    hello(h, A)
    h.send(A, Generate("r1", [1] * 5))
    (err,) = h.take(A)
    assert err.code is ErrorCode.INVALID_REQUEST and "max_prompt_tokens (4)" in err.message


def test_cache_salts_vllms_frontend_refuses_are_refused():
    """vLLM checks a salt in its frontend (validate_cache_salt), not its engine, which gets
    the gateway's salt: the gateway checks the client's own as vLLM's frontend would."""
    from codec import RequestOptions

    h = TableHarness()
    hello(h, A)
    bad = ["", "a/b", "a@b", "a\\b", "a\0b", "x" * 129]
    for i, salt in enumerate(bad):
        h.send(A, Generate(f"bad{i}", [5], options=RequestOptions(cache_salt=salt)))
        (err,) = h.take(A)
        assert err.code is ErrorCode.INVALID_REQUEST and "cache_salt" in err.message, salt
    h.send(A, Generate("ok", [5], options=RequestOptions(cache_salt="x" * 128)))
    assert h.table.live_requests == 1


def test_engine_rejection_gives_an_error_and_leaves_no_state():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [9999]))
    (err,) = h.take(A)
    assert err.code is ErrorCode.INVALID_REQUEST and "out of vocabulary" in err.message
    assert h.table.live_requests == 0 and h.table.client_request_ids(A) == []


def test_silent_clients_expire_and_their_requests_are_aborted():
    h = TableHarness()
    hello(h, A, interval=1.0)
    hello(h, B, interval=1.0)
    h.send(A, Generate("r1", [5]))
    (eid,) = engine_ids(h)
    h.now = 2.5
    h.send(B, Ping(1))  # B stays alive
    h.now = 3.1
    effects = h.apply(h.table.expire(h.now))
    assert effects.abort == [eid]
    assert h.table.connected_clients == 1 and h.table.live_requests == 0
    expired = h.take(A)[-1]  # an Error: the client must learn its session ended
    assert expired.code is ErrorCode.SESSION_EXPIRED and "session expired" in expired.message
    h.send(A, Generate("r2", [5]))
    assert h.take(A)[0].code is ErrorCode.HANDSHAKE_REQUIRED


def test_time_the_gateway_itself_did_not_run_is_not_held_against_its_clients():
    h = TableHarness()
    hello(h, A, interval=1.0)  # timeout 3 s
    hello(h, B, interval=1.0)
    h.send(A, Generate("r1", [5]))
    h.now = 2.0
    h.send(B, Ping(1))
    # The process was paused from 2.5 to 7.5: neither client could be heard meanwhile.
    h.now = 7.6
    h.table.forgive(5.0, h.now)
    assert h.apply(h.table.expire(h.now)).abort == []
    assert h.table.connected_clients == 2 and h.table.live_requests == 1
    assert h.table.stats.pauses_forgiven == 1
    # Silence after the pause counts again: A last heard at 0 (+5 forgiven), B at 2 (+5).
    h.now = 8.1
    effects = h.apply(h.table.expire(h.now))
    assert len(effects.abort) == 1 and h.table.connected_clients == 1
    h.send(A, Generate("r2", [5]))
    assert h.take(A)[-1].code is ErrorCode.HANDSHAKE_REQUIRED
    # Forgiving never moves a client's clock past now.
    h.table.forgive(100.0, h.now)
    h.now = 11.2
    h.apply(h.table.expire(h.now))
    assert h.table.connected_clients == 0


def test_second_hello_ends_the_old_session_before_its_ack():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5]))
    (eid,) = engine_ids(h)
    h.send(A, Hello(1))
    terminal, ack = h.take(A)
    assert terminal.outputs[0].finished.finish_reason is FinishReason.ABORT
    assert isinstance(ack, HelloAck) and h.aborted == [eid]


def test_a_hello_repeated_before_anything_else_keeps_its_session():
    """A client that says Hello again while the first HelloAck is on its way (its reconnect
    backoff fired first, on a slow machine) keeps one session: its Pongs name the session
    of the ack it read, whichever (the CI failure: 'the gateway holds another session')."""
    h = TableHarness()
    first = hello(h, A)
    again = hello(h, A)
    assert again.session_id == first.session_id
    h.send(A, Ping(7))
    (pong,) = h.take(A)
    assert pong.session_id == first.session_id
    # Once anything else reached the session, a Hello is a reconnect: a new session.
    assert hello(h, A).session_id != first.session_id


def test_prefix_queries_need_a_session_and_share_the_request_rate():
    """Each PrefixQuery hashes the whole prompt on the gateway's loop: a raw socket without
    a session gets none answered, and a session's queries count with its Generates."""
    from codec import PrefixQuery, PrefixReply

    h = TableHarness(GatewayLimits(max_request_rate_per_client=1.0, request_rate_burst=2))
    queried = []

    def prefix_query(prompt, options):
        queried.append(prompt)
        return [0], 16, "cache"

    h.table._prefix_query = prefix_query
    h.send(A, PrefixQuery(1, [5, 6]))
    (refused,) = h.take(A)
    assert refused.code is ErrorCode.HANDSHAKE_REQUIRED and refused.call_id == 1
    assert queried == []
    hello(h, A)
    h.send(A, PrefixQuery(2, [5, 6]))
    h.send(A, Generate("r1", [5]))  # the burst of 2 is spent
    h.send(A, PrefixQuery(3, [5, 6]))
    reply, *_, limited = h.take(A)
    assert isinstance(reply, PrefixReply) and reply.call_id == 2
    assert limited.code is ErrorCode.RATE_LIMITED and limited.call_id == 3
    assert len(queried) == 1
    h.now += 1.0  # one token back
    h.send(A, PrefixQuery(4, [5, 6]))
    assert isinstance(h.take(A)[-1], PrefixReply)


def _routing_keys_seen(h: TableHarness) -> list:
    """The routing keys of the requests the table prepares from now on."""
    seen = []
    prepare = h.table._prepare

    def recording(engine_id, msg):
        seen.append(msg.options.routing_key)
        return prepare(engine_id, msg)

    h.table._prepare = recording
    return seen


def test_routing_keys_reach_the_engine_as_each_clients_own():
    from codec import RequestOptions

    h = TableHarness()
    seen = _routing_keys_seen(h)
    for client in (A, B):
        hello(h, client)
        h.send(client, Generate("r", [5], options=RequestOptions(routing_key="ep:1")))
    assert seen == [f"{A.hex()}:ep:1", f"{B.hex()}:ep:1"]


def test_routing_key_owners_are_each_clients_own_even_for_keys_with_a_colon():
    """Issue 67 item 6: CURVE keys (Z85) may hold ":"; two that start with it once shared
    one owner in the router, and one client's keys pushed out the other's."""
    from codec import RequestOptions
    from gateway.routing import Router, RoutingConfig

    h = TableHarness()
    seen = _routing_keys_seen(h)
    keys = {A: ":" + "a" * 39, B: ":" + "b" * 39}
    for client, key in keys.items():
        h.apply(h.table.on_message(client, Hello(1, "t", 1.0), h.now, key))
        for i in range(3):
            options = RequestOptions(routing_key=f"ep:{i}")
            h.apply(h.table.on_message(client, Generate(f"r{i}", [5], options=options), h.now, key))
    router = Router(2, RoutingConfig("cache", sticky_keys_per_client=3))
    for key in seen:
        router.choose([0, 0], [0.0, 0.0], 40, 16, routing_key=key)
    assert len(router._owned) == 2 and len(router._sticky) == 6  # none pushed out
    assert seen[0].startswith(keys[A].encode().hex() + ":ep:0")


def test_cache_isolation_gives_each_client_its_own_salt_on_generates_and_queries():
    """Issue 51 item 16: under --cache-isolation the gateway, not the client, picks the
    salt's first part: the CURVE key (the routing id without CURVE), then the client's own
    salt. Off, the client's salt reaches the engine as sent."""
    from codec import PrefixQuery, RequestOptions

    h = TableHarness()
    salts, queried = [], []
    prepare = h.table._prepare

    def recording(engine_id, msg):
        salts.append(msg.options.cache_salt if msg.options else None)
        return prepare(engine_id, msg)

    def prefix_query(prompt, options):
        queried.append(options.cache_salt if options else None)
        return [0], 16, "cache"

    h.table._prepare = recording
    h.table._prefix_query = prefix_query
    hello(h, A)
    h.send(A, Generate("r0", [5], options=RequestOptions(cache_salt="s")))
    h.table.cache_isolation = True
    h.send(A, Generate("r1", [5]))
    h.send(A, Generate("r2", [5], options=RequestOptions(cache_salt="s", priority=3)))
    h.send(A, PrefixQuery(1, [5]))
    h.send(A, PrefixQuery(2, [5], RequestOptions(cache_salt="s")))
    # With CURVE the key names the client: its sessions share one namespace.
    h.apply(h.table.on_message(B, Hello(1), h.now, key="K" * 40))
    h.apply(h.table.on_message(B, Generate("r3", [5]), h.now, key="K" * 40))
    assert salts == ["s", f"id:{A.hex()}/", f"id:{A.hex()}/s", f"key:{'K' * 40}/"]
    assert queried == [f"id:{A.hex()}/", f"id:{A.hex()}/s"]


def test_kv_transfer_params_only_from_keys_the_policy_allows():
    """They have the engine's KV connector load blocks the client names (which then serve
    other clients' requests): by default nobody may send them; a CURVE key on the control
    allow-list may, and the request reaches the engine with them."""
    from codec import RequestOptions
    from gateway.auth import ControlPolicy

    h = TableHarness()
    policy = ControlPolicy(allowed_keys=frozenset({"trusted"}))
    # serve warns when the engine has a KV connector and the policy allows nobody.
    assert ControlPolicy().allows_nobody
    assert not policy.allows_nobody and not ControlPolicy(open=True).allows_nobody
    h.table.kv_transfer_allowed = policy.allows
    params = RequestOptions(kv_transfer_params={"do_remote_prefill": True})
    for client_id, key in ((A, None), (B, "stranger"), (b"coordinator", "trusted")):
        h.apply(h.table.on_message(client_id, Hello(1, "t", 1.0), h.now, key))
        h.take(client_id)
        h.apply(h.table.on_message(client_id, Generate("r1", [5], options=params), h.now, key))
    for refused in (A, B):
        (err,) = h.take(refused)
        assert isinstance(err, Error) and err.code is ErrorCode.UNAUTHORIZED
        assert err.request_id == "r1" and "kv_transfer_params" in err.message
    assert h.take(b"coordinator") == [] and len(h.submitted) == 1
    # Without params anyone is served.
    h.send(A, Generate("r2", [5]))
    assert len(h.submitted) == 2 and h.take(A) == []


def test_engine_death_errors_every_live_request_and_refuses_new_ones():
    h = TableHarness()
    hello(h, A)
    hello(h, B)
    h.send(A, Generate("a1", [5]))
    h.send(B, Generate("b1", [5]))
    effects = h.apply(h.table.on_engine_dead("boom", h.now))
    assert effects.abort == []
    (ea,) = h.take(A)
    assert ea.code is ErrorCode.ENGINE_DEAD and ea.request_id == "a1"
    assert h.take(B)[0].request_id == "b1"
    h.send(A, Generate("a2", [5]))
    assert h.take(A)[0].code is ErrorCode.ENGINE_DEAD
    h.send(A, GetHealth(1))
    assert h.take(A)[0].state == "engine_dead"


def test_drain_refuses_new_requests_and_abort_all_ends_the_rest():
    h = TableHarness()
    hello(h, A)
    h.send(A, Generate("r1", [5]))
    h.table.start_drain()
    h.send(A, Generate("r2", [5]))
    (err,) = h.take(A)
    assert err.code is ErrorCode.DRAINING
    h.apply(h.table.abort_all(h.now))
    (terminal,) = h.take(A)
    assert terminal.outputs[0].finished.finish_reason is FinishReason.ABORT
    assert h.table.live_requests == 0


# ---------------------------------------------------------------- stop sequences, timeouts


def lp(tokens: list[int]):
    """Fake logprobs whose rows name their tokens (to check the cut)."""
    from codec import Logprobs

    return Logprobs([[t] for t in tokens], [[-1.0] for _ in tokens], [1 for _ in tokens])


def outputs_of(h: TableHarness, client_id: bytes) -> list:
    return [o for msg in h.take(client_id) for o in msg.outputs]


def test_stop_sequence_in_multi_token_steps_is_cut_exactly_and_aborted():
    """Several tokens per engine step (as speculative decoding produces): held-back tokens,
    a match straddling steps, tokens after it dropped, logprobs cut alike, engine aborted."""
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(max_tokens=50, logprobs=1, stop_token_sequences=[[7, 8, 9]])
    h.send(A, Generate("r", [5], True, sampling))
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [1, 2, 7], new_logprobs=lp([1, 2, 7])))
    (first,) = outputs_of(h, A)
    assert first.new_token_ids == [1, 2] and first.logprobs.ranks == [1, 1]  # 7 held back
    h.step(FakeOutput(eid, [8], new_logprobs=lp([8])))
    assert outputs_of(h, A) == []  # [7, 8] may still be the start: nothing sent
    h.step(FakeOutput(eid, [9, 4, 4], new_logprobs=lp([9, 4, 4])))
    (last,) = outputs_of(h, A)
    assert last.new_token_ids == [] and last.logprobs is None
    assert last.finished.finish_reason is FinishReason.STOP
    assert last.finished.stop_reason == [7, 8, 9] and last.finished.output_tokens == 2
    assert h.aborted == [eid] and h.table.live_requests == 0
    h.step(FakeOutput(eid, [5]))  # the engine's late output is dropped
    assert outputs_of(h, A) == [] and h.table.stats.late_outputs == 1


def test_false_start_is_released_and_held_tokens_come_with_an_abort():
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(max_tokens=50, stop_token_sequences=[[7, 8, 9]])
    h.send(A, Generate("r", [5], True, sampling))
    (eid,) = engine_ids(h)
    h.step(FakeOutput(eid, [7, 8]))
    assert outputs_of(h, A) == []
    h.step(FakeOutput(eid, [3]))  # not a match after all: everything goes out
    (out,) = outputs_of(h, A)
    assert out.new_token_ids == [7, 8, 3]
    h.step(FakeOutput(eid, [7]))
    assert outputs_of(h, A) == []
    h.send(A, Abort(["r"]))
    terminal, ack = h.take(A)
    (out,) = terminal.outputs
    assert out.new_token_ids == [7] and out.finished.finish_reason is FinishReason.ABORT
    assert out.finished.output_tokens == 4 and isinstance(ack, AbortAck)


def test_non_streaming_stop_sequence_with_n_samples_cuts_each_sample():
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(n=2, max_tokens=9, stop_token_sequences=[[4, 4]])
    h.send(A, Generate("r", [5], False, sampling))
    e0, e1 = engine_ids(h)
    h.step(FakeOutput(e0, [1, 4]), FakeOutput(e1, [4, 4, 2]))
    (done1,) = outputs_of(h, A)
    assert done1.index == 1 and done1.new_token_ids == [] and done1.finished.output_tokens == 0
    h.step(FakeOutput(e0, [4, 6]))
    (done0,) = outputs_of(h, A)
    assert done0.index == 0 and done0.new_token_ids == [1]
    assert sorted(h.aborted) == sorted([e0, e1])


def test_deadline_and_stall_end_requests_with_timed_out_once():
    from codec import RequestOptions

    h = TableHarness()
    hello(h, A, interval=100.0)
    h.send(A, Generate("d", [5], True, options=RequestOptions(deadline_s=1.0)))
    h.send(A, Generate("s", [6], False, options=RequestOptions(stall_timeout_s=0.5)))
    ed, es = engine_ids(h)
    h.now = 0.4
    h.step(FakeOutput(ed, [1]), FakeOutput(es, [2]))
    h.take(A)
    h.now = 0.8  # the stall clock restarted at 0.4
    h.apply(h.table.expire(h.now))
    assert h.take(A) == []
    h.now = 0.95
    h.apply(h.table.expire(h.now))
    (msg,) = h.take(A)
    (stalled,) = msg.outputs
    assert stalled.request_id == "s" and stalled.new_token_ids == [2]
    assert stalled.finished.finish_reason is FinishReason.TIMED_OUT
    h.now = 1.0
    h.apply(h.table.expire(h.now))
    (msg,) = h.take(A)
    (late,) = msg.outputs
    assert late.request_id == "d" and late.finished.finish_reason is FinishReason.TIMED_OUT
    assert late.finished.timings.finished_s == 1.0 and late.finished.timings.first_token_s == 0.4
    assert sorted(h.aborted) == sorted([ed, es]) and h.table.stats.timed_out == 2
    h.apply(h.table.expire(5.0))
    assert h.take(A) == []


def test_weight_version_spans_count_held_back_tokens_and_follow_the_cut():
    """Versions change between steps while a stop-sequence prefix is held back: the spans
    start where each version's tokens start, and end at the cut."""
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(max_tokens=50, stop_token_sequences=[[7, 8, 9]])
    h.send(A, Generate("r", [5], True, sampling))
    (eid,) = engine_ids(h)
    h.table.on_step([FakeOutput(eid, [1, 7])], 0.0, "a")  # 7 held back
    h.table.on_step([FakeOutput(eid, [8])], 0.0, "a")
    effects = h.table.on_step([FakeOutput(eid, [3, 4])], 0.0, "b")  # false start: all out
    ((_, frame),) = effects.replies
    (out,) = frame.outputs
    assert out.new_token_ids == [7, 8, 3, 4] and out.weight_version == "b"
    effects = h.table.on_step([FakeOutput(eid, [7, 8, 9, 6], 0)], 0.0, "c")
    ((_, frame),) = effects.replies
    (last,) = frame.outputs
    assert last.finished.output_tokens == 5
    spans = [(s.version, s.first_token, s.num_tokens) for s in last.finished.weight_versions]
    assert spans == [("a", 0, 3), ("b", 3, 2)]  # "c" began at token 5: all of it was cut


def test_control_calls_with_bad_fields_are_refused_by_name_and_reach_no_engine():
    from codec import Pause, ReloadWeights, SetWeightVersion

    h = TableHarness()
    hello(h, A)
    refused = {
        Pause(1, "bogus"): "Pause.mode must be 'abort', 'wait' or 'keep', got 'bogus'",
        SetWeightVersion(2, ""): "SetWeightVersion.version must be 1 to 256 characters, got 0",
        SetWeightVersion(3, "v" * 257): "SetWeightVersion.version must be 1 to 256 characters",
        ReloadWeights(4, "/ckpt", "v" * 257): "ReloadWeights.version must be 1 to 256 characters",
    }
    for call, message in refused.items():
        effects = h.table.on_control(A, call, h.now, authorized=True)
        ((client_id, error),) = effects.replies
        assert client_id == A and isinstance(error, Error) and error.call_id == call.call_id
        assert error.code is ErrorCode.INVALID_MESSAGE and error.message.startswith(message)
        assert effects.control == [] and not h.table.paused
    for call in [SetWeightVersion(5, "v" * 256), ReloadWeights(6, "/ckpt"), Pause(7, "keep")]:
        effects = h.table.on_control(A, call, h.now, authorized=True)
        assert effects.replies == [] and effects.control == [(A, call)]


def test_a_new_version_whose_tokens_were_all_held_back_is_named_when_they_are_sent():
    """Every token of the step that changed the version is held back (a stop-sequence
    prefix): the output that releases them names the new version, not "unchanged"."""
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(max_tokens=50, stop_token_sequences=[[7, 8, 9]])
    h.send(A, Generate("r", [5], True, sampling))
    (eid,) = engine_ids(h)
    ((_, first),) = h.table.on_step([FakeOutput(eid, [1])], 0.0, "a").replies
    assert first.outputs[0].weight_version == "a"
    assert h.table.on_step([FakeOutput(eid, [7])], 0.0, "b").replies == []  # all held back
    ((_, frame),) = h.table.on_step([FakeOutput(eid, [3])], 0.0, "b").replies
    (out,) = frame.outputs
    assert out.new_token_ids == [7, 3] and out.weight_version == "b"
    ((_, frame),) = h.table.on_step([FakeOutput(eid, [4])], 0.0, "b").replies
    assert frame.outputs[0].weight_version is None  # unchanged since


def test_abort_terminals_and_non_streaming_outputs_name_their_version():
    h = TableHarness()
    hello(h, A)
    sampling = SamplingParams(max_tokens=50, stop_token_sequences=[[7, 8, 9]])
    h.send(A, Generate("s", [5], True, sampling))
    h.send(A, Generate("n", [6], False, SamplingParams(max_tokens=50)))
    streamed, whole = engine_ids(h)
    h.table.on_step([FakeOutput(streamed, [1]), FakeOutput(whole, [1])], 0.0, "a")
    h.table.on_step([FakeOutput(streamed, [7]), FakeOutput(whole, [2])], 0.0, "b")
    h.take(A)
    h.now = 2.0
    h.send(A, Abort(["s", "n"], 4))
    by_id = {o.request_id: o for m in h.take(A) if isinstance(m, Outputs) for o in m.outputs}
    assert by_id["s"].new_token_ids == [7] and by_id["s"].weight_version == "b"
    assert by_id["n"].new_token_ids == [1, 2] and by_id["n"].weight_version == "b"
    assert [s.version for s in by_id["n"].finished.weight_versions] == ["a", "b"]


def test_terminals_the_gateway_makes_say_when_it_made_them():
    """finished_s of a terminal made by a second Hello, or by the drain deadline, is when
    the gateway ended the request, not its last token's time."""
    h = TableHarness()
    hello(h, A)
    hello(h, B)
    h.send(A, Generate("a", [5], True, SamplingParams(max_tokens=50)))
    h.send(B, Generate("b", [5], True, SamplingParams(max_tokens=50)))
    ea, eb = engine_ids(h)
    h.now = 1.0
    h.table.on_step([FakeOutput(ea, [1]), FakeOutput(eb, [1])], h.now)
    h.take(A)
    h.take(B)
    h.now = 4.0
    h.send(A, Hello(1, "t", 1.0))  # a second Hello ends the old session first
    (ended,) = [o for m in h.take(A) if isinstance(m, Outputs) for o in m.outputs]
    assert ended.finished.finish_reason is FinishReason.ABORT
    assert ended.finished.timings.finished_s == 4.0
    h.now = 6.5
    h.apply(h.table.abort_all(h.now))
    (drained,) = [o for m in h.take(B) if isinstance(m, Outputs) for o in m.outputs]
    assert drained.finished.timings.finished_s == 6.5


def test_goodbye_ends_the_session_at_once_counted_as_left_not_expired():
    """Issue 72 item 4: a client that closes says so; its live requests abort in the engine
    now, its session is gone, and no expiry is counted later."""
    from codec import Goodbye

    h = TableHarness()
    hello(h, A, interval=0.5)
    h.send(A, Generate("r1", [5], sampling=SamplingParams(max_tokens=50)))
    (prepared,) = h.submitted
    effects = h.send(A, Goodbye())
    assert effects.abort == [prepared.request_id]
    assert not h.table.has_session(A) and h.table.live_requests == 0
    (terminal,) = h.take(A)  # its request's ABORT terminal, nothing else
    assert isinstance(terminal, Outputs)
    assert terminal.outputs[0].finished.finish_reason is FinishReason.ABORT
    h.now += 10.0
    h.apply(h.table.expire(h.now))
    stats = h.table.gateway_stats()
    assert (stats["clients_left"], stats["clients_expired"]) == (1, 0)
    assert h.send(B, Goodbye()).replies == [] and h.table.gateway_stats()["clients_left"] == 1
