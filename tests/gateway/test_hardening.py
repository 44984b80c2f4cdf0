"""Hostile and broken clients against a live gateway (fake engine, real ROUTER over ipc://).

Fuzzing, floods, slow readers, CURVE and metrics. The gateway runs on its own
thread and loop, so hypothesis drives it with plain blocking sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request

import msgspec
import psutil
import pytest
import zmq
import zmq.auth
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client import Client, FinishReason, GatewayUnavailable, SamplingParams, load_client_keys
from codec import (
    VERSION_FRAME,
    Abort,
    Error,
    ErrorCode,
    Generate,
    Hello,
    Outputs,
    Overloaded,
    Ping,
    Pong,
    decode_server,
    encode,
)
from gateway.auth import CurveConfig
from gateway.engine import EngineInfo
from gateway.fake_engine import FakeEngine
from gateway.server import Gateway
from gateway.sessions import GatewayLimits
from tests.conftest import ipc_address
from tests.strategies import client_messages, hostile_generates

FUZZ_LIMITS = GatewayLimits(
    max_frame_bytes=1 << 20, max_in_flight_per_client=64, max_abort_ids=64, client_send_hwm=1000
)


class GatewayThread:
    """A Gateway on a FakeEngine, served on its own thread and event loop."""

    def __init__(
        self,
        limits: GatewayLimits = FUZZ_LIMITS,
        step_interval_s: float = 0.001,
        address: str | None = None,
        **kwargs,
    ):
        self.engine_kwargs = dict(step_interval_s=step_interval_s)
        self.limits = limits
        self.kwargs = kwargs
        self.address = address or ipc_address()
        self.loop = asyncio.new_event_loop()
        self.gateway: Gateway | None = None
        self.exit_code: int | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            engine = FakeEngine(
                info=EngineInfo("fake", 4096, 1000, (2,), 5, 64), **self.engine_kwargs
            )
            self.engine = engine
            self.gateway = Gateway(engine, self.address, self.limits, **self.kwargs)
            serving = asyncio.ensure_future(self.gateway.serve())
            await self.gateway.ready.wait()
            self.address = self.gateway.addresses[0]  # tcp port 0: the one bound
            self._ready.set()
            self.exit_code = await serving

        self.loop.run_until_complete(main())

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._ready.wait(10), "gateway did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.gateway.stop)
        self._thread.join(10)
        assert not self._thread.is_alive()

    def call(self, fn):
        """Run ``fn()`` on the gateway's loop and return its result (for state checks)."""
        done = threading.Event()
        box = []
        self.loop.call_soon_threadsafe(lambda: (box.append(fn()), done.set()))
        assert done.wait(5)
        return box[0]


def dealer(address: str, identity: bytes, **options) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in options.items():
        sock.setsockopt(getattr(zmq, option), value)
    sock.connect(address)
    return sock


def raw_session(address: str, identity: bytes, **options) -> zmq.Socket:
    """A DEALER that said Hello (60 s heartbeat) and read its HelloAck."""
    sock = dealer(address, identity, **options)
    sock.send_multipart(encode(Hello(1, identity.decode(), 60.0)))
    assert recv(sock).__class__.__name__ == "HelloAck"
    return sock


def recv(sock: zmq.Socket, timeout_ms: int = 5000):
    if not sock.poll(timeout_ms):
        raise TimeoutError("no frame from the gateway")
    return decode_server(sock.recv_multipart())


def drain_until_pong(sock: zmq.Socket, nonce: int) -> list:
    """Everything the gateway sent before answering Ping(nonce)."""
    sock.send_multipart(encode(Ping(nonce)))
    seen = []
    while True:
        msg = recv(sock)
        if isinstance(msg, Pong) and msg.nonce == nonce:
            return seen
        seen.append(msg)


def good_client_workload(address: str, stop: threading.Event, failures: list) -> None:
    """A well-behaved client: sequential requests whose exact tokens are known."""
    with Client(address, name="good") as client:
        i = 0
        while not stop.is_set():
            prompt = [10 + i % 50]
            done = client.complete(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            expected = [(prompt[0] + k) % 1000 for k in range(8)]
            if done.token_ids != expected or done.finish_reason is not FinishReason.LENGTH:
                failures.append((prompt, done))
            i += 1


@contextlib.contextmanager
def good_client_alongside(address: str):
    stop, failures = threading.Event(), []
    thread = threading.Thread(target=good_client_workload, args=(address, stop, failures))
    thread.start()
    try:
        yield failures
    finally:
        stop.set()
        thread.join(30)
        assert not thread.is_alive()


frame_lists = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=4),  # random frames and count
    st.tuples(st.just(VERSION_FRAME), st.binary(max_size=300)).map(list),  # random payload
    client_messages.map(encode),  # valid structure, random values
    hostile_generates.map(encode),  # valid structure, values at and past every bound
    client_messages.map(lambda m: [VERSION_FRAME, _mutate(encode(m)[1])]),
)


def _mutate(payload: bytes) -> bytes:
    """Flip one byte in the middle: mostly still msgpack, now with wrong types or lengths."""
    if not payload:
        return payload
    i = len(payload) // 2
    return payload[:i] + bytes([payload[i] ^ 0x5A]) + payload[i + 1 :]


FUZZ_CHUNK = 500  # examples per hypothesis run; its own memory grows with a run's length


def _fuzz(n_examples: int) -> None:
    """Fuzz one session with ``n_examples`` frame lists, in hypothesis runs of at most
    FUZZ_CHUNK. The memory check spans the runs after the first: one long run holds ~80 MB
    of hypothesis's own state that the allocator keeps afterwards, which hid nothing but
    failed the check; what the gateway kept per frame would show across runs."""
    with GatewayThread() as gw, good_client_alongside(gw.address) as failures:
        sock = raw_session(gw.address, b"fuzzer")
        process = psutil.Process()
        nonces = iter(range(1, 10**9))
        runs = max(1, n_examples // FUZZ_CHUNK)

        @settings(
            max_examples=n_examples // runs, deadline=None, suppress_health_check=list(HealthCheck)
        )
        @given(frame_lists)
        def one(frames: list[bytes]) -> None:
            sock.send_multipart(frames)
            for msg in drain_until_pong(sock, next(nonces)):
                if isinstance(msg, Error):
                    # A documented code for the peer's fault: never a gateway bug or a
                    # dead engine, and the message says what was wrong.
                    assert msg.code.known and msg.message, msg
                    assert msg.code not in (ErrorCode.INTERNAL, ErrorCode.ENGINE_DEAD), msg
            # Requests the fuzzer got accepted are ended, in the table and in the engine.
            sock.send_multipart(encode(Abort(None)))
            drain_until_pong(sock, next(nonces))
            assert gw.call(lambda: gw.gateway.table.client_request_ids(b"fuzzer")) == []
            assert gw.call(lambda: len(gw.engine._live)) <= 1  # the good client's one request

        rss_before = process.memory_info().rss
        for run in range(runs):
            one()  # each run draws afresh
            if run == 0 and runs > 1:
                rss_before = process.memory_info().rss
        drain_until_pong(sock, 0)
        sock.close()
        assert gw.call(lambda: gw.gateway.table.client_request_ids(b"fuzzer")) == []
        assert process.memory_info().rss - rss_before < 64 * 1024 * 1024
        assert gw.gateway.exit_code == 0
    assert failures == []


def test_fuzzed_frames_get_documented_errors_and_good_clients_are_unaffected():
    _fuzz(150)


@pytest.mark.slow
def test_fuzzing_long_run():
    _fuzz(5000)


@pytest.mark.parametrize("raw", [b"", b"\x00", b"\xff" * 64, b"\x93\x02\xa1r\x91\xff"])
def test_every_garbage_frame_is_answered_with_exactly_one_error(raw):
    with GatewayThread() as gw:
        sock = dealer(gw.address, b"garbage")
        sock.send_multipart([VERSION_FRAME, raw])
        replies = drain_until_pong(sock, 1)
        assert len(replies) == 1 and isinstance(replies[0], Error)
        sock.close()


def test_oversize_frames_are_refused_before_decoding_and_the_session_goes_on():
    with GatewayThread(GatewayLimits(max_frame_bytes=4096)) as gw:
        sock = dealer(gw.address, b"big")
        sock.send_multipart([VERSION_FRAME, msgspec.msgpack.encode([2, "r", [1] * 5000])])
        (err,) = drain_until_pong(sock, 1)
        assert err.code is ErrorCode.FRAME_TOO_LARGE
        sock.close()


def test_a_flooding_client_gets_overloaded_and_another_client_is_unaffected():
    limits = GatewayLimits(max_in_flight_per_client=20, client_send_hwm=100_000)
    with (
        GatewayThread(limits, step_interval_s=0.002) as gw,
        good_client_alongside(gw.address) as failures,
    ):
        flood = raw_session(gw.address, b"flood", SNDHWM=0, RCVHWM=0)
        sampling = SamplingParams(max_tokens=20, ignore_eos=True)
        for i in range(2000):
            flood.send_multipart(encode(Generate(f"f{i}", [7], True, sampling)))
        overloaded = accepted_terminals = 0
        deadline = time.monotonic() + 30
        while overloaded + accepted_terminals < 2000 and time.monotonic() < deadline:
            msg = recv(flood)
            if isinstance(msg, Overloaded):
                assert msg.limit == "max_in_flight_per_client" and msg.limit_value == 20
                overloaded += 1
            elif isinstance(msg, Outputs):
                accepted_terminals += sum(o.finished is not None for o in msg.outputs)
        assert overloaded + accepted_terminals == 2000
        assert overloaded >= 1500 and accepted_terminals >= 20
        flood.close()
    assert failures == []


def test_request_rate_limit_answers_overloaded():
    limits = GatewayLimits(max_request_rate_per_client=5.0, request_rate_burst=3)
    with GatewayThread(limits) as gw:
        sock = raw_session(gw.address, b"rate")
        for i in range(6):
            sock.send_multipart(encode(Generate(f"r{i}", [7], False, SamplingParams(max_tokens=1))))
        replies = drain_until_pong(sock, 1)
        limited = [m for m in replies if isinstance(m, Overloaded)]
        assert len(limited) == 3 and limited[0].limit == "max_request_rate_per_client"
        sock.close()


def test_a_client_that_stops_reading_is_ended_without_stalling_others():
    limits = GatewayLimits(client_send_hwm=20)
    with (
        GatewayThread(limits, step_interval_s=0.0005) as gw,
        good_client_alongside(gw.address) as failures,
    ):
        slow = raw_session(gw.address, b"slow", RCVHWM=20, RCVBUF=4096)
        sampling = SamplingParams(max_tokens=100_000, ignore_eos=True)
        for i in range(10):
            slow.send_multipart(encode(Generate(f"s{i}", [7], True, sampling)))

        def slow_live() -> int:
            return gw.call(lambda: len(gw.gateway.table.client_request_ids(b"slow")))

        deadline = time.monotonic() + 10
        while slow_live() < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow_live() == 10  # all accepted and streaming
        # It never reads: the gateway must end its requests and abort them in the engine
        # (aborts go out on the next housekeeping tick).
        deadline = time.monotonic() + 20
        while (slow_live() or len(gw.engine.aborted) < 10) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gw.call(lambda: gw.gateway.table.client_request_ids(b"slow")) == []
        # Only the slow client's 10 requests were aborted (the good client's all finish).
        assert len(gw.engine.aborted) == 10 and len(set(gw.engine.aborted)) == 10
        assert gw.call(lambda: gw.gateway.table.live_requests) <= 1  # the good client's
        # When it reads again, each of its requests ends with SLOW_CONSUMER.
        codes = {}
        deadline = time.monotonic() + 20
        while len(codes) < 10 and time.monotonic() < deadline:
            msg = recv(slow)
            if isinstance(msg, Error):
                codes[msg.request_id] = msg.code
        assert set(codes.values()) == {ErrorCode.SLOW_CONSUMER} and len(codes) == 10
        slow.close()
    assert failures == []


@pytest.fixture
def curve_keys(tmp_path):
    """Keys made as docs/DEPLOYMENT.md says, with `engine-gateway keys` (folders not made first)."""
    from gateway.keys_cli import keys_main

    allowed = tmp_path / "allowed"
    assert keys_main(["--server", str(tmp_path / "server")]) == 0
    assert (
        keys_main(["--client", "client", str(tmp_path / "client"), "--allow-dir", str(allowed)])
        == 0
    )
    assert keys_main(["--client", "stranger", str(tmp_path / "stranger")]) == 0
    assert sorted(p.name for p in allowed.iterdir()) == ["client.key"]
    return tmp_path, CurveConfig(tmp_path / "server" / "server.key_secret", allowed)


def test_curve_serves_the_allowed_key_and_refuses_wrong_or_no_key(curve_keys):
    root, config = curve_keys
    with GatewayThread(curve=config) as gw:
        good = load_client_keys(
            root / "server" / "server.key", root / "client" / "client.key_secret"
        )
        stranger = load_client_keys(
            root / "server" / "server.key", root / "stranger" / "stranger.key_secret"
        )
        with Client(gw.address, curve_keys=good) as client:
            assert client.complete([5], SamplingParams(max_tokens=3)).output_tokens == 3
            for keys in (stranger, None):
                with pytest.raises(GatewayUnavailable):
                    Client(gw.address, curve_keys=keys, connect_timeout_s=1.5)
            # Only the allowed key holds a session: the refused ones never reached the
            # table. (A closed client's session lasts until its heartbeat timeout, so this
            # is counted while the allowed client is still open.)
            assert gw.call(lambda: gw.gateway.table.connected_clients) == 1
            assert client.complete([6], SamplingParams(max_tokens=2)).output_tokens == 2


def test_metrics_endpoint_reports_requests_tokens_errors_and_clients():
    """Each metric counts what its name says: engine_gateway_pauses_total the Pause calls
    (issue 72 item 6), the process stalls beside it under their own name."""
    from gateway.auth import ControlPolicy
    from gateway.metrics import start_metrics_server

    with GatewayThread(control=ControlPolicy(open=True)) as gw:
        port = _free_port()
        start_metrics_server(gw.gateway, port)
        with Client(gw.address) as client:
            for _ in range(3):
                client.complete([5], SamplingParams(max_tokens=4, ignore_eos=True))
            with pytest.raises(Exception):  # noqa: B017 - any refusal will do
                client.complete([5000])
            client.pause("keep")
            client.resume()
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["engine_gateway_requests_accepted_total"] == 3
    assert values["engine_gateway_output_tokens_total"] == 12
    assert values['engine_gateway_requests_finished_total{reason="length"}'] == 3
    assert values['engine_gateway_errors_total{code="invalid_request"}'] == 1
    assert values["engine_gateway_connected_clients"] == 1
    assert values["engine_gateway_step_seconds_count"] >= 4
    assert "engine_gateway_in_flight_requests" in values
    assert values["engine_gateway_pauses_total"] == 1
    assert values["engine_gateway_process_stalls_total"] == 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_saturating_stream_does_not_starve_heartbeats():
    # A gateway process on the fake engine steps as fast as it can; a client streaming
    # flat out must still get its pings through, or its session would expire mid-stream.
    import sys

    from bench.targets import _Process
    from client import AsyncClient

    address = ipc_address("saturate")
    server = _Process(
        [sys.executable, "-m", "bench.fake_server", "--bind", address], "saturate.log"
    )
    try:
        async with AsyncClient(address, heartbeat_interval_s=0.2, connect_timeout_s=30) as c:
            start = time.monotonic()
            sampling = SamplingParams(max_tokens=150_000, ignore_eos=True)
            outs = 0
            last = None
            async for last in c.generate([10], sampling):  # noqa: B007 - the last one is kept
                outs += 1
            elapsed = time.monotonic() - start
        assert last.finished.finish_reason is FinishReason.LENGTH, (last.finished, elapsed)
        assert last.finished.output_tokens == 150_000 and outs == 150_000
        assert elapsed > 0.6  # it outlived at least one heartbeat timeout
    finally:
        server.stop()


def test_control_key_allow_list_admits_only_the_named_curve_client(curve_keys):
    """Both clients pass CURVE; only the one named by --control-key may pause the engine.
    The decision uses the ZAP User-Id of each message, not the (spoofable) identity."""
    from client import RequestFailed
    from gateway.auth import ControlPolicy

    root, config = curve_keys
    (root / "allowed" / "stranger.key").write_bytes(
        (root / "stranger" / "stranger.key").read_bytes()
    )
    policy = ControlPolicy.from_key_files([root / "client" / "client.key"])
    with GatewayThread(curve=config, control=policy) as gw:
        server = root / "server" / "server.key"
        trainer = load_client_keys(server, root / "client" / "client.key_secret")
        stranger = load_client_keys(server, root / "stranger" / "stranger.key_secret")
        with Client(gw.address, curve_keys=stranger, identity=b"same-identity") as other:
            with pytest.raises(RequestFailed) as info:
                other.pause("keep")
            assert info.value.code is ErrorCode.UNAUTHORIZED
            assert other.complete([5], SamplingParams(max_tokens=2)).output_tokens == 2
        assert gw.engine.calls == []
        # The stranger's session belonged to its key: the trainer uses
        # another routing id (on the stranger's, it would be refused: test_curve_sessions...).
        with Client(gw.address, curve_keys=trainer, identity=b"trainer-identity") as allowed:
            assert allowed.pause("keep").operation == "pause"
            assert allowed.health().paused
            assert allowed.resume().operation == "resume"
            # The stranger said Goodbye as it closed: its session is over, not left to expire.
            assert allowed.stats().gateway["connected_clients"] == 1
            assert allowed.stats().gateway["clients_left"] == 1
        assert gw.engine.calls == ["pause:keep", "resume"]


def test_curve_sessions_belong_to_their_key_not_to_a_routing_id(curve_keys):
    """Another allowed key that uses a live client's routing id can neither take its
    connection (ZeroMQ ignores the second connection) nor, once the first is gone, use or
    end its session (UNAUTHORIZED, nothing changes); after the session expires it may."""
    from client import RequestFailed

    root, config = curve_keys
    (root / "allowed" / "stranger.key").write_bytes(
        (root / "stranger" / "stranger.key").read_bytes()
    )
    server = root / "server" / "server.key"
    owner_keys = load_client_keys(server, root / "client" / "client.key_secret")
    stranger_keys = load_client_keys(server, root / "stranger" / "stranger.key_secret")
    same = dict(identity=b"shared-id", heartbeat_interval_s=0.5)
    with GatewayThread(curve=config) as gw:
        owner = Client(gw.address, curve_keys=owner_keys, **same)
        outputs = owner.generate([5], SamplingParams(max_tokens=10**6, ignore_eos=True))
        next(outputs)
        with pytest.raises(GatewayUnavailable):  # its Hello never reaches the gateway
            Client(gw.address, curve_keys=stranger_keys, connect_timeout_s=1.0, **same)
        for _ in range(20):  # the owner's stream goes on, to the owner
            assert next(outputs).new_token_ids
        assert gw.call(lambda: gw.gateway.table.live_requests) == 1
        outputs.close()  # aborted; then the owner's process dies with its session open
        time.sleep(0.2)
        owner._stop_loop()
        owner._async._sock.close(linger=0)
        time.sleep(0.3)
        with pytest.raises(RequestFailed) as info:
            Client(gw.address, curve_keys=stranger_keys, connect_timeout_s=5.0, **same)
        assert info.value.code is ErrorCode.UNAUTHORIZED
        assert "opened with another CURVE key" in info.value.message
        assert gw.call(lambda: gw.gateway.table.connected_clients) == 1  # not ended
        time.sleep(2.0)  # the owner's session expires (1.5 s)
        with Client(gw.address, curve_keys=stranger_keys, **same) as stranger:
            assert stranger.complete([5], SamplingParams(max_tokens=3)).output_tokens == 3


def test_the_health_command_says_whether_a_gateway_serves_with_curve_too(curve_keys, capsys):
    """Issue 72 item 3: ``engine-gateway health ADDR`` exits 0 when serving, 1 when the
    gateway answers but drains, 3 with a hint when no answer comes (a CURVE gateway
    without keys), and works with CURVE keys."""
    from gateway.health_cli import health_main

    with GatewayThread() as gw:
        assert health_main([gw.address]) == 0
        assert f"{gw.address}: serving" in capsys.readouterr().out
        gw.gateway.table.start_drain()
        assert health_main([gw.address]) == 1
        assert "draining" in capsys.readouterr().out
    root, config = curve_keys
    with GatewayThread(curve=config) as gw:
        assert health_main([gw.address, "--timeout", "0.5"]) == 3
        assert "CURVE gateway answers nothing without keys" in capsys.readouterr().err
        keys = [
            "--server-key", str(root / "server" / "server.key"),
            "--client-key", str(root / "client" / "client.key_secret"),
        ]  # fmt: skip
        assert health_main([gw.address, *keys]) == 0
    with pytest.raises(SystemExit) as usage:
        health_main([gw.address, "--server-key", "x"])
    assert usage.value.code == 2


def test_the_health_command_ends_in_its_codes_on_a_peer_that_is_no_gateway(capsys):
    """Issue 77 item 13: a ROUTER that answers garbage gets exit 1 with a sentence, not a
    traceback; a negative or zero --timeout and an address without its scheme are usage
    errors (2), never a wait without end."""
    import threading

    import zmq

    from gateway.health_cli import health_main

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_garbage() -> None:
        if router.poll(5000):
            peer, *_ = router.recv_multipart()
            router.send_multipart([peer, b"\xc1 not msgpack", b"more"])

    answering = threading.Thread(target=answer_garbage)
    answering.start()
    try:
        assert health_main([f"tcp://127.0.0.1:{port}", "--timeout", "5"]) == 1
        assert "is not a gateway's" in capsys.readouterr().err
    finally:
        answering.join()
        router.close(0)
    for argv in (["tcp://127.0.0.1:1", "--timeout", "-1"], ["tcp://127.0.0.1:1", "--timeout", "0"],
                 ["127.0.0.1:5557"]):  # fmt: skip
        with pytest.raises(SystemExit) as usage:
            health_main(argv)
        assert usage.value.code == 2, argv
    assert "tcp://HOST:PORT" in capsys.readouterr().err


def test_a_client_without_keys_at_a_curve_gateway_is_told_the_likely_cause(curve_keys):
    """Issue 72 item 5: no silent wait and no generic timeout: GatewayUnavailable naming
    the timeout used and CURVE keys as the likely cause, from the blocking Client too
    (whose connect waits its timeout_s)."""
    from client import GatewayUnavailable

    _, config = curve_keys
    with GatewayThread(curve=config) as gw:
        with pytest.raises(GatewayUnavailable) as info:
            Client(gw.address, timeout_s=0.5)
        message = str(info.value)
        assert "within 0.5s" in message and "CURVE gateway answers nothing" in message
        assert "load_client_keys" in message
        # A script that meets it ends with that error alone: no pending-task noise at exit.
        import subprocess
        import sys

        script = f"from client import Client; Client({gw.address!r}, timeout_s=0.5)"
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert done.returncode == 1 and "GatewayUnavailable" in done.stderr
        assert "Task was destroyed" not in done.stderr and "pending" not in done.stderr
