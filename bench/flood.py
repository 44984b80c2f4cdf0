"""A hostile client for the flood-impact figure: bursts of Generates at ``factor`` times
its admission limit (max_in_flight_per_client), plus malformed frames, as fast as the
gateway answers them. With ``invalid`` the Generates name an out-of-vocabulary id, so
the gateway refuses them all and the figure shows the frontend's own cost of a flood.
Raw pyzmq and codec only; it reads every reply and keeps at most half the gateway's
``client_send_hwm`` unanswered (a flood, not a slow consumer), and counts what it got.
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
        self._unanswered = 0  # frames sent whose answer has not come
        self._rng = random.Random(seed)

    async def run(self, stop: asyncio.Event) -> FloodStats:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
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
            # A burst's answers outnumber the gateway's per-client send queue
            # (client_send_hwm), and a client that leaves that many unread is a slow
            # consumer: keep at most half of it unanswered, whatever the scheduling.
            hwm = ack.limits.client_send_hwm
            window = max(1, hwm // (2 * max(1, self.max_tokens))) if hwm else burst
            vocab = ack.model.vocab_size
            sampling = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
            serial = 0
            while not stop.is_set():
                # Malformed first: their refusals come before the last Generate's answer.
                frames = [_MALFORMED[i % len(_MALFORMED)] for i in range(self.malformed_per_burst)]
                for _ in range(burst):
                    serial += 1
                    if self.invalid:
                        prompt = [vocab] * self.prompt_len
                    else:
                        prompt = [self._rng.randrange(vocab) for _ in range(self.prompt_len)]
                    frames.append(encode(Generate(f"f{serial}", prompt, False, sampling)))
                if not await self._send_burst(sock, frames, window, time.monotonic() + 30):
                    break  # the gateway stopped answering: what was counted stands
                self.stats.generates_sent += burst
                self.stats.malformed_sent += self.malformed_per_burst
                self.stats.bursts += 1
        finally:
            self.stats.seconds = time.monotonic() - started
            sock.close(0)
        return self.stats

    async def _send_burst(
        self, sock: zmq.asyncio.Socket, bursts: list[list[bytes]], window: int, deadline: float
    ) -> bool:
        """Send every frame with at most ``window`` unanswered, then read the rest of the
        answers; False if the deadline passed first."""
        for k, frames in enumerate(bursts):
            while self._unanswered >= window:
                if not await self._read(sock, deadline):
                    return False
            await sock.send_multipart(frames)
            self._unanswered += 1
            if k % 64 == 63:
                # A send that succeeds at once does not yield: let the gateway run (it
                # may share this loop) and take what it has answered so far.
                await asyncio.sleep(0)
                self._read_ready(sock)
        while self._unanswered:
            if not await self._read(sock, deadline):
                return False
        return True

    async def _next(self, sock: zmq.asyncio.Socket):  # noqa: ANN202 - ServerMessage
        return decode_server(await sock.recv_multipart())

    async def _read(self, sock: zmq.asyncio.Socket, deadline: float) -> bool:
        """Wait for one reply, then take every reply already here; False at the deadline."""
        try:
            msg = await asyncio.wait_for(self._next(sock), deadline - time.monotonic())
        except TimeoutError:
            return False
        self._count(msg)
        self._read_ready(sock)
        return True

    def _read_ready(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            ready = sock.recv_multipart(zmq.NOBLOCK)  # done at once: a reply or Again
            if ready.exception() is not None:
                return
            self._count(decode_server(ready.result()))

    def _count(self, msg) -> None:  # noqa: ANN001 - ServerMessage
        """Tally one reply; a refusal or a request's final output answers one frame sent."""
        if isinstance(msg, Overloaded):
            self.stats.overloaded += 1
            self._unanswered -= 1
        elif isinstance(msg, Outputs):
            for out in msg.outputs:
                if out.finished is not None:
                    self.stats.accepted_finished += 1
                    self._unanswered -= 1
        elif isinstance(msg, Error):
            self.stats.errors[msg.code.name] += 1
            self._unanswered -= 1
