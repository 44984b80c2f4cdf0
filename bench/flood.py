"""A hostile client for the flood-impact figure: bursts of Generates at ``factor`` times
its admission limit (max_in_flight_per_client), plus malformed frames, as fast as the
gateway answers them. With ``invalid`` the Generates name an out-of-vocabulary id, so
the gateway refuses them all and the figure shows the frontend's own cost of a flood.
Raw pyzmq and codec only; it reads every reply (a flood, not a slow consumer) and
counts what it got.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from codec import (
    PROTOCOL_VERSION,
    Error,
    Generate,
    Hello,
    HelloAck,
    Outputs,
    Overloaded,
    SamplingParams,
    decode_server,
    encode,
)

__all__ = ["Flooder", "FloodStats"]

# Frames the gateway must refuse without harm: bad msgpack, an unknown version byte,
# a wrong frame count, an unknown tag, a Generate with an out-of-vocabulary id.
_MALFORMED: tuple[list[bytes], ...] = (
    [bytes([PROTOCOL_VERSION]), b"\xc1\xc1\xc1"],
    [b"\x63", b"\x91\x01"],
    [bytes([PROTOCOL_VERSION]), b"\x92\x01\x01", b"extra"],
    [bytes([PROTOCOL_VERSION]), b"\x92\x3f\x00"],
)


@dataclass
class FloodStats:
    """What the flooder sent and what the gateway answered."""

    bursts: int = 0
    generates_sent: int = 0
    malformed_sent: int = 0
    accepted_finished: int = 0
    overloaded: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "bursts": self.bursts,
            "generates_sent": self.generates_sent,
            "generates_per_s": self.generates_sent / self.seconds if self.seconds else 0.0,
            "malformed_sent": self.malformed_sent,
            "accepted_finished": self.accepted_finished,
            "overloaded": self.overloaded,
            "errors": dict(self.errors),
        }


class Flooder:
    """Floods ``address`` until ``stop`` is set; ``run`` returns the counts."""

    def __init__(
        self,
        address: str,
        *,
        factor: int = 10,
        max_tokens: int = 1,
        prompt_len: int = 8,
        malformed_per_burst: int = 64,
        invalid: bool = False,
        seed: int = 0,
        curve_keys: tuple[bytes, bytes, bytes] | None = None,
    ):
        self.address = address
        self.factor = factor
        self.max_tokens = max_tokens
        self.prompt_len = prompt_len
        self.malformed_per_burst = malformed_per_burst
        self.invalid = invalid  # out-of-vocabulary prompts: refused, never reach the engine
        self.curve_keys = curve_keys
        self.stats = FloodStats()
        self._rng = random.Random(seed)

    async def run(self, stop: asyncio.Event) -> FloodStats:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if self.curve_keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.curve_keys
        sock.connect(self.address)
        started = time.monotonic()
        try:
            await sock.send_multipart(encode(Hello(PROTOCOL_VERSION, "flooder", 30.0)))
            ack = await asyncio.wait_for(self._next(sock), 30)
            if not isinstance(ack, HelloAck):
                raise RuntimeError(f"flooder: expected HelloAck, got {ack!r}")
            burst = self.factor * ack.limits.max_in_flight_per_client
            vocab = ack.model.vocab_size
            sampling = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
            serial = 0
            while not stop.is_set():
                rids = [f"f{serial + i}" for i in range(1, burst + 1)]
                serial += burst
                # Replies are read while the burst goes out, as a real client reads: a
                # burst's refusals outnumber the gateway's per-client send queue
                # (client_send_hwm), and a client that reads none of them is a slow consumer.
                pending = set(rids)
                draining = asyncio.ensure_future(
                    self._drain(sock, pending, deadline=time.monotonic() + 30)
                )
                try:
                    # Malformed first: their refusals come before the last Generate's answer.
                    for i in range(self.malformed_per_burst):
                        await sock.send_multipart(_MALFORMED[i % len(_MALFORMED)])
                    for k, rid in enumerate(rids):
                        if k % 64 == 0:
                            # A send that succeeds at once does not yield: let the
                            # reader run.
                            await asyncio.sleep(0)
                        if self.invalid:
                            prompt = [vocab] * self.prompt_len
                        else:
                            prompt = [self._rng.randrange(vocab) for _ in range(self.prompt_len)]
                        await sock.send_multipart(encode(Generate(rid, prompt, False, sampling)))
                    self.stats.generates_sent += burst
                    self.stats.malformed_sent += self.malformed_per_burst
                    self.stats.bursts += 1
                    await draining
                finally:
                    draining.cancel()
        finally:
            self.stats.seconds = time.monotonic() - started
            sock.close(0)
        return self.stats

    async def _next(self, sock: zmq.asyncio.Socket):  # noqa: ANN202 - ServerMessage
        return decode_server(await sock.recv_multipart())

    async def _drain(self, sock: zmq.asyncio.Socket, pending: set[str], deadline: float) -> None:
        """Read replies until every Generate of the burst is answered (or the deadline)."""
        while pending and time.monotonic() < deadline:
            try:
                msg = await asyncio.wait_for(self._next(sock), deadline - time.monotonic())
            except TimeoutError:
                return
            if isinstance(msg, Overloaded):
                self.stats.overloaded += 1
                pending.discard(msg.request_id)
            elif isinstance(msg, Outputs):
                for out in msg.outputs:
                    if out.finished is not None:
                        self.stats.accepted_finished += 1
                        pending.discard(out.request_id)
            elif isinstance(msg, Error):
                self.stats.errors[msg.code.name] += 1
                if msg.request_id is not None:
                    pending.discard(msg.request_id)
