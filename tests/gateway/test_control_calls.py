"""Every control call ends, and in order (issue 37 items 2, 3, 8, 9, 10 and the planted
bugs the suite let through): calls that change the engine run one at a time; a call the
decoder refuses is answered with its call_id; a call under way when the engine dies gets
ENGINE_DEAD; ``paused`` follows what the engine did; calls without a session fail
retryably. A real gateway over ipc:// on a fake engine; the real engine's concurrent
LoadLora is in test_control.py."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from client import AsyncClient, FinishReason, RequestFailed, SamplingParams, SessionLost
from codec import VERSION_FRAME, ErrorCode, WakeUp, decode_client
from codec.errors import ProtocolError
from gateway.auth import ControlPolicy
from gateway.fake_engine import FakeEngine
from tests.conftest import running_gateway
from tests.helpers import stream_outcome

LONG = SamplingParams(max_tokens=10**7, ignore_eos=True)
OPEN = ControlPolicy(open=True)


class SlowControlEngine(FakeEngine):
    """A fake engine whose LoadLora takes a while, recording when each began and ended."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.loras: dict[str, int] = {}
        self.spans: list[tuple[str, str]] = []

    async def load_lora(self, name: str, path: str) -> None:
        self.spans.append(("start", name))
        if name in self.loras:
            from gateway.errors import RequestRejected

            raise RequestRejected(f"LoRA adapter {name!r} is already loaded; unload it first")
        lora_id = max(self.loras.values(), default=0) + 1  # picked before the wait, as vLLM
        await asyncio.sleep(0.05)
        self.loras[name] = lora_id
        self.spans.append(("end", name))


async def test_calls_that_change_the_engine_run_one_at_a_time_in_arrival_order():
    engine = SlowControlEngine()
    async with (
        running_gateway(engine, control=OPEN) as gw,
        AsyncClient(gw.addresses[0]) as a,
        AsyncClient(gw.addresses[0]) as b,
    ):
        results = await asyncio.gather(
            a.load_lora("u2", "/u"),
            b.load_lora("w2", "/w"),
            a.load_lora("u2", "/u-again"),
            return_exceptions=True,
        )
        assert [r.result for r in results[:2]] == ["u2", "w2"]
        assert isinstance(results[2], RequestFailed) and "already loaded" in str(results[2])
        assert sorted(engine.loras.values()) == [1, 2]  # distinct ids
        # One at a time: every start is followed by its own end (or its refusal) before the
        # next start. Which client's frames arrive first is up to the sockets.
        spans = engine.spans
        ends = [i for i, (kind, _) in enumerate(spans) if kind == "end"]
        assert len(ends) == 2 and len(spans) == 5, spans
        for i in ends:  # nothing began between a load's start and its end
            assert spans[i - 1] == ("start", spans[i][1]), spans


async def test_a_call_the_decoder_refuses_fails_with_its_call_id_not_for_ever():
    """``wake_up("weights")`` (tags must be a list): INVALID_MESSAGE reaches the caller."""
    async with (
        running_gateway(FakeEngine(), control=OPEN) as gw,
        AsyncClient(gw.addresses[0]) as client,
    ):
        async with asyncio.timeout(5):
            with pytest.raises(RequestFailed) as info:
                await client.wake_up("weights")  # type: ignore[arg-type]
        assert info.value.code is ErrorCode.INVALID_MESSAGE
        assert "WakeUp.tags" in info.value.message
        assert (await client.health()).state == "serving"  # the session goes on


async def test_an_abort_over_the_frame_limit_is_refused_by_the_client_before_sending():
    from gateway.sessions import GatewayLimits

    limits = GatewayLimits(max_frame_bytes=4096, max_abort_ids=4096)
    async with running_gateway(FakeEngine(), limits) as gw, AsyncClient(gw.addresses[0]) as client:
        ids = [f"request-{i:04d}-" + "x" * 40 for i in range(200)]  # ~10 KB, 200 < 4096 ids
        async with asyncio.timeout(5):
            with pytest.raises(RequestFailed) as info:
                await client.abort(ids)
        assert info.value.code is ErrorCode.FRAME_TOO_LARGE and "not sent" in info.value.message
        assert (await client.abort(ids[:3])).unknown == ids[:3]


def test_the_gateway_names_the_call_of_a_frame_it_cannot_decode():
    """FRAME_TOO_LARGE and INVALID_MESSAGE carry the call_id read from the frame's first
    bytes (an Abort's ids are walked over), as a Generate's request_id is."""
    big_abort = msgspec.msgpack.encode([3, ["r" * 60] * 200, 77])
    with pytest.raises(ProtocolError) as info:
        decode_client([VERSION_FRAME, big_abort], max_frame_bytes=4096)
    assert (info.value.code, info.value.call_id) == (ErrorCode.FRAME_TOO_LARGE, 77)
    bad_tags = msgspec.msgpack.encode([WakeUp.__struct_config__.tag, 12, "weights"])
    with pytest.raises(ProtocolError) as info:
        decode_client([VERSION_FRAME, bad_tags])
    assert (info.value.code, info.value.call_id) == (ErrorCode.INVALID_MESSAGE, 12)
    big_generate = msgspec.msgpack.encode([2, "g1", [7] * 5000])
    with pytest.raises(ProtocolError) as info:
        decode_client([VERSION_FRAME, big_generate], max_frame_bytes=4096)
    assert (info.value.request_id, info.value.call_id) == ("g1", None)


async def test_a_call_under_way_when_the_engine_dies_gets_engine_dead_with_its_call_id():
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine, control=OPEN) as gw, AsyncClient(gw.addresses[0]) as client:
        stream = client.generate([5], LONG)
        await anext(stream)
        waiting = asyncio.ensure_future(client.pause("wait"))  # waits for the stream
        await asyncio.sleep(0.1)
        assert not waiting.done()
        engine.kill()
        async with asyncio.timeout(5):
            with pytest.raises(RequestFailed) as info:
                await waiting
        assert info.value.code is ErrorCode.ENGINE_DEAD
        assert isinstance(await stream_outcome(stream), RequestFailed)


async def test_paused_is_reported_once_the_engine_paused_and_not_after_a_failed_pause():
    class FailingPause(FakeEngine):
        fail = True

        async def pause(self, mode: str, clear_cache: bool) -> None:
            if self.fail:
                raise RuntimeError("the engine refused to pause")
            await super().pause(mode, clear_cache)

    engine = FailingPause()
    async with running_gateway(engine, control=OPEN) as gw, AsyncClient(gw.addresses[0]) as client:
        with pytest.raises(RequestFailed) as info:
            await client.pause("keep")
        assert info.value.code is ErrorCode.INTERNAL
        assert not (await client.health()).paused
        engine.fail = False
        done = await client.pause("keep")
        assert (done.operation, done.result) == ("pause", "keep")  # the reply names the mode
        assert (await client.health()).paused
        assert (await client.resume()).operation == "resume"
        assert not (await client.health()).paused


async def test_pause_abort_ends_every_live_request_in_the_table_with_abort():
    """The table ends them itself (the fake engine's pause sends no outputs for them, as
    vLLM's may not), each with one ABORT terminal; the reply names the mode."""
    engine = FakeEngine(step_interval_s=0.01)
    async with running_gateway(engine, control=OPEN) as gw, AsyncClient(gw.addresses[0]) as client:
        streams = [client.generate([5 + i], LONG) for i in range(3)]
        for stream in streams:
            await anext(stream)
        done = await client.pause("abort")
        assert done.result == "abort"
        for stream in streams:
            last = None
            async for out in stream:
                last = out
            assert last.finished.finish_reason is FinishReason.ABORT
        assert gw.table.live_requests == 0
        await client.resume()


async def test_calls_without_a_session_fail_retryably_and_pending_calls_fail_on_session_loss():
    engine = FakeEngine(step_interval_s=0.01)
    async with (
        running_gateway(engine, control=OPEN) as gw,
        AsyncClient(gw.addresses[0], heartbeat_interval_s=5.0) as client,
    ):
        for call in (lambda: client.pause("keep"), lambda: client.abort(["x"])):
            # The gateway forgets the session (as after an expiry the client did not see).
            gw.table._clients.clear()
            with pytest.raises(SessionLost) as info:
                await call()
            assert info.value.retryable
            async with asyncio.timeout(5):
                while not client.connected:
                    await asyncio.sleep(0.01)
        # A call pending when the session is lost fails with SessionLost.
        stream = client.generate([5], LONG)
        await anext(stream)
        waiting = asyncio.ensure_future(client.pause("wait"))
        await asyncio.sleep(0.1)
        client._on_session_lost("test: the gateway went away")
        with pytest.raises(SessionLost):
            await waiting
        engine.paused = False


def test_a_frame_far_over_the_model_s_default_limit_is_answered_by_name():
    """The default limit follows the model (5 bytes a token + 64 KiB: 86 KB here); a
    Generate with a vocabulary-sized logit_bias of 1 MB, far over it, still gets
    FRAME_TOO_LARGE naming it (ZeroMQ's own cut, which answers nothing and disconnects,
    lies at 32 MiB at least), and an Abort that large names its call."""
    from codec import Error
    from gateway.sessions import GatewayLimits, frame_limit_for
    from tests.gateway.test_hardening import GatewayThread, drain_until_pong, raw_session

    with GatewayThread(GatewayLimits()) as gw:
        limit = frame_limit_for(4096)
        assert gw.call(lambda: gw.gateway.table.wire_limits.max_frame_bytes) == limit
        sock = raw_session(gw.address, b"big")
        bias = {i: 1.0 for i in range(70_000)}
        generate = msgspec.msgpack.encode([2, "huge", [5], True, {"logit_bias": bias}])
        assert len(generate) > 4 * limit
        sock.send_multipart([VERSION_FRAME, generate])
        abort = msgspec.msgpack.encode([3, [f"id-{i:06d}" for i in range(40_000)], 9])
        sock.send_multipart([VERSION_FRAME, abort])
        replies = [m for m in drain_until_pong(sock, 1) if isinstance(m, Error)]
        assert [(m.code, m.request_id, m.call_id) for m in replies] == [
            (ErrorCode.FRAME_TOO_LARGE, "huge", None),
            (ErrorCode.FRAME_TOO_LARGE, None, 9),
        ]
        sock.close()


async def test_a_missing_operation_is_unsupported_but_a_bug_inside_one_is_internal():
    """Engines inherit ``EngineControls``: what they lack is UNSUPPORTED by name; an
    AttributeError raised inside an operation (vLLM's, say) is not taken for a missing
    feature (it was UNSUPPORTED too)."""

    class Broken(FakeEngine):
        async def resume(self) -> None:
            raise AttributeError("'NoneType' object has no attribute 'resume_scheduler'")

    async with (
        running_gateway(Broken(), control=OPEN) as gw,
        AsyncClient(gw.addresses[0]) as client,
    ):
        with pytest.raises(RequestFailed) as info:
            await client.load_lora("x", "/x")
        assert info.value.code is ErrorCode.UNSUPPORTED and "load_lora" in info.value.message
        with pytest.raises(RequestFailed) as info:
            await client.resume()
        assert info.value.code is ErrorCode.INTERNAL and "resume_scheduler" in info.value.message
        assert (await client.stats()).engines == []


def test_identical_control_frames_are_each_answered():
    """Two equal frames (same call_id) are two calls: each gets its own answer, also when
    both are under way at once (Pause "wait" behind a running request)."""
    from codec import ControlDone, Generate, Pause, Resume, encode
    from tests.gateway.test_hardening import GatewayThread, drain_until_pong, raw_session

    with GatewayThread(control=OPEN) as gw:
        sock = raw_session(gw.address, b"twice")
        sock.send_multipart(encode(Generate("r", [5], True, SamplingParams(max_tokens=300))))
        for _ in range(2):
            sock.send_multipart(encode(Pause(5, "wait")))
        done, nonce, deadline = [], 0, time.monotonic() + 10
        while len(done) < 2 and time.monotonic() < deadline:
            nonce += 1
            done += [m for m in drain_until_pong(sock, nonce) if isinstance(m, ControlDone)]
            time.sleep(0.02)
        assert [(m.call_id, m.operation) for m in done] == [(5, "pause"), (5, "pause")]
        sock.send_multipart(encode(Resume(6)))
        sock.close()


async def test_a_control_call_from_a_client_not_allowed_is_refused_before_it_is_decoded():
    """Its tag alone refuses it (UNAUTHORIZED with its call_id, read from the headers):
    an UpdateWeights whose map would be INVALID_MESSAGE, or that holds a frame's worth of
    nested lists, is never decoded; the same call from an allowed client is."""
    from tests.gateway.test_server import raw_dealer, recv

    engine = FakeEngine()
    too_deep = {"a": [[[[1]]]]}  # past the backend map's depth: INVALID_MESSAGE if decoded
    nested = {"a": [[0]] * 1_000_000}  # ~3 MB: ~60 MB of lists if decoded
    async with running_gateway(engine) as gw, AsyncClient(gw.addresses[0]) as client:
        sock = await raw_dealer(gw.addresses[0])
        try:
            for update_info in (too_deep, nested):
                payload = msgspec.msgpack.encode([20, 31, update_info])
                await sock.send_multipart([VERSION_FRAME, payload])
                err = await recv(sock)
                assert (err.code, err.call_id) == (ErrorCode.UNAUTHORIZED, 31), err
                assert err.message.startswith("UpdateWeights changes or inspects the engine")
            await sock.send_multipart([VERSION_FRAME, msgspec.msgpack.encode([14, 32, ["x"] * 17])])
            err = await recv(sock)
            assert (err.code, err.call_id) == (ErrorCode.UNAUTHORIZED, 32), err
        finally:
            sock.close(0)
        assert (await client.health()).state == "serving"
    async with (
        running_gateway(FakeEngine(), control=OPEN) as gw,
        AsyncClient(gw.addresses[0]) as client,
    ):
        with pytest.raises(RequestFailed) as info:
            await client.update_weights(too_deep)
        assert info.value.code is ErrorCode.INVALID_MESSAGE
