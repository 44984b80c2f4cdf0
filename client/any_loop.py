"""A gateway client usable from any event loop: ``pool_on_own_loop``.

An AsyncClient or GatewayPool belongs to the event loop that connected it. A caller that
awaits one client from several loops needs one tied to none: SkyRL's trainer builds its
inference client with no loop running (``get_inference_client()``), puts it to sleep under
one ``asyncio.run`` and trains under another. ``pool_on_own_loop(addresses)`` connects a
GatewayPool on an event loop of its own (a daemon thread) and answers with an
``OnOwnLoop`` view of it: each coroutine method is run on that loop and awaited from the
caller's; cancelling the await cancels the call there (a request is aborted, as anywhere).
``close()`` (or ``await aclose()``) ends the pool and the thread.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Sequence
from typing import Any

from .errors import GatewayUnavailable
from .pool import GatewayPool

__all__ = ["OnOwnLoop", "pool_on_own_loop"]


class OnOwnLoop:
    """``target`` (an AsyncClient or GatewayPool) seen from any loop: its coroutine methods
    run on ``loop``; ``clients`` (a pool's) are seen the same way; plain attributes and
    properties read as they are. Its other methods (``generate``'s streams) are not
    offered: they would run on the caller's loop."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop):
        self._target = target
        self._loop = loop

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name == "clients":
            return [OnOwnLoop(client, self._loop) for client in value]
        if inspect.iscoroutinefunction(value):

            async def on_own_loop(*args: Any, **kwargs: Any) -> Any:
                return await self._on_loop(value(*args, **kwargs))

            return on_own_loop
        if callable(value):
            raise AttributeError(
                f"{type(self._target).__name__}.{name} is not a coroutine method: it would run"
                " on the caller's loop, not the client's (use the client on its own loop)"
            )
        return value

    async def _on_loop(self, coro: Any) -> Any:
        """``coro`` run on the client's loop, awaited from the caller's; GatewayUnavailable
        at once when that loop was stopped (the pool closed), as a closed client raises."""
        if self._loop.is_closed() or not self._loop.is_running():
            coro.close()
            raise GatewayUnavailable("client closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))


class _OwnLoopPool(OnOwnLoop):
    """The pool view ``pool_on_own_loop`` answers: it also owns the loop's thread."""

    def __init__(
        self, pool: GatewayPool, loop: asyncio.AbstractEventLoop, thread: threading.Thread
    ):
        super().__init__(pool, loop)
        self._thread = thread

    async def aclose(self) -> None:
        """Close the pool (its live requests are aborted), then stop its loop's thread and
        close the loop. A second close does nothing; calls after it raise at once."""
        if not self._loop.is_running():
            return
        try:
            await self._on_loop(self._target.aclose())
        finally:
            await asyncio.to_thread(_stop_loop_thread, self._loop, self._thread)

    def close(self) -> None:
        """``aclose`` for a caller with no loop running."""
        if not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._target.aclose(), self._loop).result(30)
        finally:
            _stop_loop_thread(self._loop, self._thread)


def _stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Stop ``loop`` (run by ``thread``), wait for the thread, and close the loop (its
    selector and self-pipe: three file descriptors)."""
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()


def pool_on_own_loop(addresses: str | Sequence[str], **pool_kwargs: Any) -> OnOwnLoop:
    """A GatewayPool over ``addresses`` (one or several), connected on a loop of its own;
    blocks until one gateway has a session (at most ``connect_timeout_s``, 60 s by default;
    GatewayUnavailable after). Keyword arguments go to GatewayPool."""
    addresses = [addresses] if isinstance(addresses, str) else list(addresses)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="gateway-pool-loop")
    thread.start()
    try:
        # Made on its own loop: a pool's tasks and futures belong to the loop that made them.
        pool = asyncio.run_coroutine_threadsafe(_connected(addresses, pool_kwargs), loop).result()
    except BaseException:
        _stop_loop_thread(loop, thread)
        raise
    return _OwnLoopPool(pool, loop, thread)


async def _connected(addresses: list[str], pool_kwargs: dict[str, Any]) -> GatewayPool:
    pool = GatewayPool(addresses, **pool_kwargs)
    await pool.connect()
    return pool
