"""Reads vLLM's KV cache events off every data-parallel rank into a ``PrefixIndex``.

The engines publish with ``--kv-events-config`` endpoints the gateway chose
(``gateway.vllm.args.enable_kv_events``: ipc sockets in a private folder), or, for ranks
on other hosts (headless), ones their own command line gave (``tcp://*:0`` with
``VLLM_HOST_IP``: vLLM binds that one address on a free port); each rank reports its own
(``get_kv_event_sources``). This feed's one SUB socket connects to every rank's PUB
socket, and a DEALER to a rank's replay ROUTER when a gap needs refilling.

The socket's monitor tells which ranks are connected: a rank is matched only while its
connection stands (before it is made, and after it is lost, it routes by load, as an
unsynced rank). A rank still unconnected ``connect_grace_s`` after the start is logged
once, with the likely cause: an endpoint without ``*`` makes vLLM's publisher *connect*
rather than bind (to the port plus its DP rank), so both ends connect and nothing flows. A
wildcard endpoint (``tcp://*:5557``) names no host to connect to and is refused by rank. A
publisher that disconnects (its engine died or restarts) resets that rank at once: its
cache is gone, and a restarted publisher's sequence may pass the old one's before the
feed hears it, which would otherwise read as a gap.

The feed takes batches without a wake-up per batch: ``drain`` applies whatever is waiting,
called before each routing decision and PrefixQuery (so they read a current index) and by a
task every ``drain_interval_s`` (20 ms) in between.

Each frame is ``[topic, 8-byte big-endian sequence, msgpack EventBatch]``. A sequence
jump is refilled from the rank's replay socket (send the first missing sequence; batches
come back, then an end marker of sequence -1); while it refills, the rank is unsynced and
routing on it falls back to load, its later batches are held until the refill ends, and
the other ranks' batches go on being applied. If the replay buffer no longer holds the missing
batches, or the replay does not answer within ``replay_timeout_s``, the rank is reset
(cleared, synced again from the next batch). A sequence that goes back is a restarted
publisher: the rank is reset. A malformed batch counts as a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from .prefix_index import EventBatch, PrefixIndex, decode_batch

__all__ = ["KvEventFeed"]

logger = logging.getLogger(__name__)

_END_SEQ = -1
_DRAIN_CHUNK = 64  # batches a periodic drain takes before other tasks get the loop
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def unreachable_endpoint_problem(address: str) -> str | None:
    """Why a publisher's reported endpoint cannot be connected to, or None. vLLM reports
    a wildcard endpoint (``tcp://*:5557``) as given: it names no host to reach."""
    if not address.startswith(("ipc://", "tcp://", "inproc://")):
        return f"its endpoint {address!r} is not ipc:// or tcp://"
    host = address.partition("://")[2].rpartition(":")[0]
    if address.startswith("tcp://") and host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        return (
            f"its publisher binds {address}, a wildcard that names no host to connect to"
            " (give the rank tcp://*:0 with VLLM_HOST_IP set: vLLM then binds that"
            " address alone and reports it)"
        )
    return None


class KvEventFeed:
    """One SUB socket for every rank's events; a replay request per gap."""

    def __init__(
        self,
        index: PrefixIndex,
        publishers: list[str],
        replay_addresses: list[str | None],
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        connect_grace_s: float = 5.0,
        drain_interval_s: float = 0.02,
    ):
        self.index = index
        self._replay_addresses = replay_addresses
        # The process's shared context (as vLLM's publisher uses), not one of its own per
        # feed: a context left to the garbage collector terms itself in ``__del__``, at
        # whatever point the collector runs.
        self._ctx = context or zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # no drops here: lost batches are gaps
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Watched before connecting: a connection made at once (ipc) is not missed.
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._ranks_by_endpoint: dict[bytes, int] = {}
        for rank, address in enumerate(publishers):
            index.ranks[rank].connected = False  # until its connection is made
            problem = unreachable_endpoint_problem(address)
            if problem is not None:
                logger.error("KV events of rank %d: %s: it routes by load", rank, problem)
                continue
            self.sub.connect(address)
            self._ranks_by_endpoint[address.encode()] = rank
        self._connect_grace_s = connect_grace_s
        self._plain = zmq.Socket.shadow(self.sub.underlying)  # NOBLOCK receives, no asyncio
        self._drain_interval_s = drain_interval_s
        self._held: dict[int, list[tuple[int, EventBatch]]] = {}  # rank -> during its refill
        self._refills: set[asyncio.Task] = set()
        self._closed = False
        self._task: asyncio.Task | None = None
        self._monitor_task: asyncio.Task | None = None
        self._grace_task: asyncio.Task | None = None
        self.batches = 0
        self.malformed = 0
        self.replayed = 0
        self.lag_s = 0.0  # wall clock now minus the engine's stamp of the last batch

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._drain_periodically())
        self._monitor_task = asyncio.ensure_future(self._watch_connections())
        self._grace_task = asyncio.ensure_future(self._report_unconnected())

    async def aclose(self) -> None:
        self._closed = True  # from here no batch is applied and no refill starts
        for task in (self._task, self._monitor_task, self._grace_task, *self._refills):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.sub.disable_monitor()
        self._monitor.close(linger=0)
        self.sub.close(linger=0)

    async def _watch_connections(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            rank = self._ranks_by_endpoint.get(event.get("endpoint", b""))
            if rank is None:
                continue
            index = self.index.ranks[rank]
            if event["event"] == zmq.EVENT_CONNECTED:
                if index.disconnects:
                    logger.warning("KV events of rank %d: reconnected", rank)
                index.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                logger.warning(
                    "KV events of rank %d: its publisher went away: index reset; the rank"
                    " routes by load until it reconnects",
                    rank,
                )
                index.connected = False
                index.disconnects += 1
                self.index.reset(rank, restarted=True)

    async def _report_unconnected(self) -> None:
        """Once, ``connect_grace_s`` after the start: each rank not yet connected."""
        await asyncio.sleep(self._connect_grace_s)
        for endpoint, rank in self._ranks_by_endpoint.items():  # (refused ones were logged)
            index = self.index.ranks[rank]
            if not index.connected and not index.disconnects:
                logger.warning(
                    "KV events of rank %d: not connected to its publisher at %s after"
                    " %.0f s; the rank routes by load until it is (a publisher whose"
                    " tcp endpoint has no '*' connects rather than binds: give remote"
                    " ranks tcp://*:0, docs/DEPLOYMENT.md)",
                    rank,
                    endpoint.decode(),
                    self._connect_grace_s,
                )

    def drain(self, limit: int | None = None) -> int:
        """Apply the batches waiting on the socket now, without waiting (at most ``limit``);
        returns how many frames it took. The router calls it before each decision (and
        PrefixQuery before each answer), so the index it reads is current, and a
        background task calls it every ``drain_interval_s``: no loop wake-up per batch."""
        if self._closed:  # its socket is closed
            return 0
        plain = self._plain
        taken = 0
        while (limit is None or taken < limit) and plain.getsockopt(_EVENTS) & _POLLIN:
            frames = plain.recv_multipart(_NOBLOCK)
            taken += 1
            try:
                self._on_frames(frames)
            except Exception:  # never let the feed die: the index goes unsynced instead
                logger.exception("a KV event batch could not be applied")
        return taken

    async def _drain_periodically(self) -> None:
        # Every engine step of every rank publishes a batch: at the ceiling, a thousand a
        # second on two ranks. Woken per batch (the loop's watch of the socket), the feed
        # cost 136 µs of CPU a batch on the 2-core VM, most of it the wake-up; drained on
        # a timer and before each decision, 61 µs (bench/probes/kv_feed_cost.py).
        while True:
            await asyncio.sleep(self._drain_interval_s)
            while self.drain(_DRAIN_CHUNK) == _DRAIN_CHUNK:
                await asyncio.sleep(0)  # a backlog: let the loop run between chunks

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.malformed += 1
            return
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:
            self.malformed += 1
            return
        rank = batch.data_parallel_rank or 0
        if not 0 <= rank < len(self.index.ranks):
            self.malformed += 1
            return
        self.batches += 1
        self.lag_s = lag = max(0.0, time.time() - batch.ts)
        self.index.ranks[rank].lag_s = lag
        held = self._held.get(rank)
        if held is not None:  # its gap is being refilled: kept, in order, until then
            held.append((seq, batch))
            return
        self._apply(rank, seq, batch)

    def _apply(self, rank: int, seq: int, batch: EventBatch) -> None:
        if self._closed:
            return
        index = self.index
        where = index.check_sequence(rank, seq)
        if where == "restart":
            logger.warning("KV events of rank %d restarted at %d: index reset", rank, seq)
            index.reset(rank, restarted=True)
        elif where == "gap":
            index.note_gap(rank)
            self._held[rank] = [(seq, batch)]  # applied after the refill
            task = asyncio.ensure_future(self._refill_then_apply_held(rank, seq))
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)
            return
        elif where == "old":
            return
        index.apply(rank, seq, batch)

    async def _refill_then_apply_held(self, rank: int, upto: int) -> None:
        """Refill ``rank``'s gap below ``upto``, then apply the batches held meanwhile (the
        other ranks' batches go on being applied)."""
        try:
            await self._refill(rank, upto)
        finally:
            held = self._held.pop(rank, [])  # (after aclose, _apply applies nothing)
            for i, (seq, batch) in enumerate(held):
                if rank in self._held:  # another gap among them: its refill holds the rest
                    self._held[rank].extend(held[i:])
                    break
                self._apply(rank, seq, batch)

    async def _refill(self, rank: int, upto: int) -> None:
        """Replay rank's batches from the first missing one up to ``upto`` (exclusive)."""
        index = self.index
        last = index.ranks[rank].last_seq
        start = 0 if last is None else last + 1  # (None: never here, a reset takes any)
        logger.warning(
            "KV events of rank %d: batches %d..%d lost: replaying", rank, start, upto - 1
        )
        address = self._replay_addresses[rank]
        if address is None:
            logger.warning("KV events of rank %d: no replay endpoint: reset", rank)
            index.reset(rank)
            return
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            replayed: list[tuple[int, EventBatch]] = []
            while True:
                if not await dealer.poll(self._replay_timeout_s * 1000):
                    raise TimeoutError("the replay socket did not answer")
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    raise ValueError("a malformed replay frame")
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                if seq < upto:
                    replayed.append((seq, decode_batch(frames[3])))
        except (TimeoutError, ValueError, msgspec.DecodeError, zmq.ZMQError) as exc:
            logger.warning("KV events of rank %d could not be replayed (%s): reset", rank, exc)
            index.reset(rank)
            return
        finally:
            dealer.close(linger=0)
        if [seq for seq, _ in replayed] != list(range(start, upto)):
            # Exactly the missing batches, in order: a hole in the middle (the replay
            # socket drops at its high-water mark) would leave removed blocks claimed.
            logger.warning("KV events of rank %d: the replay buffer lacks them: reset", rank)
            index.reset(rank)
            return
        for seq, batch in replayed:
            index.apply(rank, seq, batch)
        self.replayed += len(replayed)
        index.refilled(rank)
