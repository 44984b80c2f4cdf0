"""Soak: thousands of requests with random aborts and client restarts, real CPU engine.

Within each connection every accepted request must get exactly one terminal and
nothing after it (TerminalLedger). Requests still live when a client restarts
are ended by the gateway (same identity: before the new HelloAck; new identity:
at the heartbeat timeout); at the end the gateway holds no request, the engine
holds none, and memory is back near its baseline.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random

import psutil
import pytest
import zmq
import zmq.asyncio

from codec import Abort, Generate, Hello, HelloAck, Outputs, SamplingParams, decode_server, encode
from tests.gateway.test_lifecycle import wait_engine_idle
from tests.helpers import TerminalLedger

pytestmark = pytest.mark.engine


class SoakClient:
    def __init__(self, address: str, seed: int, total: int):
        self.address = address
        self.rng = random.Random(seed)
        self.total = total
        self.submitted = 0
        self.connection = 0
        self.identity = f"soak-{seed}-{os.getpid()}".encode()
        self.sock: zmq.asyncio.Socket | None = None
        self.ledger = TerminalLedger()
        self.checked_ledgers: list[TerminalLedger] = []
        self.prefix = ""
        self.next_restart = 150

    async def connect(self, new_identity: bool) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.checked_ledgers.append(self.ledger)  # its live requests vanish with it
        if new_identity:
            self.identity += b"'"
        self.connection += 1
        self.prefix = f"k{self.connection}-"
        self.ledger = TerminalLedger()
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self.sock = sock
        await sock.send_multipart(encode(Hello(1, "soak", 0.2)))
        while not isinstance(await self.recv(), HelloAck):
            pass  # terminals of the previous connection's requests (same identity)

    async def recv(self):
        async with asyncio.timeout(30):
            msg = decode_server(await self.sock.recv_multipart())
        if isinstance(msg, Outputs):
            mine = [o for o in msg.outputs if o.request_id.startswith(self.prefix)]
            msg = Outputs(mine)
        self.ledger.observe(self.identity, msg)
        return msg

    async def run(self) -> None:
        await self.connect(new_identity=False)
        rng = self.rng
        while self.submitted < self.total:
            while len(self.ledger.current) < 16 and self.submitted < self.total:
                rid = f"{self.prefix}{self.submitted}"
                n = 2 if rng.random() < 0.1 else 1
                sampling = SamplingParams(
                    temperature=rng.choice([0.0, 1.0]),
                    n=n,
                    max_tokens=rng.randint(1, 12),
                    ignore_eos=True,
                )
                await self.sock.send_multipart(
                    encode(
                        Generate(
                            rid,
                            [rng.randrange(4, 512) for _ in range(rng.randint(1, 40))],
                            rng.random() < 0.7,
                            sampling,
                        )
                    )
                )
                self.ledger.submitted(self.identity, rid, n)
                self.submitted += 1
                if rng.random() < 0.2:
                    victims = [k[1] for k in self.ledger.current]
                    await self.sock.send_multipart(
                        encode(
                            Abort(
                                [rng.choice(victims), "unknown-id"] if rng.random() < 0.8 else None
                            )
                        )
                    )
            await self.recv()
            if self.submitted >= self.next_restart:
                self.next_restart += 150
                await self.connect(new_identity=rng.random() < 0.5)
        while self.ledger.current:
            await self.recv()
        self.checked_ledgers.append(self.ledger)
        self.sock.close(linger=0)


async def test_soak_every_request_ends_once_and_nothing_leaks(request, real_gateway, vllm_engine):
    total = 5000 if request.config.getoption("--run-slow") else 600
    process = psutil.Process()
    gc.collect()
    rss_before = process.memory_info().rss
    clients = [SoakClient(real_gateway.addresses[0], seed, total) for seed in range(4)]
    async with asyncio.timeout(600):
        await asyncio.gather(*(c.run() for c in clients))
    for c in clients:
        for ledger in c.checked_ledgers[:-1]:  # restarted connections: nothing after terminal
            assert not ledger.after_terminal
        c.checked_ledgers[-1].assert_complete()  # the last connection ran to the end
        assert sum(len(ledger.finished) for ledger in c.checked_ledgers) > 0
    assert sum(c.connection for c in clients) > len(clients)  # restarts happened
    table = real_gateway.table
    async with asyncio.timeout(10):  # vanished identities expire after 0.6 s
        while table.live_requests or table.live_engine_request_ids():
            await asyncio.sleep(0.05)
    await wait_engine_idle(vllm_engine)
    gc.collect()
    assert process.memory_info().rss - rss_before < 100 * 1024 * 1024
