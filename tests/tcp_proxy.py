"""A loopback TCP proxy whose connections can be reset (RST on both sides), on its own
thread: a client and a gateway see a network failure, and ZeroMQ reconnects through it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading


class ResettingProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port``; ``reset()`` kills every
    connection open now with a TCP reset, and new ones are forwarded as before."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.resets = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tcp-proxy")

    def __enter__(self) -> ResettingProxy:
        self._thread.start()
        assert self._started.wait(10), "proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Reset every open connection (both sides get RST), from any thread."""
        done = threading.Event()

        def abort_all() -> None:
            for writer in list(self._writers):
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            self._writers.clear()
            self.resets += 1
            done.set()

        self._loop.call_soon_threadsafe(abort_all)
        assert done.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._forward, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await source.read(1 << 16):
                    sink.write(data)
                    await sink.drain()
            sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
